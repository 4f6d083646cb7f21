"""What a stream session needs from the rest of kvgate, gathered in one object."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import SnapshotHolder
from kvgate.extproc.handoff import HandedOff, HandoffRegistry
from kvgate.lifecycle import LeaseKeeper, ResponseReading, charged_usage
from kvgate.metrics import Metrics
from kvgate.policy import (
    ActualUsage,
    Clock,
    Decision,
    Pricing,
    Reservation,
    SettleCause,
    TenantPolicy,
    pico_to_usd,
)
from kvgate.policy.pricing import PICO_PER_USD
from kvgate.store import StateStore
from kvgate.tokenize import PromptCounter

log = logging.getLogger("kvgate.settle")

T = TypeVar("T")


class PromptTokenizers(Protocol):
    """Counting off the event loop, scheduled fairly between tenants."""

    async def count_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tenant: str = "",
    ) -> int: ...

    async def count_completion(self, model: str, prompt: Any, *, tenant: str = "") -> int: ...

    async def count_text(self, model: str, text: str, *, tenant: str = "") -> int: ...

    async def run(self, tenant: str, work: Callable[[], T], *, cost: int = 1) -> T: ...

    def counter(self, model: str) -> PromptCounter: ...


class GatewayServices:
    def __init__(
        self,
        *,
        snapshots: SnapshotHolder,
        store: StateStore,
        tokenizers: PromptTokenizers,
        metrics: Metrics,
        clock: Clock,
        capacity: CapacityRegistry | None = None,
    ) -> None:
        self.snapshots = snapshots
        self.store = store
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.clock = clock
        self.capacity = capacity or CapacityRegistry()
        self.handoffs = HandoffRegistry()
        self.leases = LeaseKeeper(store, metrics, lambda: self.lease_renew_interval_s)
        self.shutting_down = False
        self._background: set[asyncio.Task[None]] = set()

    @property
    def lease_renew_interval_s(self) -> float:
        # Renew well before expiry, but not on every chunk.
        return self.snapshots.current.config.server.lease_ttl_s / 3

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run work that must finish even though its stream is gone; shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        charged: ActualUsage,
        *,
        metered: bool = True,
        request_id: str = "",
        pricing: Pricing | None = None,
    ) -> asyncio.Task[None]:
        """Book `charged` (what the billing rule decided) and release the reservation, in the
        background so that it lands even if the stream is gone."""
        self.leases.release(reservation.reservation_id)
        if not metered:
            self.metrics.unmetered_settlements.labels(reservation.request.backend).inc()
        cost = (pricing or Pricing()).cost(
            charged.prompt_tokens, charged.output_tokens, charged.cached_tokens
        )
        return self.track(self._settle(reservation, cause, charged, cost, request_id))

    async def _settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        cost_pico: int,
        request_id: str,
    ) -> None:
        request = reservation.request
        snapshot = self.snapshots.current
        tenant = snapshot.tenants.get(request.tenant) or TenantPolicy(name=request.tenant)
        try:
            settlement = await self.store.settle(
                reservation, cause, usage, cost_pico=cost_pico, tenant=tenant
            )
        except Exception:
            # The lease still expires on its own; say loudly that this one was not recorded.
            log.exception("settlement failed", extra={"request_id": request_id})
            return
        if not settlement.applied:
            return
        m = self.metrics
        if settlement.lease_expired:
            m.late_settlements.labels(request.backend).inc()
        m.settlements.labels(request.backend, cause.value).inc()
        m.prompt_tokens.labels(request.tenant, request.model).inc(usage.prompt_tokens)
        m.output_tokens.labels(request.tenant, request.model).inc(usage.output_tokens)
        if usage.cached_tokens:
            m.cached_tokens.labels(request.tenant, request.model).inc(usage.cached_tokens)
        if cost_pico:
            m.cost_usd.labels(request.tenant, request.model).inc(cost_pico / PICO_PER_USD)
        used = usage.prompt_tokens + usage.output_tokens
        m.reserved_unused_tokens.labels(request.backend).inc(max(0, reservation.kv_tokens - used))
        # Per request: DEBUG (Envoy's access log is the per-request record).
        log.debug(
            "settled",
            extra={
                "request_id": request_id,
                "tenant": request.tenant,
                "model": request.model,
                "cause": cause.value,
                "prompt_tokens": usage.prompt_tokens,
                "output_tokens": usage.output_tokens,
                "reserved_tokens": reservation.kv_tokens,
                "cost_usd": str(pico_to_usd(cost_pico)),
            },
        )

    def settle_unclaimed(self, state: HandedOff) -> None:
        """A split-mode hand-off no observability stream claimed: the response was never
        observed, so nothing is charged (as for a request cut before its answer)."""
        self.metrics.stream_disconnects.labels("unclaimed_handoff").inc()
        # Nothing of the answer was seen; Envoy opens the observing stream with the request,
        # so an unclaimed hand-off means the request never got that far.
        reading = ResponseReading(streamed=state.request.stream)
        charged, metered = charged_usage(SettleCause.DISCONNECTED, reading, state.reservation)
        self.settle(
            state.reservation,
            SettleCause.DISCONNECTED,
            charged,
            metered=metered,
            request_id=state.request_id,
            pricing=state.route.pricing,
        )

    def record_violations(self, tenant: str, decision: Decision) -> None:
        for violation in decision.violations:
            if violation.shadow:
                self.metrics.shadow_rejections.labels(tenant, violation.limit).inc()
        view = decision.rate_limits
        if view is not None:
            if view.remaining_tokens is not None:
                self.metrics.tenant_remaining_tokens.labels(tenant).set(view.remaining_tokens)
            if view.remaining_requests is not None:
                self.metrics.tenant_remaining_requests.labels(tenant).set(view.remaining_requests)

    async def refresh_backend_gauges(self) -> None:
        """Read in-flight work from the store when /metrics is scraped, not per request:
        with a shared store that would be one more round trip on every admit and settle."""
        try:
            statuses = await self.store.backend_status()
        except Exception:
            log.warning("backend status unavailable; gauges keep their last values")
            return
        for status in statuses:
            self.metrics.kv_tokens_in_flight.labels(status.name).set(status.kv_tokens_in_flight)
            self.metrics.requests_in_flight.labels(status.name).set(status.requests_in_flight)

    async def drain(self, timeout_s: float) -> None:
        """Wait for settlements still running (shutdown)."""
        self.leases.close()
        pending = set(self._background)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
