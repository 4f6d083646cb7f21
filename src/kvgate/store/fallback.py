"""What kvgate does when the shared store (Redis) cannot answer: the failure policy.

`FallbackStore` wraps the shared store with a per-replica `MemoryStore`:

- While Redis answers, everything goes to Redis.
- The first call that fails (error or timeout) marks Redis down. From then on no request waits
  on Redis: a background probe pings it every `probe_interval_s`, and until a ping succeeds
  - `fail_closed`: `reserve` raises `StoreUnavailable` at once (the session answers 503 with
    Retry-After);
  - `fail_open`: `reserve` decides with the local store (the same limits, per replica), and
    every such decision is reported.
- Settlements never get lost on the way: a settlement of a Redis lease that cannot be
  delivered is queued, and so is the usage of every request admitted locally. When the probe
  succeeds the queue is delivered first (`RedisStore.settle_late`: settles the lease if it
  still exists, else books the usage once), then Redis is marked up again.
- The queue is bounded (`max_pending`); past it the oldest entry is dropped and reported (its
  lease, if any, still expires in Redis on its own).
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
                await self._drain()
            except StoreUnavailable:
                continue
            self._up = True
            log.warning("shared store available again")
            self._events.availability(True)
            return

    async def _drain(self) -> None:
        """Deliver queued settlements in order; stops at the first failure (raised)."""
        while self._pending:
            item = self._pending[0]
            await self._shared.settle_late(
                item.reservation,
                item.cause,
                item.usage,
                cost_pico=item.cost_pico,
                tenant=item.tenant,
            )
            self._pending.popleft()
            self._events.reconciled(item.kind)
            self._events.pending(len(self._pending))

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
                return await self._shared.reserve(request, backend, tenant)
            except StoreUnavailable as exc:
                self._mark_down("reserve", exc)
        if self._policy is FailurePolicy.FAIL_CLOSED:
            raise StoreUnavailable(
                "the shared state store is unavailable", retry_after_s=self._retry_after_s
            )
        decision = await self._local.reserve(request, backend, tenant)
        self._events.fallback_decision(decision.admitted)
        if decision.reservation is not None:
            self._local_ids.add(decision.reservation.reservation_id)
        return decision

    async def precheck(
        self, lower_bound: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision | None:
        # The shared store decides in one round trip; no cheaper early answer exists.
        return None

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
        if reservation_id in self._local_ids:
            self._local_ids.discard(reservation_id)
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
                await self._shared.settle_late(
                    item.reservation,
                    item.cause,
                    item.usage,
                    cost_pico=item.cost_pico,
                    tenant=item.tenant,
                )
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
            return True  # unknown: the stream goes on; its lease may expire meanwhile
        try:
            return await self._shared.renew(reservation)
        except StoreUnavailable as exc:
            self._mark_down("renew", exc)
            return True

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

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            return await self._shared.usage_totals()
        except StoreUnavailable as exc:
            self._mark_down("usage", exc)
            raise

    async def tenant_usage(self, tenant: str, period_keys: Iterable[str]) -> TenantUsage:
        if not self._up:
            raise StoreUnavailable("the shared state store is unavailable", self._retry_after_s)
        try:
            return await self._shared.tenant_usage(tenant, period_keys)
        except StoreUnavailable as exc:
            self._mark_down("usage", exc)
            raise

    async def close(self) -> None:
        self._closed = True
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
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
