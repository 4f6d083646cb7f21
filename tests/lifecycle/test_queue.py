"""The pool queue on its own: a simulated pool of KV tokens stands for admission (an attempt
takes room or answers NO_ROOM), releases stand for settlements. No store, no gRPC; the waiting
is driven by asyncio events and by an injected clock where time matters."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import pytest

from kvgate.lifecycle.queue import (
    MAX_ATTEMPTS_PER_ROUND,
    NO_ROOM,
    NoRoom,
    PoolQueue,
    QueueRejected,
    QueueSettings,
)

# Rounds happen only on wake-ups (arrivals, releases): the poll never fires during a test.
NO_POLL = QueueSettings(poll_interval_s=30.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def on_enqueue(self, pool: str, tenant: str, priority: int) -> None:
        self.events.append(("enqueue", tenant, priority))

    def on_dispatch(self, pool: str, tenant: str, priority: int, waited_s: float) -> None:
        self.events.append(("dispatch", tenant, priority, waited_s))

    def on_drop(self, pool: str, tenant: str, priority: int, reason: str, waited_s: float) -> None:
        self.events.append(("drop", tenant, priority, reason, waited_s))

    def of(self, kind: str) -> list[tuple[object, ...]]:
        return [e for e in self.events if e[0] == kind]


class Pool:
    """A pool of `capacity` KV tokens: an admission holds its cost until released."""

    def __init__(self, queue: PoolQueue, capacity: int, used: int | None = None) -> None:
        self.queue = queue
        self.capacity = capacity
        self.used = capacity if used is None else used
        self.attempts: list[str] = []
        self.admitted: list[str] = []

    def attempt(self, name: str, tenant: str, cost: int) -> Callable[[], Awaitable[str | NoRoom]]:
        async def attempt() -> str | NoRoom:
            self.attempts.append(name)
            if self.used + cost > self.capacity:
                return NO_ROOM
            self.used += cost
            self.admitted.append(name)
            self.queue.charge(tenant, cost, 0)
            return name

        return attempt

    def release(self, tokens: int) -> None:
        self.used -= tokens
        self.queue.notify_capacity_freed()


def submit(
    queue: PoolQueue,
    pool: Pool,
    name: str,
    cost: int = 10,
    *,
    tenant: str | None = None,
    priority: int = 0,
    already_tried: bool = True,
) -> asyncio.Task[str]:
    tenant = tenant or name.rstrip("0123456789")
    return asyncio.create_task(
        queue.run(
            tenant=tenant,
            priority=priority,
            cost_tokens=cost,
            attempt=pool.attempt(name, tenant, cost),
            already_tried=already_tried,
        )
    )


async def settle(steps: int = 50) -> None:
    """Lets every ready task run; no real time passes."""
    for _ in range(steps):
        await asyncio.sleep(0)


async def cancel_all(*tasks: asyncio.Task[str]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def assert_no_dispatcher() -> None:
    """The dispatcher task ends when the queue empties: nothing is left behind."""
    await settle()
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert not any(n.startswith("kvgate-queue-") for n in names)


# ---- entering the queue ---------------------------------------------------------------


async def test_alone_attempts_at_once_outside_the_queue() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=100, used=0)

    result = await q.run(
        tenant="a", priority=0, cost_tokens=10, attempt=pool.attempt("a1", "a", 10)
    )

    assert result == "a1"
    assert pool.attempts == ["a1"]
    assert rec.events == []  # never queued
    assert not q.has_waiters()
    await assert_no_dispatcher()


async def test_alone_after_no_room_waits_for_a_release_not_an_immediate_retry() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=10)

    task = submit(q, pool, "a1", already_tried=False)
    await settle()
    assert pool.attempts == ["a1"]  # the one attempt outside the queue
    assert q.waiting == 1
    assert rec.of("enqueue") == [("enqueue", "a", 0)]

    pool.release(10)
    assert await task == "a1"
    assert pool.attempts == ["a1", "a1"]
    assert [e[:3] for e in rec.of("dispatch")] == [("dispatch", "a", 0)]
    await assert_no_dispatcher()

    # The same once the queue has been used and emptied: no stale wake-up retries at once.
    task = submit(q, pool, "a2", already_tried=False)
    await settle()
    assert pool.attempts[2:] == ["a2"]
    pool.release(10)
    assert await task == "a2"
    await assert_no_dispatcher()


async def test_an_arrival_does_not_overtake_those_waiting() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    older = submit(q, pool, "a1")
    await settle()

    pool.used = 0  # room appears silently (another replica released)
    newcomer = submit(q, pool, "b1", already_tried=False)  # would fit at once
    await settle()

    # The arrival woke the dispatcher, which gave the room to the older waiter.
    assert pool.admitted == ["a1"]
    assert await older == "a1"
    assert pool.attempts == ["a1", "b1"]  # b1 tried only in its turn, after a1
    assert q.waiting == 1
    pool.release(10)
    assert await newcomer == "b1"
    await assert_no_dispatcher()


async def test_fifo_within_a_tenant() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    tasks = [submit(q, pool, f"a{i}", cost=10, tenant="a") for i in range(5)]
    await settle()

    for _ in range(5):
        pool.release(10)
        await settle()

    assert pool.admitted == [f"a{i}" for i in range(5)]
    assert await asyncio.gather(*tasks) == [f"a{i}" for i in range(5)]
    await assert_no_dispatcher()


# ---- order between tenants and classes ------------------------------------------------


async def test_the_tenant_with_the_smallest_counter_goes_first() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    a1 = submit(q, pool, "a1")  # arrived first...
    b1 = submit(q, pool, "b1")
    await settle()
    q.charge("a", 500, 0)  # ...but then had more service (a settlement, or an admission)

    pool.release(10)
    await settle()
    assert pool.admitted == ["b1"]
    pool.release(10)
    assert (await a1, await b1) == ("a1", "b1")
    await assert_no_dispatcher()


async def test_priority_classes_are_strict() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    q.charge("hi", 1_000_000, 0)  # far more service than lo: the class still wins
    lo = submit(q, pool, "lo1", priority=0)
    hi = submit(q, pool, "hi1", priority=5)
    await settle()
    assert q.waiting_by_priority() == {0: 1, 5: 1}

    pool.release(10)
    await settle()
    assert pool.admitted == ["hi1"]
    assert q.waiting_by_priority() == {0: 1, 5: 0}

    pool.release(10)
    assert (await hi, await lo) == ("hi1", "lo1")
    await assert_no_dispatcher()


async def test_a_tenant_back_from_idle_is_lifted_and_banks_no_credit() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    a1 = submit(q, pool, "a1")
    b1, b2 = submit(q, pool, "b1"), submit(q, pool, "b2")
    await settle()

    pool.release(10)  # a1 (tie on the counter: the older head)
    await settle()
    pool.release(10)  # b1
    await settle()
    assert pool.admitted == ["a1", "b1"]
    # a is idle while b keeps being served (e.g. long answers settling).
    q.charge("b", 5000, 0)
    assert q.counters() == {"a": 10.0, "b": 5010.0}

    a2 = submit(q, pool, "a2")  # a is backlogged again
    await settle()
    # Without the lift a would have 5000 of credit and pass b about 500 times in a row.
    assert q.counters()["a"] == 5010.0

    pool.release(10)
    await settle()
    assert pool.admitted[-1] == "b2"  # equal counters: the older head
    pool.release(10)
    assert await asyncio.gather(a1, b1, b2, a2) == ["a1", "b1", "b2", "a2"]
    await assert_no_dispatcher()


async def test_the_lift_looks_within_the_class_and_at_who_left_last() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=10)
    starved = submit(q, pool, "x1", priority=0)  # counter 0, waiting behind the busy class 1
    q.charge("h", 500, 0)
    busy = submit(q, pool, "h1", priority=1)
    await settle()

    newcomer = submit(q, pool, "n1", priority=1)
    q.charge("r", 900, 0)
    richer = submit(q, pool, "r1", priority=1)
    await settle()
    counters = q.counters()
    assert counters["n"] == 500.0  # the class's minimum, not the starved class 0's 0
    assert counters["r"] == 900.0  # a lift never lowers

    # An empty class lifts to the counter of the tenant that last left it.
    q.charge("t", 700, 0)
    leaving = submit(q, pool, "t1", priority=2)
    await settle()
    await cancel_all(leaving)
    assert q.waiting_by_priority()[2] == 0
    arriving = submit(q, pool, "u1", priority=2)
    await settle()
    assert q.counters()["u"] == 700.0

    await cancel_all(starved, busy, newcomer, richer, arriving)
    await assert_no_dispatcher()


# ---- work-conserving backfill ---------------------------------------------------------


async def test_a_smaller_head_of_another_tenant_uses_the_room_the_head_cannot() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=100)
    for tenant, counter in (("b", 10), ("c", 20), ("d", 5)):
        q.charge(tenant, counter, 0)
    tasks = [
        submit(q, pool, "a1", cost=50),  # the head: smallest counter
        submit(q, pool, "a2", cost=10),  # small, but behind a1 (FIFO within a tenant)
        submit(q, pool, "b1", cost=50),  # as large as the head: would fail the same
        submit(q, pool, "c1", cost=20),  # smaller: backfills
        submit(q, pool, "d1", cost=60),  # larger
        submit(q, pool, "e1", cost=10, priority=-1),  # lower class: never backfills
    ]
    await settle()
    pool.attempts.clear()

    pool.release(30)
    await settle()

    assert pool.attempts == ["a1", "c1"]
    assert pool.admitted == ["c1"]
    assert q.waiting == 5
    await cancel_all(*tasks)
    await assert_no_dispatcher()


async def test_a_round_tries_at_most_four_heads() -> None:
    q = PoolQueue("p", NO_POLL)
    pool = Pool(q, capacity=100)
    costs = [50, 40, 30, 20, 10, 8]
    for i in range(len(costs)):
        q.charge(f"t{i}x", i, 0)
    tasks = [submit(q, pool, f"t{i}x1", cost=c) for i, c in enumerate(costs)]
    await settle()
    pool.attempts.clear()

    pool.release(5)  # room for none of them
    await settle()
    assert MAX_ATTEMPTS_PER_ROUND == 4
    assert pool.attempts == ["t0x1", "t1x1", "t2x1", "t3x1"]

    await cancel_all(*tasks)
    await assert_no_dispatcher()


# ---- leaving the queue ----------------------------------------------------------------


async def test_a_cancelled_waiter_leaves_at_once_and_the_next_is_served() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=10)
    a1, a2 = submit(q, pool, "a1"), submit(q, pool, "a2")
    await settle()
    assert q.waiting == 2

    a1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a1
    assert q.waiting == 1
    assert [e[:4] for e in rec.of("drop")] == [("drop", "a", 0, "disconnected")]

    pool.release(10)
    assert await a2 == "a2"
    assert pool.admitted == ["a2"]
    await assert_no_dispatcher()


async def test_cancelled_between_its_turn_and_its_attempt_passes_the_turn_on() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=20)
    loop = asyncio.get_running_loop()
    q.charge("b", 1, 0)
    q.charge("c", 2, 0)
    b_task: list[asyncio.Task[str]] = []

    async def a_attempt() -> str | NoRoom:
        # Runs b's cancel just after the dispatcher grants b its turn, before b resumes.
        loop.call_soon(lambda: loop.call_soon(b_task[0].cancel))
        return await pool.attempt("a1", "a", 10)()

    a1 = asyncio.create_task(
        q.run(tenant="a", priority=0, cost_tokens=10, attempt=a_attempt, already_tried=True)
    )
    b_task.append(submit(q, pool, "b1"))
    c1 = submit(q, pool, "c1")
    await settle()

    pool.release(20)
    assert await a1 == "a1"
    assert await c1 == "c1"
    with pytest.raises(asyncio.CancelledError):
        await b_task[0]
    assert "b1" not in pool.attempts
    assert [e[:4] for e in rec.of("drop")] == [("drop", "b", 0, "disconnected")]
    assert q.waiting == 0
    await assert_no_dispatcher()


async def test_cancelled_during_its_attempt_in_its_own_task() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=10)
    started = asyncio.Event()
    seen: dict[str, object] = {}

    async def hanging_attempt() -> str | NoRoom:
        seen["task"] = asyncio.current_task()
        started.set()
        try:
            await asyncio.Event().wait()  # a store call that never answers
        except asyncio.CancelledError:
            seen["cancelled_in"] = asyncio.current_task()  # where a reservation is released
            raise
        return "never"

    a1 = asyncio.create_task(
        q.run(tenant="a", priority=0, cost_tokens=10, attempt=hanging_attempt, already_tried=True)
    )
    q.charge("b", 1, 0)
    b1 = submit(q, pool, "b1")
    await settle()

    pool.release(10)
    await started.wait()
    assert q.waiting == 2  # still counted during its turn
    a1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a1
    assert seen["task"] is a1
    assert seen["cancelled_in"] is a1
    assert await b1 == "b1"  # the dispatcher moved on
    assert [e[:4] for e in rec.of("drop")] == [("drop", "a", 0, "disconnected")]
    await assert_no_dispatcher()


async def test_an_attempt_that_raises_fails_only_its_caller() -> None:
    rec = Recorder()
    q = PoolQueue("p", NO_POLL, observer=rec)
    pool = Pool(q, capacity=10)

    class TenantLimit(Exception):
        pass

    async def refused() -> str | NoRoom:
        raise TenantLimit("tpm exhausted meanwhile")

    a1 = asyncio.create_task(
        q.run(tenant="a", priority=0, cost_tokens=10, attempt=refused, already_tried=True)
    )
    q.charge("b", 1, 0)
    b1 = submit(q, pool, "b1")
    await settle()

    pool.release(10)
    with pytest.raises(TenantLimit):
        await a1
    assert await b1 == "b1"
    assert [e[:4] for e in rec.of("drop")] == [("drop", "a", 0, "error")]
    await assert_no_dispatcher()


async def test_wait_expired_after_max_wait() -> None:
    rec = Recorder()
    clock = FakeClock()
    q = PoolQueue(
        "p", QueueSettings(max_wait_s=2.0, poll_interval_s=0.001), clock=clock, observer=rec
    )
    pool = Pool(q, capacity=10)
    task = submit(q, pool, "a1")
    await settle()
    clock.advance(1.999)
    await settle()
    assert q.waiting == 1

    clock.advance(0.001)
    with pytest.raises(QueueRejected) as info:
        await asyncio.wait_for(task, 1.0)
    assert info.value.reason == "wait_expired"
    assert info.value.waited_s == pytest.approx(2.0)
    assert info.value.retry_after_s == 2.0  # no drain measured yet: max_wait_s
    assert rec.of("drop") == [("drop", "a", 0, "wait_expired", pytest.approx(2.0))]
    assert q.waiting == 0
    await assert_no_dispatcher()


async def test_full_queues_reject_at_once_with_retry_after_from_the_drain_rate() -> None:
    rec = Recorder()
    clock = FakeClock()
    settings = QueueSettings(
        max_wait_s=100.0, max_queued=3, max_queued_per_tenant=2, poll_interval_s=30.0
    )
    q = PoolQueue("p", settings, clock=clock, observer=rec)
    pool = Pool(q, capacity=10)
    tasks = [submit(q, pool, "a1"), submit(q, pool, "a2")]
    await settle()

    with pytest.raises(QueueRejected) as tenant_full:
        await q.run(tenant="a", priority=0, cost_tokens=10, attempt=pool.attempt("a3", "a", 10))
    assert tenant_full.value.reason == "tenant_queue_full"
    assert tenant_full.value.waited_s == 0.0
    assert tenant_full.value.retry_after_s == 60.0  # no drain yet: max_wait_s, capped

    tasks.append(submit(q, pool, "b1"))
    await settle()
    with pytest.raises(QueueRejected) as full:
        await q.run(tenant="c", priority=0, cost_tokens=10, attempt=pool.attempt("c1", "c", 10))
    assert full.value.reason == "queue_full"
    assert "c1" not in pool.attempts

    # One dispatch 2 s after the queue became backlogged: 0.5 dispatches/s.
    clock.advance(2.0)
    pool.release(10)
    await settle()
    assert q.drain_rate_per_s() == pytest.approx(0.5)
    tasks.append(submit(q, pool, "c1"))
    await settle()
    assert q.waiting == 3
    with pytest.raises(QueueRejected) as full:
        await q.run(tenant="d", priority=0, cost_tokens=10, attempt=pool.attempt("d1", "d", 10))
    assert full.value.retry_after_s == pytest.approx(8.0)  # 3 ahead + itself, 2 s each

    # The drain stalls: the estimate follows the time since the last dispatch.
    clock.advance(10.0)
    with pytest.raises(QueueRejected) as full:
        await q.run(tenant="d", priority=0, cost_tokens=10, attempt=pool.attempt("d1", "d", 10))
    assert full.value.retry_after_s == pytest.approx(40.0)

    drops = [e[3] for e in rec.of("drop")]
    assert drops == ["tenant_queue_full", "queue_full", "queue_full", "queue_full"]
    await cancel_all(*tasks)
    await assert_no_dispatcher()


async def test_the_poll_finds_room_freed_without_a_wake_up() -> None:
    q = PoolQueue("p", QueueSettings(poll_interval_s=0.001))
    pool = Pool(q, capacity=10)
    task = submit(q, pool, "a1")
    await settle()
    pool.used = 0  # freed by another kvgate replica: nobody notifies
    assert await asyncio.wait_for(task, 1.0) == "a1"
    await assert_no_dispatcher()


# ---- the counters ---------------------------------------------------------------------


def test_charge_weighs_prompt_and_output_and_takes_corrections() -> None:
    q = PoolQueue("p", QueueSettings(input_weight=1.0, output_weight=2.0))
    q.charge("a", 100, 50)  # at admission, with the reserved output
    assert q.counters() == {"a": 200.0}
    q.charge("a", 0, -20)  # settled: 30 of the 50 reserved were generated
    counters = q.counters()
    assert counters == {"a": 160.0}
    counters["a"] = 0.0
    assert q.counters() == {"a": 160.0}  # a copy


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        QueueSettings(max_wait_s=0)
    with pytest.raises(ValueError):
        QueueSettings(max_queued=0)


async def test_a_failing_observer_does_not_break_the_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Recorder):
        def on_enqueue(self, pool: str, tenant: str, priority: int) -> None:
            raise RuntimeError("metrics bug")

    q = PoolQueue("p", NO_POLL, observer=Broken())
    pool = Pool(q, capacity=10)
    with caplog.at_level(logging.ERROR, logger="kvgate.queue"):
        task = submit(q, pool, "a1")
        await settle()
        pool.release(10)
        assert await task == "a1"
    assert "queue observer failed" in caplog.text
    await assert_no_dispatcher()


# ---- fairness under load --------------------------------------------------------------


async def test_vtc_keeps_a_light_tenant_within_bound_of_a_heavy_one() -> None:
    """A pool of 1000 KV tokens; heavy sends 10x the requests of light, all at once. Each
    admission holds its room until a simulated completion, which settles the counter with the
    output actually generated. While both are backlogged their counters stay within twice the
    largest weighted request, and light is not served after all of heavy's (as FIFO would)."""
    q = PoolQueue("p", QueueSettings(max_wait_s=600.0, poll_interval_s=0.001))
    capacity = 1000
    used = capacity  # the pool is busy when they arrive
    # (prompt, reserved output): both 100 KV tokens, so neither backfills past the other.
    shapes = {"heavy": (80, 20), "light": (20, 80)}
    bound = 2 * max(p * 1.0 + o * 2.0 for p, o in shapes.values())
    queued = {"heavy": 100, "light": 10}
    inflight: list[tuple[str, int, int]] = []
    served: list[str] = []
    worst_gap = 0.0
    rng = random.Random(7)

    def check() -> None:
        nonlocal worst_gap
        if queued["heavy"] and queued["light"]:
            c = q.counters()
            worst_gap = max(worst_gap, abs(c.get("heavy", 0.0) - c.get("light", 0.0)))

    def attempt_for(tenant: str) -> Callable[[], Awaitable[str | NoRoom]]:
        async def attempt() -> str | NoRoom:
            nonlocal used
            prompt, output = shapes[tenant]
            if used + prompt + output > capacity:
                return NO_ROOM
            used += prompt + output
            queued[tenant] -= 1
            q.charge(tenant, prompt, output)
            inflight.append((tenant, prompt, output))
            served.append(tenant)
            check()
            return tenant

        return attempt

    tasks = [
        asyncio.create_task(
            q.run(
                tenant=tenant,
                priority=0,
                cost_tokens=100,
                attempt=attempt_for(tenant),
                already_tried=True,
            )
        )
        for tenant in ["heavy"] * 100 + ["light"] * 10
    ]
    await settle()
    assert q.waiting == 110

    used = 0
    q.notify_capacity_freed()
    for _ in range(10_000):
        await settle(10)
        if all(t.done() for t in tasks):
            break
        if inflight:
            tenant, prompt, output = inflight.pop(rng.randrange(len(inflight)))
            generated = rng.randint(1, output)
            q.charge(tenant, 0, generated - output)
            used -= prompt + output
            check()
            q.notify_capacity_freed()
    assert all(t.done() for t in tasks)
    await asyncio.gather(*tasks)

    assert 0 < worst_gap <= bound
    last_light = max(i for i, tenant in enumerate(served) if tenant == "light")
    # Equal weighted service: about 3 heavy for 2 light, so light is done by ~25 admissions.
    assert last_light < 30
    await assert_no_dispatcher()
