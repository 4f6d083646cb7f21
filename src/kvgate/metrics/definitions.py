"""Every metric kvgate exports, in one place.

Labels are bounded: `tenant`, `model` and `backend` come from the configuration (unknown
values are never used as labels), `reason`, `outcome` and `cause` are enums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Requests decided by kvgate, by outcome (admitted, rejected, passthrough) and reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens",
            "Prompt tokens of settled requests (backend-reported when available).",
            ["tenant", "model"],
            registry=r,
        )
        self.output_tokens = Counter(
            "kvgate_output_tokens",
            "Output tokens of settled requests (backend-reported, or counted from the "
            "streamed text when the stream was cut).",
            ["tenant", "model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvgate_cached_prompt_tokens",
            "Prompt tokens the backend reported as served from its prefix cache.",
            ["tenant", "model"],
            registry=r,
        )
        self.settlements = Counter(
            "kvgate_settlements",
            "Reservations settled, by how the request ended.",
            ["backend", "cause"],
            registry=r,
        )
        self.kv_tokens_in_flight = Gauge(
            "kvgate_kv_tokens_in_flight",
            "KV tokens reserved by admitted, unsettled requests.",
            ["backend"],
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "kvgate_requests_in_flight",
            "Admitted, unsettled requests.",
            ["backend"],
            registry=r,
        )
        self.engine_unbooked_tokens = Gauge(
            "kvgate_engine_unbooked_tokens",
            "Tokens an engine counted (vllm:prompt_tokens_total, vllm:generation_tokens_total) "
            "beyond what kvgate booked for that ledger (a backend or a pool's endpoint), since "
            "this replica began watching; negative: booked more than the engine counted.",
            ["backend", "kind"],
            registry=r,
        )
        self.kv_budget_tokens = Gauge(
            "kvgate_kv_budget_tokens",
            "The configured KV token budget of each backend.",
            ["backend"],
            registry=r,
        )
        self.reserved_unused_tokens = Counter(
            "kvgate_reserved_unused_tokens",
            "KV tokens reserved at admission that the request did not use.",
            ["backend"],
            registry=r,
        )
        self.prompt_count_error = Histogram(
            "kvgate_prompt_count_error_tokens",
            "kvgate's prompt count minus the backend's usage.prompt_tokens, per request.",
            ["model"],
            buckets=(-100, -10, -1, -0.5, 0.5, 1, 10, 100, float("inf")),
            registry=r,
        )
        self.prompt_count_mismatches = Counter(
            "kvgate_prompt_count_mismatches",
            "Requests whose prompt count differed from the backend's usage.",
            ["model"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvgate_decision_seconds",
            "Time from the request body's arrival to kvgate's admission reply.",
            ["outcome"],
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.stream_disconnects = Counter(
            "kvgate_stream_disconnects",
            "ext_proc streams that ended before the response finished, by phase.",
            ["phase"],
            registry=r,
        )
        self.expired_leases = Counter(
            "kvgate_expired_leases",
            "Reservations freed because their lease ran out (nobody settled them).",
            ["backend"],
            registry=r,
        )
        self.lease_renewals = Counter(
            "kvgate_lease_renewals",
            "Lease renewals of open requests, by result: renewed, lost (the store no longer "
            "held the lease: its capacity was freed, the request is still charged at "
            "settlement) or error (the store could not be reached).",
            ["result"],
            registry=r,
        )
        self.late_settlements = Counter(
            "kvgate_late_settlements",
            "Settlements of requests whose lease had expired before they ended (capacity "
            "already freed; charged from the request's billing record).",
            ["backend"],
            registry=r,
        )
        self.unmetered_settlements = Counter(
            "kvgate_unmetered_settlements",
            "Completed requests whose usage could not be read from the answer: charged the "
            "reservation's worst case.",
            ["backend"],
            registry=r,
        )
        self.cost_usd = Counter(
            "kvgate_cost_usd",
            "Cost of settled requests in US dollars (exact integer pico-dollars in the ledger).",
            ["tenant", "model"],
            registry=r,
        )
        self.shadow_rejections = Counter(
            "kvgate_shadow_rejections",
            "Requests a shadowed limit would have rejected (admitted anyway).",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_remaining_tokens = Gauge(
            "kvgate_tenant_remaining_tokens",
            "Tokens left in the tenant's TPM bucket at its last decision.",
            ["tenant"],
            registry=r,
        )
        self.tenant_remaining_requests = Gauge(
            "kvgate_tenant_remaining_requests",
            "Requests left in the tenant's RPM bucket at its last decision.",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "kvgate_tenant_rejections",
            "Requests rejected by kvgate, by tenant and reason.",
            ["tenant", "reason"],
            registry=r,
        )
        self.config_reloads = Counter(
            "kvgate_config_reloads",
            "Configuration reloads, by result (success, failure).",
            ["result"],
            registry=r,
        )
        self.config_generation = Gauge(
            "kvgate_config_generation",
            "How many configurations this process has applied (1 at start).",
            registry=r,
        )
        # Mutual TLS listeners: certificates the client CA signed but `allowed_clients` does
        # not list (listener: admin, operator_https, grpc).
        self.client_certificates_refused = Counter(
            "kvgate_client_certificates_refused",
            "Calls, requests or ext_proc streams refused because the client certificate, "
            "though signed by the trusted CA, is not in the listener's allowed_clients.",
            ["listener"],
            registry=r,
        )
        self.internal_errors = Counter(
            "kvgate_internal_errors",
            "Unexpected errors while handling a stream (each answered, none crashed kvgate).",
            ["phase"],
            registry=r,
        )
        # The shared state store (Redis).
        self.store_up = Gauge(
            "kvgate_store_up",
            "1 while the state store answers (always with the memory store), 0 while Redis "
            "does not and this replica applies the failure policy.",
            registry=r,
        )
        self.store_errors = Counter(
            "kvgate_store_errors",
            "Shared-store calls that failed or timed out, by operation.",
            ["op"],
            registry=r,
        )
        self.store_fallback_decisions = Counter(
            "kvgate_store_fallback_decisions",
            "Admission decisions taken by this replica's local store because the shared store "
            "was unavailable (fail_open), by outcome.",
            ["outcome"],
            registry=r,
        )
        self.store_pending_settlements = Gauge(
            "kvgate_store_pending_settlements",
            "Settlements waiting for the shared store to come back.",
            registry=r,
        )
        self.store_reconciled_settlements = Counter(
            "kvgate_store_reconciled_settlements",
            "Settlements delivered late to the shared store: 'settle' (a lease of the shared "
            "store) or 'local' (a request admitted by the local fallback).",
            ["kind"],
            registry=r,
        )
        self.store_dropped_settlements = Counter(
            "kvgate_store_dropped_settlements",
            "Settlements dropped because the queue waiting for the shared store was full.",
            registry=r,
        )
        # Pools (several endpoints per backend) and their queues. `endpoint` values come
        # from the pool's static list or DNS: bounded by the pool's size.
        self.pool_picks = Counter(
            "kvgate_pool_picks",
            "Requests placed on a pool endpoint, by whether a remembered prompt prefix "
            "chose it (affinity: hit) or load alone (miss).",
            ["pool", "endpoint", "affinity"],
            registry=r,
        )
        self.pool_endpoints = Gauge(
            "kvgate_pool_endpoints",
            "Endpoints of a pool by state: pickable, unhealthy (failed or stale checks), "
            "shedding (back-pressure), capacity_unknown.",
            ["pool", "state"],
            registry=r,
        )
        self.pool_degraded_picks = Counter(
            "kvgate_pool_degraded_picks",
            "Placements made while no endpoint of the pool passed its checks (all failing or "
            "stale): kvgate admitted against its own reservations instead of halting.",
            ["pool"],
            registry=r,
        )
        # `reason` is an address class (kvgate.capacity.membership): bounded.
        self.pool_refused_addresses = Counter(
            "kvgate_pool_refused_addresses",
            "Addresses a pool's DNS name resolved to that were refused membership, counted "
            "when each first appears: loopback, link_local, unspecified, multicast, public, "
            "not_allowed (outside endpoint_discovery.allowed_cidrs).",
            ["pool", "reason"],
            registry=r,
        )
        self.kv_budget_capped_reports = Counter(
            "kvgate_kv_budget_capped_reports",
            "Scrapes whose reported KV cache exceeded max_auto_kv_budget_tokens: the "
            "automatic budget was capped there (`backend` as in kvgate_kv_budget_tokens).",
            ["backend"],
            registry=r,
        )
        self.response_cache = Counter(
            "kvgate_response_cache",
            "Metered requests by what the response cache did: hit (answered from it), miss "
            "(ran, its answer stored when complete), bypass (not cacheable, or an identical "
            "request was running).",
            ["result"],
            registry=r,
        )
        self.response_cache_saved_tokens = Counter(
            "kvgate_response_cache_saved_tokens",
            "Prompt and output tokens the backend did not have to process thanks to hits.",
            ["tenant", "model"],
            registry=r,
        )
        self.semantic_cache = Counter(
            "kvgate_semantic_cache",
            "Requests the semantic cache looked at, by result: hit (a similar question's "
            "answer), miss (ran, indexed when complete), bypass (not eligible: other turns "
            "than a last user question, tools, sampling, too long), unavailable (no vector: "
            "the embedder or the store failed; the request ran uncached).",
            ["result"],
            registry=r,
        )
        self.semantic_cache_guard_refusals = Counter(
            "kvgate_semantic_cache_guard_refusals",
            "Stored questions above the similarity threshold that the lexical guard refused "
            "(other numbers, words or order): the false hits it prevented.",
            registry=r,
        )
        self.semantic_cache_similarity = Histogram(
            "kvgate_semantic_cache_similarity",
            "Cosine similarity of the stored question that answered each semantic hit.",
            buckets=(0.80, 0.85, 0.90, 0.92, 0.94, 0.96, 0.98, 0.99, 1.0),
            registry=r,
        )
        self.semantic_cache_saved_tokens = Counter(
            "kvgate_semantic_cache_saved_tokens",
            "Prompt and output tokens the backend did not process thanks to semantic hits.",
            ["tenant", "model"],
            registry=r,
        )
        self.semantic_cache_bypasses = Counter(
            "kvgate_semantic_cache_bypasses",
            "Questions the semantic cache would not compare (never a hit, never stored), by "
            "what they hold that the lexical guard cannot see but the model reads: "
            "tag_characters, bidi_controls, format_characters, control_characters, "
            "private_or_unassigned, variation_selectors. Also counted as bypass in "
            "kvgate_semantic_cache.",
            ["reason"],
            registry=r,
        )
        self.idempotent_requests = Counter(
            "kvgate_idempotent_requests",
            "Requests with an Idempotency-Key by what kvgate did: started (ran), replay "
            "(the stored answer), not_kept (409: completed, its answer not kept), mismatch "
            "(422, another body), in_progress (409), too_many_waiting and quota_exhausted "
            "(429), unchecked (the store was down under fail_open: ran unprotected).",
            ["result"],
            registry=r,
        )
        self.answers_not_stored = Counter(
            "kvgate_answers_not_stored",
            "2xx answers that ended normally but were not stored for a cache or an "
            "Idempotency-Key (nothing replays them; a retry runs anew), by why they are not "
            "complete by the request's API (chat, completions, Messages, Responses): status, "
            "content_type, stream_mismatch, empty, malformed, error (in-band error event or "
            "error body), no_done (no end of stream: [DONE], message_stop, a terminal "
            "response event), no_choices, unfinished_choice (no finish or stop reason), "
            "failed_choice (an abort, an error, a failed or filtered response); or because "
            "the store did not "
            "keep them: too_large, over_quota (the tenant's bytes, or Redis memory), no_room "
            "(no room for another Idempotency-Key), served_otherwise (a budget fallback or "
            "clamp: not the asked request's answer).",
            ["reason"],
            registry=r,
        )
        self.queue_length = Gauge(
            "kvgate_queue_length",
            "Requests waiting for room in a pool, by priority class.",
            ["pool", "priority"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "kvgate_queue_wait_seconds",
            "Time a request waited in its pool's queue before it was admitted.",
            ["pool", "tenant", "priority"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30),
            registry=r,
        )
        self.queue_drops = Counter(
            "kvgate_queue_drops",
            "Requests that left a pool's queue without admission: queue_full, "
            "tenant_queue_full, wait_expired, disconnected, error.",
            ["pool", "tenant", "reason"],
            registry=r,
        )


class TokenFileSource(Protocol):
    """What the token file collector reads at scrape time (kvgate.admin.auth.OperatorAuth)."""

    def token_file_valid(self) -> bool | None: ...


class TokenFileCollector(Collector):
    """kvgate_operator_token_file_valid, read when scraped (so a deleted or broken file shows
    even when no operator calls). No sample without server.admin_token_file."""

    def __init__(self, source: TokenFileSource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        valid = self._source.token_file_valid()
        gauge = GaugeMetricFamily(
            "kvgate_operator_token_file_valid",
            "1 while server.admin_token_file holds a valid operator token, 0 while it is "
            "missing or unusable (every operator token is then refused).",
        )
        if valid is not None:
            gauge.add_metric([], 1 if valid else 0)
        return [gauge]


class CountingSource(Protocol):
    """What the counting collector reads at scrape time (the TokenizerService)."""

    def cache_stats(self) -> CacheStatsLike: ...

    def engines(self) -> dict[str, str]: ...


class CacheStatsLike(Protocol):
    # Read only: the service hands out a frozen snapshot.
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def capacity(self) -> int: ...


class CountingCollector(Collector):
    """The prompt-segment cache and each model's counting engine, read when scraped."""

    def __init__(self, source: CountingSource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        stats = self._source.cache_stats()
        hits = CounterMetricFamily(
            "kvgate_prompt_segment_cache_hits",
            "Prompt segments whose token count came from the cache.",
        )
        hits.add_metric([], stats.hits)
        misses = CounterMetricFamily(
            "kvgate_prompt_segment_cache_misses",
            "Prompt segments that had to be tokenized (then cached).",
        )
        misses.add_metric([], stats.misses)
        entries = GaugeMetricFamily(
            "kvgate_prompt_segment_cache_entries", "Segment counts held in the cache."
        )
        entries.add_metric([], stats.size)
        engines = GaugeMetricFamily(
            "kvgate_counting_engine_info",
            "1 per model: the engine counting its prompts (compiled-bpe or reference).",
            labels=["model", "engine"],
        )
        for model, engine in sorted(self._source.engines().items()):
            engines.add_metric([model, engine], 1)
        return [hits, misses, entries, engines]


@runtime_checkable
class RefusalCounts(Protocol):
    """An embedder that counts the calls it refused, by reason (kvgate.cache.embeddings)."""

    refused: Mapping[str, int]


class MirrorStats(Protocol):
    """What the semantic index's mirror holds (kvgate.cache.semantic.SemanticIndex)."""

    @property
    def mirrored_bytes(self) -> int: ...

    @property
    def mirrored_entries(self) -> int: ...

    @property
    def mirrored_contexts(self) -> int: ...


class SemanticCacheCollector(Collector):
    """The semantic cache's embedder refusals and its index mirror, read when scraped."""

    def __init__(self, embedder: object, index: MirrorStats) -> None:
        self._embedder = embedder
        self._index = index

    def collect(self) -> Iterable[Metric]:
        refused = CounterMetricFamily(
            "kvgate_semantic_cache_embeddings_refused",
            "Semantic lookups the embedder gave up on (the request ran uncached, counted as "
            "unavailable in kvgate_semantic_cache): tenant_queue_full (the tenant already had "
            "semantic_cache.embedder.max_queued_per_tenant embeddings outstanding), deadline "
            "(no vectors within semantic_cache.embedder.timeout_s, waiting included).",
            labels=["reason"],
        )
        counts = self._embedder.refused if isinstance(self._embedder, RefusalCounts) else {}
        for reason in ("tenant_queue_full", "deadline"):
            refused.add_metric([reason], counts.get(reason, 0))
        mirror_bytes = GaugeMetricFamily(
            "kvgate_semantic_cache_mirror_bytes",
            "Bytes this replica's semantic index holds (entries and a fixed overhead per "
            "context, empty ones included), bounded by semantic_cache.mirror_max_bytes.",
        )
        mirror_bytes.add_metric([], self._index.mirrored_bytes)
        contexts = GaugeMetricFamily(
            "kvgate_semantic_cache_mirror_contexts",
            "Contexts this replica's semantic index holds, with entries or not.",
        )
        contexts.add_metric([], self._index.mirrored_contexts)
        entries = GaugeMetricFamily(
            "kvgate_semantic_cache_mirror_entries",
            "Stored questions this replica's semantic index holds.",
        )
        entries.add_metric([], self._index.mirrored_entries)
        return [refused, mirror_bytes, contexts, entries]
