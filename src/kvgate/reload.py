"""Hot reload: SIGHUP or a change of the config file applies a new configuration atomically.

The new file is validated, its tokenizers are loaded, and only then is the compiled snapshot
swapped in with one reference assignment. A bad config keeps the old one serving, logs why and
counts a failure. Reservations live in the store, keyed by names, so in-flight requests settle
normally across a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvgate.config import ConfigError, KvgateConfig, SnapshotHolder, compile_snapshot, load_config
from kvgate.config.model import BackendConfig, ModelConfig, engine_tokenize_url
from kvgate.metrics import Metrics
from kvgate.tokenize import CountingApi, TokenizerService
from kvgate.tokenize.engine_counting import EngineCounter, load_model_counter

log = logging.getLogger("kvgate.reload")


RELOAD = "reload"
RESTART = "restart"

# How every configuration field reaches the running process. RELOAD: read from the swapped
# snapshot on each request, or re-applied by the reloader below (noted). RESTART: read once
# at start-up, so changing it refuses the reload, naming the field, and the old config keeps
# serving: a half-applied change (e.g. a renew interval from the new lease TTL while the store
# keeps the old one) is worse than none. "*" stands for any list item or mapping key.
# tests/session/test_reload.py walks the config model: a new field must be classified here.
FIELD_CLASSES: dict[str, str] = {
    "server.grpc_listen": RESTART,  # bound at start
    "server.http_listen": RESTART,  # metrics/health port, bound at start
    "server.admin_listen": RESTART,  # bound at start
    "server.log_level": RELOAD,  # set on the root logger by the reloader
    "server.shutdown_grace_s": RELOAD,  # read from the snapshot at shutdown
    "server.lease_ttl_s": RESTART,  # the store keeps the TTL it was built with
    "server.tokenizer_threads": RELOAD,  # TokenizerService.resize
    "server.tokenizer_cache_entries": RELOAD,  # TokenizerService.resize
    "server.tokenizer_cache_dir": RELOAD,  # every tokenizer is loaded again from it
    "server.inline_tokenize_max_chars": RELOAD,  # TokenizerService.resize
    "server.decision_timeout_s": RELOAD,
    "server.cut_request_charge": RELOAD,
    "server.grpc_max_message_bytes": RESTART,  # gRPC server options at start
    # Read again on every reload (a missing or unusable token rejects the reload) and the
    # file also whenever it changes (kvgate.admin.auth).
    "server.admin_token_env": RELOAD,
    "server.admin_token_file": RELOAD,
    # Operator TLS: listeners and their credentials are built at start (turning TLS or client
    # certificates on or off changes the listener). The files' contents, a renewed
    # certificate or CA, are re-read whenever they change, without a reload (kvgate.admin.tls).
    "server.operator_https_listen": RESTART,
    "server.operator_tls.cert_file": RESTART,
    "server.operator_tls.key_file": RESTART,
    "server.operator_tls.client_ca_file": RESTART,
    # Who may connect, read from the current snapshot at every call or stream: a reload
    # revokes (or admits) an identity without a restart.
    "server.operator_tls.allowed_clients.uri_sans": RELOAD,
    "server.operator_tls.allowed_clients.dns_sans": RELOAD,
    "server.operator_tls.allowed_clients.common_names": RELOAD,
    # ext_proc mutual TLS: the listener is built at start, the files re-read when they change.
    "server.grpc_tls.cert_file": RESTART,
    "server.grpc_tls.key_file": RESTART,
    "server.grpc_tls.client_ca_file": RESTART,
    "server.grpc_tls.allowed_clients.uri_sans": RELOAD,
    "server.grpc_tls.allowed_clients.dns_sans": RELOAD,
    "server.grpc_tls.allowed_clients.common_names": RELOAD,
    "store": RESTART,  # the store is built once
    "redis.key_prefix": RESTART,
    "redis.timeout_s": RESTART,
    "redis.connect_timeout_s": RESTART,
    "redis.failure_policy": RESTART,
    "redis.unavailable_retry_after_s": RESTART,
    "redis.probe_interval_s": RESTART,
    "redis.max_pending_settlements": RESTART,
    "redis.settled_id_retention_s": RESTART,
    "redis.answer_store_max_memory_fraction": RESTART,  # the answer store is built once
    "redis.max_connections": RESTART,
    "redis.cluster": RESTART,
    "redis.sentinel.master": RESTART,
    "redis.sentinel.nodes": RESTART,
    "redis.sentinel.password": RESTART,
    # Read once at start, like the connection they authenticate: rotate by restarting.
    "redis.password_env": RESTART,
    "redis.password_file": RESTART,
    "redis.sentinel.password_env": RESTART,
    "redis.sentinel.password_file": RESTART,
    # The tracer provider and its exporter are built once at start (kvgate.tracing).
    "tracing.enabled": RESTART,
    "tracing.otlp_endpoint": RESTART,
    "tracing.service_name": RESTART,
    "tracing.sample_ratio": RESTART,
    "tracing.trust_parent_sampling": RESTART,
    "tracing.tenant_attribute": RESTART,
    # Tenants, models and backends are compiled into the snapshot; rate buckets resize to
    # new specs, backend ledgers take new limits for new work.
    "tenants.*.name": RELOAD,
    "tenants.*.api_key_sha256": RELOAD,
    "tenants.*.budget.daily_usd": RELOAD,
    "tenants.*.budget.monthly_usd": RELOAD,
    "tenants.*.budget.action": RELOAD,
    "tenants.*.budget.fallback_model": RELOAD,
    "tenants.*.budget.shadow": RELOAD,
    **{
        f"tenants.*.{scope}.{limit}.{name}": RELOAD
        for scope in ("limits", "model_limits.*")
        for limit, names in (
            ("rpm", ("limit", "shadow")),
            ("tpm", ("capacity", "refill_per_s", "shadow")),
            ("concurrency", ("limit", "shadow")),
        )
        for name in names
    },
    "models.*.name": RELOAD,
    "models.*.tokenizer": RELOAD,  # loaded before the swap
    "models.*.counting_engine": RELOAD,  # the tokenizer is loaded again before the swap
    "models.*.tokenizer_mode": RELOAD,  # likewise
    "models.*.harmony_system_instructions": RELOAD,  # likewise
    # likewise (a template file is read again)
    **{
        f"models.*.engine_flags.{name}": RELOAD
        for name in (
            "default_chat_template_kwargs",
            "reasoning_effort_map",
            "chat_template",
            "chat_template_content_format",
            "exclude_tools_when_tool_choice_none",
        )
    },
    # The model's counter is built again before the swap (its engine's URL, key, bounds).
    "models.*.counting": RELOAD,
    **{
        f"models.*.engine_counting.{name}": RELOAD
        for name in (
            "tokenize_url",
            "timeout_s",
            "on_unavailable",
            "retry_after_s",
            "max_concurrency",
            "cache_max_bytes",
            "cache_ttl_s",
            "cache_chats",
        )
    },
    "models.*.max_context": RELOAD,
    "models.*.default_max_new_tokens": RELOAD,
    "models.*.backend": RELOAD,
    "models.*.pricing.input_per_million": RELOAD,
    "models.*.pricing.cached_input_per_million": RELOAD,
    "models.*.pricing.output_per_million": RELOAD,
    "backends.*.name": RELOAD,
    "backends.*.kv_budget_tokens": RELOAD,
    "backends.*.kv_block_size": RELOAD,
    "backends.*.max_concurrent_requests": RELOAD,
    "backends.*.api_key": RELOAD,
    "backends.*.api_key_env": RELOAD,
    # Discovery monitors are restarted and back-pressure rebuilt by CapacityRegistry.sync.
    "backends.*.discovery.metrics_url": RELOAD,
    "backends.*.discovery.model_name": RELOAD,
    "backends.*.discovery.interval_s": RELOAD,
    "backends.*.discovery.timeout_s": RELOAD,
    "backends.*.discovery.max_staleness_s": RELOAD,
    "backends.*.discovery.max_body_bytes": RELOAD,
    # Read from the backend's settings whenever a budget is taken from a reading.
    "backends.*.max_auto_kv_budget_tokens": RELOAD,
    "backends.*.backpressure.max_kv_cache_usage": RELOAD,
    "backends.*.backpressure.max_requests_waiting": RELOAD,
    "backends.*.backpressure.retry_after_s": RELOAD,
    # Pools: membership, monitors, prefix indexes and queues follow PoolScheduler.sync;
    # requests already queued keep waiting under the new settings.
    "backends.*.endpoints": RELOAD,
    "server.envoy_max_message_timeout_s": RELOAD,
    "backends.*.endpoint_discovery.dns_name": RELOAD,
    "backends.*.endpoint_discovery.port": RELOAD,
    "backends.*.endpoint_discovery.refresh_s": RELOAD,
    "backends.*.endpoint_discovery.max_endpoints": RELOAD,
    "backends.*.endpoint_discovery.allowed_cidrs": RELOAD,
    **{
        f"backends.*.picking.{name}": RELOAD
        for name in (
            "prefix_affinity",
            "block_chars",
            "max_blocks",
            "max_entries",
            "affinity_weight",
            "load_gate",
        )
    },
    **{
        f"backends.*.queue.{name}": RELOAD
        for name in (
            "max_wait_s",
            "max_queued",
            "max_queued_per_tenant",
            "input_weight",
            "output_weight",
            "poll_interval_s",
        )
    },
    "tenants.*.priority": RELOAD,
    # Read per request from the snapshot; the store itself is built at start.
    "idempotency.enabled": RELOAD,
    "idempotency.retention_s": RELOAD,
    "idempotency.max_wait_s": RELOAD,
    "idempotency.max_answer_bytes": RELOAD,
    "idempotency.memory_max_bytes": RESTART,
    "idempotency.tenant_max_bytes": RELOAD,  # passed with every claim
    "idempotency.max_waiting_per_tenant": RELOAD,
    "response_cache.enabled": RELOAD,
    "response_cache.ttl_s": RELOAD,
    "response_cache.scope": RELOAD,
    "response_cache.sampled": RELOAD,
    "response_cache.hit_charge": RELOAD,
    "response_cache.max_answer_bytes": RELOAD,
    "response_cache.memory_max_bytes": RESTART,
    "response_cache.tenant_max_bytes": RELOAD,  # passed with every claim
    # The embedder and the index are built at start; the rest is read per request.
    "semantic_cache.enabled": RESTART,
    **{
        f"semantic_cache.embedder.{name}": RESTART
        for name in (
            "kind",
            "dimensions",
            "base_url",
            "model",
            "api_key_env",
            "send_dimensions",
            "timeout_s",
            "max_queued_per_tenant",
        )
    },
    "semantic_cache.max_entries_per_context": RESTART,
    "semantic_cache.mirror_max_bytes": RESTART,
    "semantic_cache.memory_max_bytes": RESTART,
    **{
        f"semantic_cache.{name}": RELOAD
        for name in (
            "threshold",
            "guard",
            "scope",
            "allow_tools",
            "sampled",
            "ttl_s",
            "hit_charge",
            "max_answer_bytes",
            "max_question_chars",
        )
    },
    "tenants.*.semantic_cache": RELOAD,
    "tenants.*.cache_sharing": RELOAD,
    "models.*.semantic_cache": RELOAD,
    "models.*.response_cache_sampled": RELOAD,
    "models.*.cache_generation": RELOAD,
    "tenants.*.response_cache": RELOAD,
    "tenants.*.response_cache_sampled": RELOAD,
    "tenants.*.allowed_priorities": RELOAD,
}


def _value_at(data: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict):
            return None  # an absent optional section (e.g. no redis.sentinel)
        data = data.get(key)
    return data


def restart_only_changes(old: KvgateConfig, new: KvgateConfig) -> list[str]:
    """The changed fields that only a restart can apply, by name."""
    before, after = old.model_dump(), new.model_dump()
    return [
        path
        for path, kind in FIELD_CLASSES.items()
        if kind == RESTART and _value_at(before, path) != _value_at(after, path)
    ]


def _tokenizer_settings(
    model: ModelConfig, backends: dict[str, BackendConfig]
) -> tuple[object, ...]:
    """What a model's counter is loaded from: a change loads it again."""
    if model.counting == "engine":
        backend = backends[model.backend]
        return (
            "engine",
            model.engine_counting,
            model.engine_flags,
            model.cache_generation,
            engine_tokenize_url(model, backend),
            backend.upstream_api_key,
        )
    return (
        model.tokenizer,
        model.counting_engine,
        model.tokenizer_mode,
        model.harmony_system_instructions,
        model.engine_flags,
    )


class ConfigReloader:
    def __init__(
        self,
        path: Path,
        *,
        snapshots: SnapshotHolder,
        tokenizers: TokenizerService,
        metrics: Metrics,
        poll_interval_s: float = 2.0,
        on_applied: Callable[[KvgateConfig], Awaitable[None]] | None = None,
        prepare: Callable[[KvgateConfig], Callable[[], None]] | None = None,
    ) -> None:
        self._on_applied = on_applied
        # Run (in a worker thread) before the swap: reads what the new config names outside
        # itself (the operator token); raising rejects the reload. What it returns is called
        # right after the swap.
        self._prepare = prepare
        self._path = path
        self._snapshots = snapshots
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._lock = asyncio.Lock()
        self._fingerprint = self._stat()
        self._watch_task: asyncio.Task[None] | None = None
        self.generation = 1
        self.last_error: str | None = None
        metrics.config_generation.set(self.generation)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            # Kubernetes swaps ConfigMap files through a symlink: follow it (stat, not lstat).
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def reload(self, trigger: str) -> bool:
        """Apply the file's current contents; True if the new config is now serving."""
        async with self._lock:
            self._fingerprint = self._stat()
            try:
                config = await asyncio.to_thread(load_config, self._path)
                old = self._snapshots.current.config
                blocked = restart_only_changes(old, config)
                if blocked:
                    raise ConfigError(
                        f"{self._path}: {', '.join(blocked)} cannot change without a restart "
                        "(nothing of this file was applied)"
                    )
                apply_prepared = (
                    await asyncio.to_thread(self._prepare, config) if self._prepare else None
                )
                await asyncio.to_thread(self._load_tokenizers, old, config)
                snapshot = compile_snapshot(config)
            except Exception as exc:  # any failure keeps the old snapshot
                self.last_error = str(exc)
                self._metrics.config_reloads.labels("failure").inc()
                log.error(
                    "config reload rejected; the previous config keeps serving",
                    extra={"trigger": trigger, "error": str(exc)},
                )
                return False
            self._snapshots.swap(snapshot)
            if apply_prepared is not None:
                apply_prepared()
            self._apply_server_settings(old, config)
            if self._on_applied is not None:
                try:
                    await self._on_applied(config)
                except Exception:
                    log.exception("applying the reloaded config to live services failed")
            for model in old.models:
                if model.name not in snapshot.models:
                    self._tokenizers.unregister(model.name)
            self.generation += 1
            self.last_error = None
            self._metrics.config_reloads.labels("success").inc()
            self._metrics.config_generation.set(self.generation)
            for backend in snapshot.backends.values():
                self._metrics.kv_budget_tokens.labels(backend.name).set(backend.kv_budget_tokens)
            log.info(
                "config reloaded",
                extra={"trigger": trigger, "generation": self.generation},
            )
            return True

    def _apply_server_settings(self, old: KvgateConfig, new: KvgateConfig) -> None:
        """Server fields held outside the snapshot, applied right after the swap."""
        before, after = old.server, new.server
        if before.log_level != after.log_level:
            # Only on a change, so a `--log-level` given at start survives other reloads.
            logging.getLogger().setLevel(after.log_level)
        sizes = ("tokenizer_threads", "tokenizer_cache_entries", "inline_tokenize_max_chars")
        if any(getattr(before, name) != getattr(after, name) for name in sizes):
            self._tokenizers.resize(
                max_workers=after.tokenizer_threads,
                cache_size=after.tokenizer_cache_entries,
                inline_max_cost=after.inline_tokenize_max_chars,
            )

    def _load_tokenizers(self, old: KvgateConfig, new: KvgateConfig) -> None:
        """Load tokenizers of new or changed models before anything is swapped."""
        old_backends = {b.name: b for b in old.backends}
        backends = {b.name: b for b in new.backends}
        previous = {m.name: _tokenizer_settings(m, old_backends) for m in old.models}
        cache_dir = Path(new.server.tokenizer_cache_dir)
        if cache_dir != Path(old.server.tokenizer_cache_dir):
            previous = {}  # every model is loaded again, from the new cache directory
        loaded: dict[str, CountingApi | EngineCounter] = {}
        for model in new.models:
            if previous.get(model.name) == _tokenizer_settings(model, backends):
                continue
            loaded[model.name] = load_model_counter(model, backends[model.backend], cache_dir)
        for name, counter in loaded.items():
            self._tokenizers.register(name, counter)

    def start_watching(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            current = self._stat()
            if current is not None and current != self._fingerprint:
                await self.reload("file_change")

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
