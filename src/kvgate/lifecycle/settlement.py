"""Settlement: the one path by which an admitted request releases its reservation and is
charged, exactly once, whichever way it ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvgate.config import SnapshotHolder
from kvgate.lifecycle.billing import CutRequestCharge, ResponseReading, charged_usage
from kvgate.lifecycle.leases import LeaseKeeper
from kvgate.lifecycle.ticket import Ticket
from kvgate.metrics import Metrics
from kvgate.policy import ActualUsage, SettleCause, TenantPolicy, pico_to_usd
from kvgate.policy.pricing import PICO_PER_USD
from kvgate.store import StateStore
from kvgate.tokenize.vision import fetched_images
from kvgate.usage_records.facts import RequestFacts, settled_record

if TYPE_CHECKING:
    from kvgate.tracing import Tracing
    from kvgate.usage_records import UsageRecord

log = logging.getLogger("kvgate.settle")

# BackgroundTasks.track (the store write returns its outcome, which nothing awaits but the
# span).
Track = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class Settler:
    def __init__(
        self,
        *,
        store: StateStore,
        snapshots: SnapshotHolder,
        metrics: Metrics,
        leases: LeaseKeeper,
        track: Track,
        tracing: Tracing | None = None,
        on_released: Callable[[Ticket, ActualUsage], None] | None = None,
        usage_records: Callable[[UsageRecord], None] | None = None,
    ) -> None:
        # Takes one usage record per booked settlement (UsageRecordWriter.add: an append to
        # a bounded buffer); None when records are off. Answer runs read it for their hits.
        self.usage_records = usage_records
        # Told once a settlement freed its reservation (a pool's queue gets a turn).
        self._on_released = on_released
        self._store = store
        self._snapshots = snapshots
        self._metrics = metrics
        self._leases = leases
        self._track = track
        # OpenTelemetry spans (kvgate.tracing); None when tracing is off. Sessions read it
        # here too.
        self.tracing = tracing

    def settle(
        self,
        ticket: Ticket,
        cause: SettleCause,
        reading: ResponseReading,
        facts: RequestFacts | None = None,
    ) -> tuple[ActualUsage, asyncio.Task[None]]:
        """Charge what the billing rule says and release the reservation. The store write
        runs as a tracked task, so it lands even if the caller's stream is gone; returns
        what was charged and that task."""
        self._leases.release(ticket.reservation.reservation_id)
        rule = CutRequestCharge(self._snapshots.current.config.server.cut_request_charge)
        charged, metered = charged_usage(cause, reading, ticket.reservation, rule)
        if not metered:
            self._metrics.unmetered_settlements.labels(ticket.backend).inc()
        if reading.usage is not None and not fetched_images(ticket.request.messages):
            # An image the engine fetches is reserved at the model's most per image: a
            # bound by design, not a count that could disagree with the engine's.
            self._observe_prompt_count(ticket, reading.usage.prompt_tokens)
        cost = ticket.pricing.cost(
            charged.prompt_tokens, charged.output_tokens, charged.cached_tokens
        )
        book = self._book(ticket, cause, charged, cost, reading, facts)
        if self.tracing is not None:
            traced = self._traced(book, ticket, cause, charged, cost, metered, time.time_ns())
            return charged, self._track(traced)
        return charged, self._track(book)

    async def _traced(
        self,
        book: Coroutine[Any, Any, str],
        ticket: Ticket,
        cause: SettleCause,
        usage: ActualUsage,
        cost_pico: int,
        metered: bool,
        start_ns: int,
    ) -> None:
        """The store write, then its span (from settle() to the write's end)."""
        booked = await book
        assert self.tracing is not None
        try:
            self.tracing.settlement(
                ticket,
                cause,
                usage,
                cost_pico / PICO_PER_USD,
                start_ns,
                metered=metered,
                booked=booked,
            )
        except Exception:
            log.exception("recording the settlement span failed")

    async def _book(
        self,
        ticket: Ticket,
        cause: SettleCause,
        usage: ActualUsage,
        cost_pico: int,
        reading: ResponseReading,
        facts: RequestFacts | None,
    ) -> str:
        """Write the settlement; "booked", "duplicate" (already settled) or "failed"."""
        reservation = ticket.reservation
        request = reservation.request
        tenant = self._snapshots.current.tenants.get(request.tenant) or TenantPolicy(
            name=request.tenant
        )
        try:
            settlement = await self._store.settle(
                reservation, cause, usage, cost_pico=cost_pico, tenant=tenant
            )
        except Exception:
            # Say loudly that this one was not recorded (the lease still expires).
            log.exception("settlement failed", extra={"request_id": ticket.request_id})
            return "failed"
        if not settlement.applied:
            return "duplicate"
        if self.usage_records is not None:
            self._record(ticket, cause, reading, usage, cost_pico, facts, settlement.duration_s)
        if self._on_released is not None:
            try:
                self._on_released(ticket, usage)
            except Exception:
                log.exception("release hook failed", extra={"request_id": ticket.request_id})
        m = self._metrics
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
                "request_id": ticket.request_id,
                "tenant": request.tenant,
                "model": request.model,
                "cause": cause.value,
                "prompt_tokens": usage.prompt_tokens,
                "output_tokens": usage.output_tokens,
                "reserved_tokens": reservation.kv_tokens,
                "cost_usd": str(pico_to_usd(cost_pico)),
            },
        )
        return "booked"

    def _record(
        self,
        ticket: Ticket,
        cause: SettleCause,
        reading: ResponseReading,
        usage: ActualUsage,
        cost_pico: int,
        facts: RequestFacts | None,
        duration_s: float,
    ) -> None:
        """One usage record of what the ledger just booked (never fails the settlement)."""
        assert self.usage_records is not None
        try:
            record = settled_record(
                ticket,
                cause,
                reading,
                usage,
                cost_pico,
                facts,
                wall=time.time(),
                duration_s=duration_s,
            )
            self.usage_records(record)
        except Exception:
            log.exception("no usage record", extra={"request_id": ticket.request_id})

    def _observe_prompt_count(self, ticket: Ticket, backend_prompt_tokens: int) -> None:
        model = ticket.model
        error = ticket.prompt_tokens - backend_prompt_tokens
        self._metrics.prompt_count_error.labels(model).observe(error)
        if error:
            self._metrics.prompt_count_mismatches.labels(model).inc()
            log.warning(
                "prompt count differs from the backend's",
                extra={
                    "request_id": ticket.request_id,
                    "model": model,
                    "kvgate_prompt_tokens": ticket.prompt_tokens,
                    "backend_prompt_tokens": backend_prompt_tokens,
                },
            )
