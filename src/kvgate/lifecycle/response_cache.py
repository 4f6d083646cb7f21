"""The exact-match response cache: the same model and request again -> the stored answer.

Protocol-free (the API's completeness rule comes with the query). `lookup` says whether a
request may use the cache at all (deterministic, or sampled where the operator allows it),
and returns the stored answer (a hit), or an `AnswerRecorder` that stores this request's
answer when it completes (a miss). An identical request already running elsewhere is not
waited for: this one runs uncached (bypass).

The key is the API's path, the model and the client's canonical body (its own wire body,
not the chat request an agent API is converted into): every field that can change the
answer, `stream` and `stream_options` included, because the stored bytes are exactly what
the client received (a stream with the usage event only where the client asked for it),
plus what serves it: the route's backend (a canary pool is not the default one) and the
model's `cache_generation`. An answer served by another model (a budget fallback) or with
fewer tokens than asked (a clamp) is not stored at all: it is not this request's answer.

Entries are the tenant's own unless both it and the other tenant opt in to sharing
(`cache_sharing`), and a sampled answer is never shared: the tenant that made it could
have picked it (by cutting the streams it did not like).
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.cache.answers import (
    ANSWER_STORE_FAILURES,
    AnswerQuota,
    AnswerStore,
    ClaimState,
    StoredAnswer,
)
from kvgate.config.model import ModelConfig, ResponseCacheConfig, TenantConfig
from kvgate.config.snapshot import ModelRoute
from kvgate.lifecycle.admission import ANSWER_LEDGER, NO_KV
from kvgate.lifecycle.answer_sources import (
    AnswerJudge,
    AnswerQuery,
    AnswerSource,
    Bypass,
    Hit,
    HitCharge,
    Miss,
    SourceName,
)
from kvgate.lifecycle.idempotency import AnswerRecorder
from kvgate.metrics import Metrics
from kvgate.openai import ParsedRequest
from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    Decision,
    SettleCause,
    TenantPolicy,
)
from kvgate.store import StateStore
from kvgate.tokenize.vision import fetched_images

log = logging.getLogger(__name__)

# On every answer to a metered request: hit | miss | bypass.
CACHE_HEADER = "x-kvgate-cache"
# The store's namespace of cached answers, both caches' (quotas are per tenant and namespace).
CACHE_NAMESPACE = "cache"


class CacheResult(enum.StrEnum):
    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"


@dataclass(frozen=True, slots=True)
class CacheLookup:
    result: CacheResult
    answer: StoredAnswer | None = None
    recorder: AnswerRecorder | None = None


BYPASS = CacheLookup(CacheResult.BYPASS)


def cacheable(
    body: Mapping[str, Any],
    settings: ResponseCacheConfig,
    tenant: TenantConfig | None,
    model: ModelConfig | None = None,
    *,
    reproducible: bool = False,
) -> bool:
    """Whether the tenant uses the cache and the request (`body`: the client's own) is one
    it may serve. Whether a sampled request may be: the tenant's setting, else the
    model's, else the cache's."""
    enabled = (
        settings.enabled
        if tenant is None or tenant.response_cache is None
        else (tenant.response_cache)
    )
    if not enabled:
        return False
    if tenant is not None and tenant.response_cache_sampled is not None:
        sampled = tenant.response_cache_sampled
    elif model is not None and model.response_cache_sampled is not None:
        sampled = model.response_cache_sampled
    else:
        sampled = settings.sampled
    # reproducible: an answer no sampling shapes (a pooling request's vectors or scores).
    return sampled or reproducible or deterministic(body)


def deterministic(body: Mapping[str, Any]) -> bool:
    """Greedy decoding (`temperature: 0`): the same request gives the same answer."""
    temperature = body.get("temperature")
    return (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and temperature == 0
    )


# The scope of entries every opted-in tenant shares.
SHARED_SCOPE = "shared"


def cache_scope(
    shared_scope: bool, tenant: str, tenant_config: TenantConfig | None, body: Mapping[str, Any]
) -> str:
    """Whose entries a request meets: the tenant's own, or (a cache with `scope: model`, a
    tenant that opted in to sharing, a deterministic request) those of every tenant that
    opted in. A sampled answer is never another tenant's."""
    sharing = tenant_config is not None and tenant_config.cache_sharing
    if shared_scope and sharing and deterministic(body):
        return SHARED_SCOPE
    return f"tenant\x00{tenant}"


def cache_key(
    request: ParsedRequest,
    *,
    scope: str,
    digest: str,
    served_by: str,
    generation: str = "",
) -> str:
    """The entry's key: the scope, the request (its API's `path`, so that the same bytes
    sent to two APIs never meet; its model; `digest`: the client's canonical body), and
    what serves it: `served_by` (the backend or pool the request's route sends it to) and
    the model's `generation` (`cache_generation`: new weights behind the same name make
    every earlier entry unreachable at once)."""
    key = hashlib.sha256()
    for part in (scope, request.path, request.model, served_by, generation, digest):
        key.update(part.encode())
        key.update(b"\x00")
    return "cache|" + key.hexdigest()


def cache_quota(settings: ResponseCacheConfig, tenant: str) -> AnswerQuota:
    """The tenant's bytes of cached answers (both caches), whoever they serve later."""
    return AnswerQuota(CACHE_NAMESPACE, tenant, settings.tenant_max_bytes)


async def lookup(
    store: AnswerStore,
    settings: ResponseCacheConfig,
    *,
    key: str,
    tenant: str,
    owner: str,
    lock_ttl_s: float,
    track: Callable[[Coroutine[Any, Any, None]], Any],
    judge: AnswerJudge,
    stream: bool | None = None,
    on_not_kept: Callable[[str], None] | None = None,
) -> CacheLookup:
    """A hit, a miss (this request's answer is stored when it completes, complete by
    `judge`, in the tenant's quota), or a bypass (an identical request runs, or the
    tenant's quota is full)."""
    quota = cache_quota(settings, tenant)
    claim = await store.claim(key, key, owner, lock_ttl_s, quota=quota)
    if claim.state is ClaimState.COMPLETED:
        return CacheLookup(CacheResult.HIT, answer=claim.answer)
    if claim.state is not ClaimState.STARTED:
        return BYPASS
    recorder = AnswerRecorder(
        store,
        key,
        owner,
        max_answer_bytes=settings.max_answer_bytes,
        retention_s=settings.ttl_s,
        track=track,
        judge=judge,
        quota=quota,
        stream=stream,
        on_not_kept=on_not_kept,
    )
    return CacheLookup(CacheResult.MISS, recorder=recorder)


async def charge_hit(
    store: StateStore,
    tenant: TenantPolicy,
    route: ModelRoute,
    answer: StoredAnswer,
    request_id: str,
    *,
    request_slot_taken: bool = False,
) -> Decision:
    """`hit_charge: full`: the hit takes what the stored answer took from the tenant's TPM,
    RPM and budgets, atomically like any admission (a tenant over its limits gets the 429
    it would get for the real request), and is booked in the ledger at the model's prices."""
    request = AdmissionRequest(
        request_id=request_id,
        tenant=tenant.name,
        model=route.name,
        backend=ANSWER_LEDGER,
        prompt_tokens=answer.prompt_tokens,
        max_new_tokens=answer.output_tokens,
        cost_pico=route.pricing.worst_case(answer.prompt_tokens, answer.output_tokens),
        request_slot_taken=request_slot_taken,
    )
    decision = await store.reserve(request, NO_KV, tenant)
    if decision.admitted and decision.reservation is not None:
        usage = ActualUsage(answer.prompt_tokens, answer.output_tokens)
        cost = route.pricing.cost(usage.prompt_tokens, usage.output_tokens, 0)
        await store.settle(
            decision.reservation, SettleCause.COMPLETED, usage, cost_pico=cost, tenant=tenant
        )
    return decision


class ExactCacheSource(AnswerSource):
    """The exact-match cache as an answer source: a hit answers with the stored answer
    (charged as `hit_charge` says), a miss stores this request's complete answer."""

    name = SourceName.EXACT_CACHE

    def __init__(
        self,
        store: AnswerStore,
        metrics: Metrics,
        track: Callable[[Coroutine[Any, Any, None]], Any],
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._track = track

    def applies(self, query: AnswerQuery) -> bool:
        if not query.sees_answer:
            return False
        snapshot = query.snapshot
        request = query.request
        use = cacheable(
            query.body,
            snapshot.config.response_cache,
            snapshot.tenant_configs.get(query.tenant.name),
            snapshot.model_configs.get(request.model),
            reproducible=not request.generates,
        ) and not fetched_images(request.messages)
        if not use:
            self._metrics.response_cache.labels(CacheResult.BYPASS.value).inc()
        return use

    async def lookup(self, query: AnswerQuery, digest: str) -> Hit | Miss | Bypass:
        snapshot = query.snapshot
        config = snapshot.config
        settings = config.response_cache
        metrics = self._metrics
        request = query.request
        tenant = query.tenant.name
        route = snapshot.models.get(request.model)
        if route is None:
            return Bypass()  # admission answers model_not_found
        model = snapshot.model_configs.get(request.model)
        scope = cache_scope(
            settings.scope == "model", tenant, snapshot.tenant_configs.get(tenant), query.body
        )
        key = cache_key(
            request,
            scope=scope,
            digest=digest,
            served_by=query.route_backend or route.backend,
            generation=model.cache_generation if model is not None else "",
        )
        try:
            found = await lookup(
                self._store,
                settings,
                key=key,
                tenant=tenant,
                owner=query.owner,
                lock_ttl_s=config.server.lease_ttl_s,
                track=self._track,
                judge=query.answer_defect,
                on_not_kept=lambda why: metrics.answers_not_stored.labels(why).inc(),
                stream=request.stream,
            )
        except ANSWER_STORE_FAILURES as exc:
            log.warning("response cache unavailable; the request runs uncached: %s", exc)
            found = BYPASS
        metrics.response_cache.labels(found.result.value).inc()
        if found.answer is not None:
            return Hit(
                found.answer,
                {CACHE_HEADER: CacheResult.HIT.value},
                reason="response_cache_hit",
                charge=HitCharge(settings.hit_charge, metrics.response_cache_saved_tokens),
            )
        if found.recorder is not None:
            return Miss(found.recorder, cache_header=found.result.value)
        return Bypass(cache_header=found.result.value)
