"""Live capacity per backend: discovered KV budgets (`kv_budget_tokens: auto`, never above
`max_auto_kv_budget_tokens`) and back-pressure verdicts from each vLLM's own /metrics."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from kvgate.capacity.backpressure import BackpressurePolicy, BackpressureVerdict
from kvgate.capacity.discovery import CapacityMonitor, VllmCapacity
from kvgate.config.model import BackendConfig, KvgateConfig
from kvgate.metrics import Metrics
from kvgate.policy import BackendLimits

log = logging.getLogger("kvgate.capacity")


class CapacityRegistry:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        # Backends whose last reading claimed more than the cap (logged once while it lasts).
        self._capped: set[str] = set()
        self._monitors: dict[str, CapacityMonitor] = {}
        self._settings: dict[str, BackendConfig] = {}
        self._policies: dict[str, BackpressurePolicy] = {}
        # The last discovered budget per backend: a GPU's block count only changes when the
        # engine restarts, so a known figure stays usable while the scrape is briefly stale.
        self._known_budget: dict[str, tuple[int, int]] = {}

    async def sync(self, config: KvgateConfig) -> None:
        """Start, restart or stop monitors to match the configuration (start-up, reload)."""
        # Pools scrape each endpoint on their own (capacity/pools.py).
        wanted = {b.name: b for b in config.backends if b.discovery is not None and not b.is_pool}
        for name in list(self._monitors):
            if name not in wanted or wanted[name].discovery != self._settings[name].discovery:
                await self._monitors.pop(name).stop()
                self._known_budget.pop(name, None)
                self._capped.discard(name)
        for name, backend in wanted.items():
            self._settings[name] = backend
            discovery = backend.discovery
            assert discovery is not None
            if name not in self._monitors:
                monitor = CapacityMonitor(
                    discovery.metrics_url,
                    model_name=discovery.model_name,
                    interval_s=discovery.interval_s,
                    timeout_s=discovery.timeout_s,
                    max_staleness_s=discovery.max_staleness_s,
                    max_body_bytes=discovery.max_body_bytes,
                    on_reading=functools.partial(self._observe_reading, name),
                    clock=self._clock,
                )
                await monitor.poll_once()  # a budget at start-up when the engine is up
                await monitor.start()
                self._monitors[name] = monitor
        self._policies = {
            b.name: BackpressurePolicy(
                max_kv_cache_usage=b.backpressure.max_kv_cache_usage,
                max_requests_waiting=b.backpressure.max_requests_waiting,
            )
            for b in config.backends
            if b.backpressure is not None
        }

    def effective_limits(self, limits: BackendLimits, *, auto: bool) -> BackendLimits | None:
        """The limits to admit against; None when an automatic budget is not known yet."""
        if not auto:
            return limits
        monitor = self._monitors.get(limits.name)
        latest = monitor.latest(self._clock()) if monitor else None
        if latest is not None and latest.kv_capacity_tokens and latest.block_size:
            self._known_budget[limits.name] = (latest.kv_capacity_tokens, latest.block_size)
        known = self._known_budget.get(limits.name)
        if known is None:
            return None
        settings = self._settings.get(limits.name)
        cap = settings.max_auto_kv_budget_tokens if settings is not None else known[0]
        return replace(limits, kv_budget_tokens=min(known[0], cap), kv_block_size=known[1])

    def _observe_reading(self, backend: str, reading: VllmCapacity) -> None:
        """Each scrape: count (and log once) a KV cache claim over the cap."""
        settings = self._settings.get(backend)
        reported = reading.kv_capacity_tokens
        if (
            settings is None
            or settings.kv_budget_tokens != "auto"
            or reported is None
            or reported <= settings.max_auto_kv_budget_tokens
        ):
            self._capped.discard(backend)
            return
        if self._metrics is not None:
            self._metrics.kv_budget_capped_reports.labels(backend).inc()
        if backend not in self._capped:
            self._capped.add(backend)
            log.warning(
                "backend %s reports a KV cache of %d tokens, over max_auto_kv_budget_tokens; "
                "its budget is capped at %d",
                backend,
                reported,
                settings.max_auto_kv_budget_tokens,
            )

    def verdict(self, backend: str) -> BackpressureVerdict | None:
        policy = self._policies.get(backend)
        if policy is None:
            return None
        monitor = self._monitors.get(backend)
        # Stale or missing metrics give "no_data", which never sheds.
        return policy.evaluate(monitor.latest(self._clock()) if monitor else None)

    def readings(self) -> dict[str, VllmCapacity]:
        """The latest fresh reading of each backend's engine (reconciliation)."""
        now = self._clock()
        found = {name: monitor.latest(now) for name, monitor in self._monitors.items()}
        return {name: reading for name, reading in found.items() if reading is not None}

    async def close(self) -> None:
        for monitor in self._monitors.values():
            await monitor.stop()
        self._monitors.clear()
