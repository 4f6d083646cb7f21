"""What kvgate does when the shared store (Redis) cannot answer: the failure policy.

`FallbackStore` wraps the shared store with a per-replica `MemoryStore`:

- While Redis answers, everything goes to Redis.
- The first call that fails (error or timeout) marks Redis down. From then on no request waits
  on Redis: a background probe pings it every `probe_interval_s`, and until a ping succeeds
  - `fail_closed`: `reserve` raises `StoreUnavailable` at once (the session answers 503 with
    Retry-After);
  - `fail_open`: `reserve` decides with the local store (the same limits, per replica), and
    every such decision is reported.
- A pre-check that takes the tenant's RPM request goes to Redis like a reserve; while Redis is
  down it raises `StoreUnavailable` (`fail_closed`) or is taken locally (`fail_open`), where
  the reserve will be decided too.
- Settlements never get lost on the way: a settlement of a Redis lease that cannot be
  delivered is queued, and so is the usage of every request admitted locally.
- Nothing a live request holds in Redis is lost to an outage, and nothing an interrupted
  call left there stays held. When the probe succeeds, before Redis is marked up again:
  1. the renewals skipped meanwhile are replayed for every Redis lease this replica still
     holds (`RedisStore.renew_many(revive=True)`: one that lapsed during the outage is held
     again, since its request is still running);
  2. every reserve whose outcome was lost (timed out or failed: it may have landed, or may
     still land) and every abandon that could not reach Redis is abandoned there
     (`RedisStore.abandon`: releases it, and a reserve landing later commits nothing). Under
     `fail_open` that request is served by its local reservation, so it is not held twice;
  3. the queue is delivered in order (`RedisStore.settle`: books through the reservation's
     billing record, once; `RedisStore.settle_local` for local admissions).
- The queue is bounded (`max_pending`); past it the oldest entry is dropped and reported (its
  lease, if any, still expires in Redis on its own). So is the list of reserves to abandon.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Decision,
    Reservation,
    SettleCause,
    Settlement,
    TenantPolicy,
    UsageTotals,
)
from kvgate.store.base import TenantUsage
from kvgate.store.errors import StoreUnavailable
from kvgate.store.memory import MemoryStore
from kvgate.store.redis_store import RedisStore

log = logging.getLogger("kvgate.store")

# Leases renewed per round trip when renewals are replayed after an outage.
_REPLAY_BATCH = 256


class FailurePolicy(enum.StrEnum):
    FAIL_CLOSED = "fail_closed"
    FAIL_OPEN = "fail_open"


class StoreEvents(Protocol):
    """What the failure handling reports (the composition root maps it onto metrics/health)."""

    def availability(self, up: bool) -> None: ...

    def fallback_decision(self, admitted: bool) -> None: ...

    def error(self, op: str) -> None: ...

    def pending(self, count: int) -> None: ...

    def dropped(self) -> None: ...

    def reconciled(self, kind: str) -> None: ...


class NullEvents:
    def availability(self, up: bool) -> None:
        return None

    def fallback_decision(self, admitted: bool) -> None:
        return None

    def error(self, op: str) -> None:
        return None

    def pending(self, count: int) -> None:
        return None

    def dropped(self) -> None:
        return None

    def reconciled(self, kind: str) -> None:
        return None


@dataclass(frozen=True, slots=True)
class _Pending:
    # "settle": the end of a Redis lease; "local": the usage of a locally admitted request.
    kind: Literal["settle", "local"]
    reservation: Reservation
    cause: SettleCause
    usage: ActualUsage
    cost_pico: int
    tenant: TenantPolicy


class FallbackStore:
    """`StateStore` over a shared `RedisStore`, applying the configured failure policy."""

    def __init__(
        self,
        shared: RedisStore,
        local: MemoryStore,
        *,
        policy: FailurePolicy,
        retry_after_s: float = 2.0,
        probe_interval_s: float = 1.0,
        max_pending: int = 10_000,
        events: StoreEvents | None = None,
    ) -> None:
        self._shared = shared
        self._local = local
        self._policy = policy
        self._retry_after_s = retry_after_s
        self._probe_interval_s = probe_interval_s
        self._events: StoreEvents = events or NullEvents()
        self._pending: deque[_Pending] = deque()
        self._max_pending = max_pending
        self._local_ids: set[str] = set()
        # (tenant, request id) -> reservation id of local reservations, for abandon().
        self._local_by_request: dict[tuple[str, str], str] = {}
        # Redis leases this replica holds (admitted, not yet settled or abandoned): their
        # renewals are replayed after an outage.
        self._live: dict[str, Reservation] = {}
        # Requests whose Redis reserve may have landed unseen, or whose abandon could not
        # reach Redis: abandoned there on recovery.
        self._orphans: dict[tuple[str, str], AdmissionRequest] = {}
        self._up = True
        self._recovery: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def available(self) -> bool:
        """Whether the shared store answered its last call."""
        return self._up

    @property
    def pending_settlements(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ health

    async def check(self) -> bool:
        """Ping the shared store now (start-up); marks it down if it does not answer."""
        try:
            await self._shared.ping()
        except StoreUnavailable as exc:
            self._mark_down("ping", exc)
            return False
        return True

    def _mark_down(self, op: str, exc: StoreUnavailable) -> None:
        self._events.error(op)
        if not self._up:
            return
        self._up = False
        log.error(
            "shared store unavailable; applying %s", self._policy.value, extra={"error": str(exc)}
        )
        self._events.availability(False)
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await self._shared.ping()
                await self._replay_renewals()
                await self._abandon_orphans()
                await self._drain()
            except StoreUnavailable:
                continue
            self._up = True
            log.warning("shared store available again")
            self._events.availability(True)
            return

    async def _replay_renewals(self) -> None:
        """Renew every Redis lease still held here, reviving those that lapsed meanwhile."""
        live = list(self._live.values())
        for start in range(0, len(live), _REPLAY_BATCH):
            batch = live[start : start + _REPLAY_BATCH]
            states = await self._shared.renew_many(batch, revive=True)
            revived = states.count(2)
            lost = [r.reservation_id for r, state in zip(batch, states, strict=True) if not state]
            if revived or lost:
                log.warning(
                    "leases after the outage: %d revived, %d lost",
                    revived,
                    len(lost),
                    extra={"lost": lost[:20]},
                )

    async def _abandon_orphans(self) -> None:
        # Until none is left: entries added meanwhile (an abandon during recovery) too.
        while self._orphans:
            key, request = next(iter(self._orphans.items()))
            await self._shared.abandon(request)
            # A newer entry for the same request (abandoned meanwhile) is covered by this one.
            self._orphans.pop(key, None)

    def _orphan(self, request: AdmissionRequest) -> None:
        if not request.request_id:
            return  # cannot be abandoned: its lease, if any, expires on its own
        key = (request.tenant, request.request_id)
        self._orphans.pop(key, None)
        if len(self._orphans) >= self._max_pending:
            lost = next(iter(self._orphans))
            del self._orphans[lost]
            log.error("too many reserves to abandon: dropped the oldest", extra={"key": lost})
        self._orphans[key] = request

    async def _drain(self) -> None:
        """Deliver queued settlements in order; stops at the first failure (raised)."""
        while self._pending:
            item = self._pending[0]
            await self._send(item)
            self._pending.popleft()
            self._events.reconciled(item.kind)
            self._events.pending(len(self._pending))

    async def _send(self, item: _Pending) -> Settlement:
        if item.kind == "local":
            return await self._shared.settle_local(
                item.reservation,
                item.cause,
                item.usage,
                cost_pico=item.cost_pico,
                tenant=item.tenant,
            )
        # A Redis lease: its billing record books it once, however late this arrives.
        return await self._shared.settle(
            item.reservation, item.cause, item.usage, cost_pico=item.cost_pico, tenant=item.tenant
        )

    def _enqueue(self, item: _Pending) -> None:
        if len(self._pending) >= self._max_pending:
            lost = self._pending.popleft()
            self._events.dropped()
            log.error(
                "settlement queue full: dropped the oldest entry",
                extra={"reservation_id": lost.reservation.reservation_id, "kind": lost.kind},
            )
        self._pending.append(item)
        self._events.pending(len(self._pending))

    # ------------------------------------------------------------------ StateStore

    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        if self._up:
            try:
                decision = await self._shared.reserve(request, backend, tenant)
            except StoreUnavailable as exc:
                # It may have landed, or may still land: release it there on recovery.
                self._orphan(request)
                self._mark_down("reserve", exc)
            else:
                if decision.reservation is not None:
                    self._live[decision.reservation.reservation_id] = decision.reservation
                return decision
        if self._policy is FailurePolicy.FAIL_CLOSED:
            raise StoreUnavailable(
                "the shared state store is unavailable", retry_after_s=self._retry_after_s
            )
        decision = await self._local.reserve(request, backend, tenant)
        self._events.fallback_decision(decision.admitted)
        if decision.reservation is not None:
            self._local_ids.add(decision.reservation.reservation_id)
            if request.request_id:
                self._local_by_request[(request.tenant, request.request_id)] = (
                    decision.reservation.reservation_id
                )
        return decision

    async def precheck(
        self,
        lower_bound: AdmissionRequest,
        backend: BackendLimits,
        tenant: TenantPolicy,
        *,
        take_request_slot: bool = False,
    ) -> Decision | None:
        if not take_request_slot:
            return None  # the shared store's answer without a slot to take (no round trip)
        if self._up:
            try:
                return await self._shared.precheck(
                    lower_bound, backend, tenant, take_request_slot=True
                )
            except StoreUnavailable as exc:
                # Taken or not is unknown: the caller lets its reserve take the request.
                self._mark_down("precheck", exc)
                raise
        if self._policy is FailurePolicy.FAIL_CLOSED:
            raise StoreUnavailable(
                "the shared state store is unavailable", retry_after_s=self._retry_after_s
            )
        # fail_open: the local store decides the reserve, so it takes the request too.
        return await self._local.precheck(lower_bound, backend, tenant, take_request_slot=True)

    async def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
    ) -> Settlement:
        reservation_id = reservation.reservation_id
        self._live.pop(reservation_id, None)
        if reservation_id in self._local_ids:
            self._local_ids.discard(reservation_id)
            key = (reservation.request.tenant, reservation.request.request_id)
            if self._local_by_request.get(key) == reservation_id:
                del self._local_by_request[key]
            settlement = await self._local.settle(
                reservation, cause, usage, cost_pico=cost_pico, tenant=tenant
            )
            if settlement.applied:
                await self._deliver(_Pending("local", reservation, cause, usage, cost_pico, tenant))
            return settlement
        if self._up:
            try:
                return await self._shared.settle(
                    reservation, cause, usage, cost_pico=cost_pico, tenant=tenant
                )
            except StoreUnavailable as exc:
                # It may or may not have landed; the late delivery applies it at most once.
                self._mark_down("settle", exc)
        self._enqueue(_Pending("settle", reservation, cause, usage, cost_pico, tenant))
        # Counted as applied: it will be, unless the queue overflows (reported).
        return Settlement(
            reservation_id=reservation_id,
            cause=cause,
            usage=usage,
            reserved_kv_tokens=reservation.kv_tokens,
            applied=True,
            cost_pico=cost_pico,
        )

    async def _deliver(self, item: _Pending) -> None:
        if self._up and not self._pending:
            try:
                await self._send(item)
            except StoreUnavailable as exc:
                self._mark_down("settle", exc)
            else:
                self._events.reconciled(item.kind)
                return
        self._enqueue(item)

    async def renew(self, reservation: Reservation) -> bool:
        if reservation.reservation_id in self._local_ids:
            return await self._local.renew(reservation)
        if not self._up:
            # Unknown: the request goes on, and its renewal is replayed on recovery.
            return True
        try:
            return await self._shared.renew(reservation)
        except StoreUnavailable as exc:
            self._mark_down("renew", exc)
            return True

    async def abandon(self, request: AdmissionRequest) -> None:
        if not request.request_id:
            return  # nothing identifies it: its lease expires on its own
        key = (request.tenant, request.request_id)
        local_id = self._local_by_request.pop(key, None)
        if local_id is not None:
            self._local_ids.discard(local_id)
        await self._local.abandon(request)
        for reservation_id, held in list(self._live.items()):
            if (held.request.tenant, held.request.request_id) == key:
                del self._live[reservation_id]
        if self._up:
            try:
                await self._shared.abandon(request)
            except StoreUnavailable as exc:
                self._mark_down("abandon", exc)
            else:
                self._orphans.pop(key, None)
                return
        # Redis may hold (or still receive) a reservation for it: release it on recovery.
        self._orphan(request)

    async def backend_status(self) -> list[BackendStatus]:
        merged: dict[str, BackendStatus] = {}
        shared: list[BackendStatus] = []
        if self._up:
            try:
                shared = await self._shared.backend_status()
            except StoreUnavailable as exc:
                self._mark_down("status", exc)
        for status in [*shared, *await self._local.backend_status()]:
            seen = merged.get(status.name)
            if seen is None:
                merged[status.name] = BackendStatus(
                    name=status.name,
                    kv_budget_tokens=status.kv_budget_tokens,
                    kv_tokens_in_flight=status.kv_tokens_in_flight,
                    requests_in_flight=status.requests_in_flight,
                    max_concurrent_requests=status.max_concurrent_requests,
                )
            else:
                seen.kv_tokens_in_flight += status.kv_tokens_in_flight
                seen.requests_in_flight += status.requests_in_flight
        return list(merged.values())

    async def record_cache_hit(
        self, tenant: str, model: str, saved_tokens: int, period_keys: Iterable[str]
    ) -> None:
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            await self._shared.record_cache_hit(tenant, model, saved_tokens, period_keys)
        except StoreUnavailable as exc:
            self._mark_down("cache_hit", exc)
            raise

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            return await self._shared.usage_totals()
        except StoreUnavailable as exc:
            self._mark_down("usage", exc)
            raise

    async def backend_totals(self) -> dict[str, UsageTotals]:
        # What a replica admitted while the shared store was down is booked there once it is
        # back (the settlement's `loc` replay), so the shared totals are the whole of them.
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            return await self._shared.backend_totals()
        except StoreUnavailable as exc:
            self._mark_down("usage", exc)
            raise

    async def tenant_usage(
        self, tenant: str, period_keys: Iterable[str], levels: Iterable[str] = ()
    ) -> TenantUsage:
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            return await self._shared.tenant_usage(tenant, period_keys, levels)
        except StoreUnavailable as exc:
            self._mark_down("usage", exc)
            raise

    async def close(self) -> None:
        self._closed = True
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        if self._up and self._orphans:
            # Last chance to release reserves whose outcome was lost (else they expire).
            with contextlib.suppress(StoreUnavailable):
                await self._abandon_orphans()
        if self._pending:
            # Last chance for queued settlements; what stays queued is reported lost.
            with contextlib.suppress(StoreUnavailable):
                await self._drain()
            if self._pending:
                log.error(
                    "shutting down with undelivered settlements",
                    extra={"count": len(self._pending)},
                )
        await self._shared.close()
        await self._local.close()
