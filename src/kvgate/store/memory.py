"""The embedded, single-process state store."""

from __future__ import annotations

import uuid
from dataclasses import replace

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLedger,
    BackendLimits,
    BackendStatus,
    Clock,
    Decision,
    MonotonicClock,
    Reservation,
    SettleCause,
    Settlement,
    UsageTotals,
)
from kvgate.store.base import ExpiredLeaseHook

# Expired leases are swept at most this often, on the admission path.
_SWEEP_INTERVAL_S = 1.0


class MemoryStore:
    """Keeps ledgers in this process. Every method runs without awaiting, so each call is
    atomic with respect to the event loop: check-and-reserve cannot interleave."""

    def __init__(
        self,
        *,
        lease_ttl_s: float,
        clock: Clock | None = None,
        on_lease_expired: ExpiredLeaseHook | None = None,
    ) -> None:
        self._clock = clock or MonotonicClock()
        self._lease_ttl_s = lease_ttl_s
        self._backends: dict[str, BackendLedger] = {}
        self._usage: dict[tuple[str, str], UsageTotals] = {}
        self._on_lease_expired = on_lease_expired
        self._next_sweep = 0.0

    def _ledger(self, limits: BackendLimits) -> BackendLedger:
        ledger = self._backends.get(limits.name)
        if ledger is None:
            ledger = self._backends[limits.name] = BackendLedger(limits=limits)
        elif ledger.limits != limits:
            # A reload changed the limits: new ones apply to new work, in-flight stays.
            ledger.limits = limits
        return ledger

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_INTERVAL_S
        for ledger in self._backends.values():
            for reservation in ledger.expire(now):
                if self._on_lease_expired is not None:
                    self._on_lease_expired(reservation)

    async def reserve(self, request: AdmissionRequest, limits: BackendLimits) -> Decision:
        now = self._clock.now()
        self._sweep(now)
        return self._ledger(limits).try_reserve(request, uuid.uuid4().hex, now, self._lease_ttl_s)

    async def settle(
        self, reservation: Reservation, cause: SettleCause, usage: ActualUsage
    ) -> Settlement:
        now = self._clock.now()
        ledger = self._backends.get(reservation.request.backend)
        released = ledger.release(reservation.reservation_id) if ledger else None
        duration = now - reservation.started_at
        settlement = Settlement(
            reservation_id=reservation.reservation_id,
            cause=cause,
            usage=usage,
            reserved_kv_tokens=reservation.kv_tokens,
            applied=released is not None,
            duration_s=duration,
        )
        if released is None:
            return settlement
        request = reservation.request
        totals = self._usage.setdefault((request.tenant, request.model), UsageTotals())
        totals.requests += 1
        totals.prompt_tokens += usage.prompt_tokens
        totals.output_tokens += usage.output_tokens
        totals.cached_tokens += usage.cached_tokens
        if cause is SettleCause.COMPLETED and ledger is not None:
            ledger.throughput.observe(duration, usage.output_tokens)
        return settlement

    async def renew(self, reservation: Reservation) -> bool:
        ledger = self._backends.get(reservation.request.backend)
        if ledger is None:
            return False
        return ledger.renew(reservation.reservation_id, self._clock.now(), self._lease_ttl_s)

    async def backend_status(self) -> list[BackendStatus]:
        self._sweep(self._clock.now())
        return [ledger.status() for ledger in self._backends.values()]

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        return {key: replace(totals) for key, totals in self._usage.items()}

    async def close(self) -> None:
        return None
