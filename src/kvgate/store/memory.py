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
from kvgate.policy import tenant as tenant_limits
from kvgate.store.base import (
    ABANDON_RETENTION_S,
    BILL_RETENTION_S,
    ExpiredLeaseHook,
    TenantUsage,
    abandoned_decision,
)

# Expired leases are swept at most this often, on the admission path.
_SWEEP_INTERVAL_S = 1.0
# Idle level state (a JWT's users can be many) is pruned at most this often.
LEVEL_PRUNE_INTERVAL_S = 60.0


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
        bill_retention_s: float = BILL_RETENTION_S,
        abandon_retention_s: float = ABANDON_RETENTION_S,
    ) -> None:
        self._clock = clock or MonotonicClock()
        self._lease_ttl_s = lease_ttl_s
        # Billing records: reservation id -> (the reservation, when the record lapses). A
        # record outlives its lease (an expired request is still billed) and is consumed by
        # the first settlement, which makes settling idempotent for as long as it can matter.
        # Kept in lapsing order (a refresh moves it to the end), as are the tombstones, so a
        # sweep stops at the first one still valid.
        self._bills: dict[str, tuple[Reservation, float]] = {}
        self._bill_retention_s = max(bill_retention_s, lease_ttl_s)
        # (tenant, request id) -> reservation id, for abandon(); and abandoned requests ->
        # until when a reserve for them commits nothing.
        self._by_request: dict[tuple[str, str], str] = {}
        self._abandoned: dict[tuple[str, str], float] = {}
        self._abandon_retention_s = abandon_retention_s
        self._backends: dict[str, BackendLedger] = {}
        self._tenants: dict[str, TenantState] = {}
        self._policies: dict[str, TenantPolicy] = {}
        self._totals: dict[tuple[str, str], UsageTotals] = {}
        self._backend_totals: dict[str, UsageTotals] = {}
        # (tenant, period key, model) -> totals: the daily and monthly ledger.
        self._ledger: dict[tuple[str, str, str], UsageTotals] = {}
        self._on_lease_expired = on_lease_expired
        self._next_sweep = 0.0
        self._next_level_prune = 0.0

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
        lapsed: list[tuple[str, Reservation]] = []
        for reservation_id, (reservation, lapses_at) in self._bills.items():
            if lapses_at > now:
                break
            lapsed.append((reservation_id, reservation))
        for reservation_id, reservation in lapsed:
            self._drop_bill(reservation_id, reservation)
        ended: list[tuple[str, str]] = []
        for key, until in self._abandoned.items():
            if until > now:
                break
            ended.append(key)
        for key in ended:
            del self._abandoned[key]
        if now >= self._next_level_prune:
            self._next_level_prune = now + LEVEL_PRUNE_INTERVAL_S
            self.prune_idle_levels()

    def prune_idle_levels(self) -> int:
        """Forget every tenant's idle level state (full buckets, nothing in flight, money
        untouched for long with nothing reserved): what a fresh level would hold anyway.
        Runs on the sweep, at most every LEVEL_PRUNE_INTERVAL_S. Returns entries dropped."""
        now, wall = self._clock.now(), self._clock.wall()
        return sum(state.prune_idle_levels(now, wall) for state in self._tenants.values())

    def _drop_bill(self, reservation_id: str, reservation: Reservation) -> None:
        self._bills.pop(reservation_id, None)
        key = (reservation.request.tenant, reservation.request.request_id)
        if self._by_request.get(key) == reservation_id:
            del self._by_request[key]

    def _release_tenant_hold(self, reservation: Reservation, now: float) -> None:
        """An expired lease frees its tenant slot and reservation; nothing is charged."""
        tenant = reservation.request.tenant
        policy = self._policies.get(tenant, TenantPolicy(name=tenant))
        settle_tenant(
            policy,
            self._tenant(tenant),
            reservation,
            ActualUsage(0, 0),
            0,
            now,
            wall=self._clock.wall(),
        )

    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        now = self._clock.now()
        self._sweep(now)
        key = (request.tenant, request.request_id)
        if request.request_id and self._abandoned.get(key, now) > now:
            return abandoned_decision(request)
        self._policies[tenant.name] = tenant
        decision = admit(
            request,
            backend=self._backend(backend),
            policy=tenant,
            state=self._tenant(tenant.name),
            reservation_id=uuid.uuid4().hex,
            now=now,
            wall=self._clock.wall(),
            lease_ttl_s=self._lease_ttl_s,
        )
        reservation = decision.reservation
        if reservation is not None:
            self._bills[reservation.reservation_id] = (reservation, now + self._bill_retention_s)
            if request.request_id:
                self._by_request[key] = reservation.reservation_id
        return decision

    async def precheck(
        self,
        lower_bound: AdmissionRequest,
        backend: BackendLimits,
        tenant: TenantPolicy,
        *,
        take_request_slot: bool = False,
    ) -> Decision | None:
        now = self._clock.now()
        # Expired leases must not count against the tenant's concurrency here either (a
        # tenant refused at the pre-check may never reach a reserve, which sweeps).
        self._sweep(now)
        self._policies[tenant.name] = tenant
        return precheck(
            lower_bound,
            backend=self._backend(backend),
            policy=tenant,
            state=self._tenant(tenant.name),
            now=now,
            wall=self._clock.wall(),
            take_request_slot=take_request_slot,
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
        duration = now - reservation.started_at
        settlement = Settlement(
            reservation_id=reservation.reservation_id,
            cause=cause,
            usage=usage,
            reserved_kv_tokens=reservation.kv_tokens,
            applied=False,
            duration_s=duration,
            cost_pico=cost_pico,
        )
        bill = self._bills.get(reservation.reservation_id)
        if bill is None:
            return settlement  # settled or abandoned before, or its record lapsed
        billed, lapses_at = bill
        self._drop_bill(reservation.reservation_id, billed)
        if lapses_at <= now:
            return settlement  # nobody renewed or settled it for its whole retention
        released = backend.release(reservation.reservation_id) if backend else None
        state = self._tenant(request.tenant)
        if released is not None:
            settle_tenant(tenant, state, released, usage, cost_pico, now, wall=self._clock.wall())
        elif billed.hold is not None:
            # The lease expired (capacity freed, hold given back): bill what was used.
            tenant_limits.charge_expired(
                tenant,
                state,
                billed.hold,
                used_tokens=usage.total_tokens,
                cost_pico=cost_pico,
                now=now,
                wall=self._clock.wall(),
            )
        self._totals.setdefault((request.tenant, request.model), UsageTotals()).add(
            usage, cost_pico
        )
        self._backend_totals.setdefault(request.backend, UsageTotals()).add(usage, cost_pico)
        for _, key in billed.hold.period_keys if billed.hold else ():
            self._ledger.setdefault((request.tenant, key, request.model), UsageTotals()).add(
                usage, cost_pico
            )
        if cause is SettleCause.COMPLETED and usage.output_tokens > 0 and backend is not None:
            # Generation speed, learnt from generations (an embedding generates nothing).
            backend.throughput.observe(duration, usage.output_tokens)
        return replace(settlement, applied=True, lease_expired=released is None)

    async def renew(self, reservation: Reservation) -> bool:
        now = self._clock.now()
        bill = self._bills.get(reservation.reservation_id)
        if bill is not None:
            # While anyone renews, the request is open: keep its bill however long it runs.
            del self._bills[reservation.reservation_id]
            self._bills[reservation.reservation_id] = (bill[0], now + self._bill_retention_s)
        backend = self._backends.get(reservation.request.backend)
        if backend is None:
            return False
        return backend.renew(reservation.reservation_id, now, self._lease_ttl_s)

    async def abandon(self, request: AdmissionRequest) -> None:
        if not request.request_id:
            return  # nothing identifies it: its lease expires on its own
        now = self._clock.now()
        key = (request.tenant, request.request_id)
        self._abandoned.pop(key, None)
        self._abandoned[key] = now + self._abandon_retention_s
        reservation_id = self._by_request.pop(key, None)
        if reservation_id is None:
            return
        bill = self._bills.pop(reservation_id, None)
        # The backend it was reserved on (a fallback reserves on another model's backend).
        name = bill[0].request.backend if bill is not None else request.backend
        backend = self._backends.get(name)
        released = backend.release(reservation_id) if backend else None
        if released is None or released.hold is None:
            return  # its lease expired: the expiry gave everything back already
        tenant = released.request.tenant
        tenant_limits.release(
            self._policies.get(tenant, TenantPolicy(name=tenant)),
            self._tenant(tenant),
            released.hold,
            used_tokens=0,
            cost_pico=0,
            now=now,
            refund_request=True,
            wall=self._clock.wall(),
        )

    async def backend_status(self) -> list[BackendStatus]:
        self._sweep(self._clock.now())
        return [ledger.status() for ledger in self._backends.values()]

    async def record_cache_hit(
        self, tenant: str, model: str, saved_tokens: int, period_keys: Iterable[str]
    ) -> None:
        rows = [self._totals.setdefault((tenant, model), UsageTotals())]
        rows += [
            self._ledger.setdefault((tenant, key, model), UsageTotals()) for key in period_keys
        ]
        for totals in rows:
            totals.cache_hits += 1
            totals.cache_saved_tokens += saved_tokens

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        return {key: replace(totals) for key, totals in self._totals.items()}

    async def backend_totals(self) -> dict[str, UsageTotals]:
        return {key: replace(totals) for key, totals in self._backend_totals.items()}

    async def tenant_usage(
        self, tenant: str, period_keys: Iterable[str], levels: Iterable[str] = ()
    ) -> TenantUsage:
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
            level_spent_pico={
                (scope, key): state.level_spent.get((scope, key), 0)
                for scope in set(levels)
                for key in keys
            },
        )

    async def close(self) -> None:
        return None
