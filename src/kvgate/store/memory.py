"""The embedded, single-process state store."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
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
    TenantPolicy,
    TenantState,
    UsageTotals,
    admit,
    precheck,
    settle_tenant,
)
from kvgate.store.base import ExpiredLeaseHook, TenantUsage

# Expired leases are swept at most this often, on the admission path.
_SWEEP_INTERVAL_S = 1.0


class MemoryStore:
    """Keeps every ledger in this process. No method awaits before it has finished changing
    state, so each call is atomic with respect to the event loop: check-and-reserve of all
    limits cannot interleave with another request's."""

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
        self._tenants: dict[str, TenantState] = {}
        self._policies: dict[str, TenantPolicy] = {}
        self._totals: dict[tuple[str, str], UsageTotals] = {}
        # (tenant, period key, model) -> totals: the daily and monthly ledger.
        self._ledger: dict[tuple[str, str, str], UsageTotals] = {}
        self._on_lease_expired = on_lease_expired
        self._next_sweep = 0.0

    def _backend(self, limits: BackendLimits) -> BackendLedger:
        ledger = self._backends.get(limits.name)
        if ledger is None:
            ledger = self._backends[limits.name] = BackendLedger(limits=limits)
        elif ledger.limits != limits:
            # A reload changed the limits: new ones apply to new work, in-flight stays.
            ledger.limits = limits
        return ledger

    def _tenant(self, name: str) -> TenantState:
        state = self._tenants.get(name)
        if state is None:
            state = self._tenants[name] = TenantState()
        return state

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_INTERVAL_S
        for ledger in self._backends.values():
            for reservation in ledger.expire(now):
                self._release_tenant_hold(reservation, now)
                if self._on_lease_expired is not None:
                    self._on_lease_expired(reservation)

    def _release_tenant_hold(self, reservation: Reservation, now: float) -> None:
        """An expired lease frees its tenant slot and reservation; nothing is charged."""
        tenant = reservation.request.tenant
        policy = self._policies.get(tenant, TenantPolicy(name=tenant))
        settle_tenant(policy, self._tenant(tenant), reservation, ActualUsage(0, 0), 0, now)

    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        now = self._clock.now()
        self._sweep(now)
        self._policies[tenant.name] = tenant
        return admit(
            request,
            backend=self._backend(backend),
            policy=tenant,
            state=self._tenant(tenant.name),
            reservation_id=uuid.uuid4().hex,
            now=now,
            wall=self._clock.wall(),
            lease_ttl_s=self._lease_ttl_s,
        )

    async def precheck(
        self, lower_bound: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision | None:
        now = self._clock.now()
        return precheck(
            lower_bound,
            backend=self._backend(backend),
            policy=tenant,
            state=self._tenant(tenant.name),
            now=now,
            wall=self._clock.wall(),
        )

    async def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
    ) -> Settlement:
        now = self._clock.now()
        request = reservation.request
        backend = self._backends.get(request.backend)
        released = backend.release(reservation.reservation_id) if backend else None
        duration = now - reservation.started_at
        settlement = Settlement(
            reservation_id=reservation.reservation_id,
            cause=cause,
            usage=usage,
            reserved_kv_tokens=reservation.kv_tokens,
            applied=released is not None,
            duration_s=duration,
            cost_pico=cost_pico,
        )
        if released is None:
            return settlement
        settle_tenant(tenant, self._tenant(request.tenant), released, usage, cost_pico, now)
        self._totals.setdefault((request.tenant, request.model), UsageTotals()).add(
            usage, cost_pico
        )
        for _, key in released.hold.period_keys if released.hold else ():
            self._ledger.setdefault((request.tenant, key, request.model), UsageTotals()).add(
                usage, cost_pico
            )
        if cause is SettleCause.COMPLETED and backend is not None:
            backend.throughput.observe(duration, usage.output_tokens)
        return settlement

    async def renew(self, reservation: Reservation) -> bool:
        backend = self._backends.get(reservation.request.backend)
        if backend is None:
            return False
        return backend.renew(reservation.reservation_id, self._clock.now(), self._lease_ttl_s)

    async def backend_status(self) -> list[BackendStatus]:
        self._sweep(self._clock.now())
        return [ledger.status() for ledger in self._backends.values()]

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        return {key: replace(totals) for key, totals in self._totals.items()}

    async def tenant_usage(self, tenant: str, period_keys: Iterable[str]) -> TenantUsage:
        keys = set(period_keys)
        state = self._tenant(tenant)
        return TenantUsage(
            by_period_model={
                (key, model): replace(totals)
                for (name, key, model), totals in self._ledger.items()
                if name == tenant and key in keys
            },
            spent_pico={key: state.spent.get(key, 0) for key in keys},
            reserved_pico={key: state.reserved.get(key, 0) for key in keys},
        )

    async def close(self) -> None:
        return None
