"""Redis failing under the store (the failure policy, bounded waits, reconciliation), and
Redis found through Sentinel.

Each test runs its own `redis-server` (no persistence) on a free port and kills, pauses or
restarts it mid-test. Real time here: the probe that notices Redis is back runs every 0.2 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    ConcurrencyRule,
    ManualClock,
    Reason,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
    UsageTotals,
)
from kvgate.store import (
    FailurePolicy,
    FallbackStore,
    MemoryStore,
    RedisSettings,
    RedisStore,
    StoreUnavailable,
)
from testbed.redis_harness import RedisSentinel, RedisServer

TIMEOUT_S = 0.3
PROBE_S = 0.2
BACKEND = BackendLimits("b", kv_budget_tokens=10_000, kv_block_size=16, max_concurrent_requests=64)
TENANT = TenantPolicy(name="t", limits=ScopeLimits(concurrency=ConcurrencyRule(2)))


def req(n: int = 0) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=f"r{n}",
        tenant="t",
        model="m",
        backend="b",
        prompt_tokens=10,
        max_new_tokens=10,
        cost_pico=1000,
    )


class _Recorder:
    """StoreEvents that records everything."""

    def __init__(self) -> None:
        self.up: list[bool] = []
        self.fallbacks: list[bool] = []
        self.errors: list[str] = []
        self.reconciled_kinds: list[str] = []
        self.dropped_count = 0
        self.pending_count = 0

    def availability(self, up: bool) -> None:
        self.up.append(up)

    def fallback_decision(self, admitted: bool) -> None:
        self.fallbacks.append(admitted)

    def error(self, op: str) -> None:
        self.errors.append(op)

    def pending(self, count: int) -> None:
        self.pending_count = count

    def dropped(self) -> None:
        self.dropped_count += 1

    def reconciled(self, kind: str) -> None:
        self.reconciled_kinds.append(kind)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


@pytest.fixture
def durable_server(tmp_path: Path) -> Iterator[RedisServer]:
    """AOF with fsync on every write: leases and billing records survive a SIGKILL."""
    with RedisServer(tmp_path / "redis", persistent=True) as running:
        yield running


def fallback_store(
    server: RedisServer,
    policy: FailurePolicy,
    events: _Recorder,
    max_pending: int = 100,
    probe_s: float = PROBE_S,
) -> FallbackStore:
    shared = RedisStore.from_settings(
        RedisSettings(url=server.url, key_prefix="fail", timeout_s=TIMEOUT_S),
        lease_ttl_s=60,
    )
    return FallbackStore(
        shared,
        MemoryStore(lease_ttl_s=60),
        policy=policy,
        retry_after_s=3,
        probe_interval_s=probe_s,
        max_pending=max_pending,
        events=events,
    )


@pytest.fixture
async def events() -> AsyncIterator[_Recorder]:
    yield _Recorder()


async def wait_for(predicate: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_fail_closed_answers_within_the_timeout_and_reconciles(
    durable_server: RedisServer, events: _Recorder
) -> None:
    server = durable_server
    store = fallback_store(server, FailurePolicy.FAIL_CLOSED, events)
    try:
        held = (await store.reserve(req(1), BACKEND, TENANT)).reservation
        assert held is not None
        server.kill()

        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            await store.reserve(req(2), BACKEND, TENANT)
        assert time.monotonic() - started < TIMEOUT_S + 0.2
        assert info.value.retry_after_s == 3
        assert not store.available and events.up == [False]
        # Meanwhile nobody waits on the dead server at all.
        started = time.monotonic()
        for n in range(20):
            with pytest.raises(StoreUnavailable):
                await store.reserve(req(10 + n), BACKEND, TENANT)
        # Twenty calls in less than one call's timeout: none of them waited for it.
        assert time.monotonic() - started < TIMEOUT_S

        # The settlement of a Redis lease waits in the queue...
        settlement = await store.settle(
            held, SettleCause.COMPLETED, ActualUsage(10, 7), cost_pico=900, tenant=TENANT
        )
        assert settlement.applied and store.pending_settlements == 1
        with pytest.raises(StoreUnavailable):
            await store.usage_totals()

        # ... and lands when Redis is back (its billing record survived), before new
        # admissions.
        server.start()
        await wait_for(lambda: store.available)
        assert events.up == [False, True] and events.reconciled_kinds == ["settle"]
        assert store.pending_settlements == 0
        assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 10, 7, 0, 900)}
        assert (await store.reserve(req(3), BACKEND, TENANT)).admitted
        assert "reserve" in events.errors
    finally:
        await store.close()


async def test_fail_open_admits_locally_and_books_the_ledger_later(
    server: RedisServer, events: _Recorder
) -> None:
    store = fallback_store(server, FailurePolicy.FAIL_OPEN, events)
    try:
        assert await store.check()
        server.kill()
        started = time.monotonic()
        first = await store.reserve(req(1), BACKEND, TENANT)
        assert time.monotonic() - started < TIMEOUT_S + 0.2
        second = await store.reserve(req(2), BACKEND, TENANT)
        third = await store.reserve(req(3), BACKEND, TENANT)
        # The local store enforces the same limits (here: 2 at once).
        assert first.admitted and second.admitted
        assert third.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
        assert events.fallbacks == [True, True, False]
        assert first.reservation and second.reservation
        statuses = await store.backend_status()
        assert [(s.name, s.requests_in_flight) for s in statuses] == [("b", 2)]

        for n, reservation in enumerate((first.reservation, second.reservation)):
            await store.settle(
                reservation,
                SettleCause.COMPLETED,
                ActualUsage(10, 5 + n),
                cost_pico=100 + n,
                tenant=TENANT,
            )
        assert store.pending_settlements == 2
        assert (await store.reserve(req(4), BACKEND, TENANT)).admitted  # slots came back

        server.start()
        await wait_for(lambda: store.available)
        assert events.reconciled_kinds == ["local", "local"]
        assert await store.usage_totals() == {("t", "m"): UsageTotals(2, 20, 11, 0, 201)}
        day = first.reservation.hold.period_keys[0][1] if first.reservation.hold else ""
        usage = await store.tenant_usage("t", [day])
        assert usage.spent_pico == {day: 201}
    finally:
        await store.close()


async def test_a_hung_redis_costs_each_call_at_most_the_timeout(
    server: RedisServer, events: _Recorder
) -> None:
    shared = RedisStore.from_settings(
        RedisSettings(url=server.url, key_prefix="hung", timeout_s=TIMEOUT_S), lease_ttl_s=60
    )
    try:
        reservation = (await shared.reserve(req(1), BACKEND, TENANT)).reservation
        assert reservation is not None
        server.pause()  # connections stay open; nothing answers
        calls = [
            lambda: shared.reserve(req(2), BACKEND, TENANT),
            lambda: shared.settle(
                reservation, SettleCause.COMPLETED, ActualUsage(1, 1), cost_pico=0, tenant=TENANT
            ),
            lambda: shared.renew(reservation),
            shared.backend_status,
            shared.usage_totals,
            lambda: shared.tenant_usage("t", ["2026-01"]),
            shared.ping,
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call()
            assert time.monotonic() - started < TIMEOUT_S + 0.2
        server.resume()
        # The timed-out settlement may or may not have landed: a redelivery applies once.
        late = await shared.settle(
            reservation, SettleCause.COMPLETED, ActualUsage(1, 1), cost_pico=0, tenant=TENANT
        )
        again = await shared.settle(
            reservation, SettleCause.COMPLETED, ActualUsage(1, 1), cost_pico=0, tenant=TENANT
        )
        assert [late.applied, again.applied].count(True) <= 1
        assert (await shared.usage_totals())[("t", "m")].requests == 1
    finally:
        server.resume()
        await shared.close()


async def test_the_settlement_queue_is_bounded(server: RedisServer, events: _Recorder) -> None:
    store = fallback_store(server, FailurePolicy.FAIL_OPEN, events, max_pending=3)
    try:
        server.kill()
        wide = TenantPolicy(name="t")
        for n in range(5):
            decision = await store.reserve(req(n), BACKEND, wide)
            assert decision.reservation is not None
            await store.settle(
                decision.reservation,
                SettleCause.COMPLETED,
                ActualUsage(1, 1),
                cost_pico=1,
                tenant=wide,
            )
        assert store.pending_settlements == 3 and events.dropped_count == 2
        server.start()
        await wait_for(lambda: store.available)
        assert (await store.usage_totals())[("t", "m")].requests == 3
    finally:
        await store.close()


async def test_the_master_is_found_through_sentinel(tmp_path: Path) -> None:
    with (
        RedisServer(tmp_path / "master") as master,
        RedisSentinel(tmp_path / "sentinel", master) as sentinel,
    ):
        store = RedisStore.from_settings(
            RedisSettings(
                url="redis://unused/0",
                key_prefix="sentinel",
                timeout_s=2,
                sentinel_master=sentinel.name,
                sentinel_nodes=(("127.0.0.1", sentinel.port),),
            ),
            lease_ttl_s=60,
        )
        try:
            decision = await store.reserve(req(1), BACKEND, TENANT)
            assert decision.reservation is not None
            await store.settle(
                decision.reservation,
                SettleCause.COMPLETED,
                ActualUsage(10, 1),
                cost_pico=1,
                tenant=TENANT,
            )
            assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 10, 1, 0, 1)}
            with master.client() as direct:  # the state really is on the master
                assert direct.exists("{sentinel}:tot")
        finally:
            await store.close()


async def test_a_short_outage_frees_no_live_request_and_leaves_no_orphan(
    server: RedisServer, events: _Recorder
) -> None:
    """Redis hangs (SIGSTOP) for 2.6 s under a 3 s lease. A live request's
    lease lapses meanwhile and a reserve that timed out during the outage lands when Redis
    resumes (and sweeps the lapsed lease). On recovery the live request holds its lease
    again and the orphan is released; both requests are billed once."""
    shared = RedisStore.from_settings(
        RedisSettings(url=server.url, key_prefix="outage", timeout_s=TIMEOUT_S), lease_ttl_s=3
    )
    # The probe is slow enough for the test to look at Redis before the store recovers.
    store = FallbackStore(
        shared,
        MemoryStore(lease_ttl_s=3),
        policy=FailurePolicy.FAIL_OPEN,
        probe_interval_s=1.5,
        events=events,
    )
    raw = server.client()
    try:
        started = time.monotonic()
        live = (await store.reserve(req(1), BACKEND, TENANT)).reservation
        assert live is not None and live.kv_tokens == 32
        await asyncio.sleep(1.0)
        server.pause()
        # Times out (its script waits in the socket), so it is admitted locally.
        local = await store.reserve(req(2), BACKEND, TENANT)
        assert local.admitted and local.reservation is not None
        assert not store.available and events.fallbacks == [True]
        assert await store.renew(live)  # unknown while Redis hangs: the request goes on
        await asyncio.sleep(3.6 - (time.monotonic() - started))
        server.resume()  # a 2.6 s outage; the live lease lapsed at 3.0 s
        await asyncio.sleep(0.15)
        # The timed-out reserve landed, and swept the live request's lapsed lease.
        leased = raw.hkeys("{outage}:r|b")
        assert len(leased) == 1, "the timed-out reserve did not land"
        assert leased != [live.reservation_id.encode()]
        assert not store.available, "recovered too early for the test to look"
        assert await store.renew(local.reservation)  # as the request's timer does

        await wait_for(lambda: store.available)
        statuses = {s.name: s for s in await shared.backend_status()}
        # Redis holds the live request again, and not the orphan.
        assert (statuses["b"].kv_tokens_in_flight, statuses["b"].requests_in_flight) == (32, 1)
        assert raw.hkeys("{outage}:r|b") == [live.reservation_id.encode()]
        assert await store.renew(live)
        merged = {s.name: s for s in await store.backend_status()}
        assert merged["b"].requests_in_flight == 2  # + the local reservation serving r2
        for n, reservation in enumerate((live, local.reservation)):
            settlement = await store.settle(
                reservation,
                SettleCause.COMPLETED,
                ActualUsage(10, 3 + n),
                cost_pico=100 + n,
                tenant=TENANT,
            )
            assert settlement.applied and not settlement.lease_expired
        await wait_for(lambda: store.pending_settlements == 0)
        assert await store.usage_totals() == {("t", "m"): UsageTotals(2, 20, 7, 0, 201)}
        statuses = {s.name: s for s in await store.backend_status()}
        assert (statuses["b"].kv_tokens_in_flight, statuses["b"].requests_in_flight) == (0, 0)
    finally:
        server.resume()
        raw.close()
        await store.close()


async def test_a_settlement_redelivered_after_any_window_is_booked_once(
    server: RedisServer, events: _Recorder
) -> None:
    """A settlement whose first attempt landed but timed out is delivered again from the queue
    long after `settled_id_retention_s`: booked once."""
    clock = ManualClock()
    shared = RedisStore.from_settings(
        RedisSettings(
            url=server.url, key_prefix="dup", timeout_s=TIMEOUT_S, settled_id_retention_s=600
        ),
        lease_ttl_s=60,
        clock=clock,
    )
    store = FallbackStore(
        shared,
        MemoryStore(lease_ttl_s=60, clock=clock),
        policy=FailurePolicy.FAIL_CLOSED,
        probe_interval_s=PROBE_S,
        events=events,
    )
    usage = ActualUsage(10, 4)
    try:
        first = (await store.reserve(req(1), BACKEND, TENANT)).reservation
        other = (await store.reserve(req(2), BACKEND, TENANT)).reservation
        assert first is not None and other is not None
        # The first attempt lands (its reply is lost: the caller never learns it).
        assert (
            await shared.settle(first, SettleCause.COMPLETED, usage, cost_pico=5, tenant=TENANT)
        ).applied
        clock.advance(3600)  # far past the retention window
        assert (
            await shared.settle(other, SettleCause.COMPLETED, usage, cost_pico=5, tenant=TENANT)
        ).applied
        server.pause()
        await store.settle(first, SettleCause.COMPLETED, usage, cost_pico=5, tenant=TENANT)
        assert store.pending_settlements == 1  # the retry waits for Redis
        server.resume()
        await wait_for(lambda: store.available and store.pending_settlements == 0)
        assert await store.usage_totals() == {("t", "m"): UsageTotals(2, 20, 8, 0, 10)}
    finally:
        server.resume()
        await store.close()


async def test_an_abandon_that_cannot_reach_redis_is_done_on_recovery(
    durable_server: RedisServer, events: _Recorder
) -> None:
    """The compensating release survives the outage that caused it (a durable Redis is killed,
    and keeps the lease across its restart)."""
    server = durable_server
    # A slow probe: the test looks at Redis before the store recovers.
    store = fallback_store(server, FailurePolicy.FAIL_CLOSED, events, probe_s=1.5)
    shared = store._shared  # the Redis side, to look at
    try:
        held = await store.reserve(req(1), BACKEND, TENANT)
        assert held.admitted
        server.kill()
        await store.abandon(req(1))  # cannot reach Redis
        assert not store.available
        server.start()
        with server.client() as raw:
            assert raw.hlen("{fail}:r|b") == 1  # Redis still holds it
        await wait_for(lambda: store.available)
        statuses = {s.name: s for s in await shared.backend_status()}
        assert (statuses["b"].kv_tokens_in_flight, statuses["b"].requests_in_flight) == (0, 0)
        # Both slots of the tenant are free again; the abandoned request stays out.
        assert (await store.reserve(req(2), BACKEND, TENANT)).admitted
        assert (await store.reserve(req(3), BACKEND, TENANT)).admitted
        assert not (await store.reserve(req(1), BACKEND, TENANT)).admitted
    finally:
        await store.close()
