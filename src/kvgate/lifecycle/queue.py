"""Waiting for room in a pool, fairly: one `PoolQueue` per pool.

A request that fits its tenant's own limits but finds no endpoint with room waits here for a
bounded time instead of getting a 429 at once. Turns are given one at a time by a dispatcher
task; the waiter whose turn it is runs its own `attempt` in its own task, so a client that
disconnects mid-attempt is cancelled where its caller's cancel handling releases what the
attempt reserved.

Order of turns: the highest priority class first (strict); within a class the backlogged
tenant with the smallest Virtual Token Counter (VTC, Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024); FIFO within a tenant. Work-conserving: when the chosen head
finds no room, smaller heads of other tenants of its class may use what room there is.

Protocol-free: no grpc, no store, no Envoy; `attempt` is whatever admission does.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

log = logging.getLogger("kvgate.queue")

T = TypeVar("T")

RejectReason = Literal["queue_full", "wait_expired", "tenant_queue_full"]
DropReason = Literal["queue_full", "tenant_queue_full", "wait_expired", "disconnected", "error"]

# A round (one wake-up) tries at most this many heads: bounds the store round trips a single
# freed slot can cause.
MAX_ATTEMPTS_PER_ROUND = 4
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
# Weight of the newest inter-dispatch interval in the drain-rate average.
DRAIN_EWMA_ALPHA = 0.3


class NoRoom:
    """What an attempt returns when no endpoint of the pool had room for it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_ROOM"


NO_ROOM = NoRoom()


class QueueRejected(Exception):
    """The request leaves the queue unserved: full at arrival, or waited `max_wait_s`."""

    def __init__(self, reason: RejectReason, *, retry_after_s: float, waited_s: float) -> None:
        super().__init__(f"{reason} (retry after {retry_after_s:.0f} s, waited {waited_s:.3f} s)")
        self.reason: RejectReason = reason
        self.retry_after_s = retry_after_s
        self.waited_s = waited_s


@dataclass(frozen=True, slots=True)
class QueueSettings:
    max_wait_s: float = 10.0
    max_queued: int = 1000
    max_queued_per_tenant: int = 100
    input_weight: float = 1.0  # VTC: weight of a prompt token
    output_weight: float = 2.0  # VTC: weight of an output token (the paper uses w_q = 2 w_p)
    # Re-try the head this often while waiting even without a wake-up: other kvgate replicas
    # free capacity this one is not told about.
    poll_interval_s: float = 0.05

    def __post_init__(self) -> None:
        if self.max_wait_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("max_wait_s and poll_interval_s must be positive")
        if self.max_queued < 1 or self.max_queued_per_tenant < 1:
            raise ValueError("max_queued and max_queued_per_tenant must be at least 1")
        if self.input_weight < 0 or self.output_weight < 0:
            raise ValueError("VTC weights must not be negative")


class QueueObserver(Protocol):
    """Metrics hooks. Called synchronously; an exception here is logged, never raised."""

    def on_enqueue(self, pool: str, tenant: str, priority: int) -> None: ...

    def on_dispatch(self, pool: str, tenant: str, priority: int, waited_s: float) -> None: ...

    def on_drop(
        self, pool: str, tenant: str, priority: int, reason: DropReason, waited_s: float
    ) -> None: ...


class _Outcome(enum.Enum):
    """What a waiter reports to the dispatcher after its turn."""

    ADMITTED = "admitted"
    NO_ROOM = "no_room"
    FAILED = "failed"
    CANCELLED = "cancelled"


class _Waiter:
    __slots__ = (
        "cost",
        "deadline",
        "enqueued_at",
        "priority",
        "queued",
        "report",
        "seq",
        "tenant",
        "turn",
    )

    def __init__(
        self, seq: int, tenant: str, priority: int, cost: int, now: float, max_wait_s: float
    ) -> None:
        self.seq = seq
        self.tenant = tenant
        self.priority = priority
        self.cost = cost
        self.enqueued_at = now
        self.deadline = now + max_wait_s
        # Resolved by the dispatcher: None = "your turn", QueueRejected = expired.
        self.turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Set by the dispatcher for the length of a turn; the waiter resolves it.
        self.report: asyncio.Future[_Outcome] | None = None
        self.queued = True


@dataclass(slots=True)
class _Band:
    """One priority class: its backlogged tenants, each with a FIFO of waiters."""

    tenants: dict[str, deque[_Waiter]] = field(default_factory=dict)
    waiting: int = 0
    # Counter of the tenant that last left this class's backlog (see `_lift`).
    last_left: float | None = None


class PoolQueue:
    """The waiting room of one pool.

    Callers send every admission on the pool through `run`: with nobody waiting it attempts
    at once, outside the queue; with anybody waiting it queues behind them (no overtaking).
    `has_waiters()` tells a caller that admits without `run` that it would overtake.
    """

    def __init__(
        self,
        pool: str,
        settings: QueueSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: QueueObserver | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self._clock = clock
        self._observer = observer
        self._counters: dict[str, float] = {}
        self._bands: dict[int, _Band] = {}
        # Every waiter by arrival; all share max_wait_s, so the oldest expires first.
        self._by_age: OrderedDict[int, _Waiter] = OrderedDict()
        self._per_tenant: dict[str, int] = {}
        self._seq = 0
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        # Drain rate: EWMA of the time between successful dispatches while the queue is
        # backlogged (rate = 1 / interval); `_rate_mark` is the last dispatch, or the moment
        # the queue became non-empty, so idle time between backlogs is not counted.
        self._interval_ewma: float | None = None
        self._rate_mark = 0.0

    # ---- reading ---------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._by_age)

    def has_waiters(self) -> bool:
        return bool(self._by_age)

    def waiting_by_priority(self) -> dict[int, int]:
        """Queue length per priority class (classes that never had a waiter are absent)."""
        return {priority: band.waiting for priority, band in self._bands.items()}

    def counters(self) -> dict[str, float]:
        return dict(self._counters)

    def drain_rate_per_s(self) -> float | None:
        """Successful dispatches per second while backlogged; None before the first one."""
        interval = self._dispatch_interval()
        return None if interval is None else 1.0 / max(interval, 1e-9)

    # ---- feeding ---------------------------------------------------------------------

    def notify_capacity_freed(self) -> None:
        """A settlement or release on this pool: give the next turn now."""
        if self._by_age:
            self._wake.set()

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Add service given to `tenant` to its VTC counter.

        Call it for every admission on the pool, queued or not, with the reserved output, and
        at settlement with `actual - reserved` output (negative), so the counter reflects the
        service actually given. Charge inside the attempt, or before the caller's next await,
        so that the dispatcher's next choice already sees it.
        """
        s = self.settings
        delta = s.input_weight * prompt_tokens + s.output_weight * output_tokens
        self._counters[tenant] = self._counters.get(tenant, 0.0) + delta

    # ---- waiting ---------------------------------------------------------------------

    async def run(
        self,
        *,
        tenant: str,
        priority: int,
        cost_tokens: int,
        attempt: Callable[[], Awaitable[T | NoRoom]],
        already_tried: bool = False,
    ) -> T:
        """Run `attempt` in this task when it is this request's turn; return its first result
        that is not NO_ROOM.

        With nobody waiting, attempts at once (unless `already_tried`: the caller attempted
        outside the queue and got NO_ROOM, so an immediate retry would only repeat it).
        Exceptions from `attempt` propagate here and the queue moves on. Raises
        `QueueRejected` at once when full, and after `max_wait_s` ("wait_expired").
        Cancellation (client gone) removes the request at once, during its turn or not.
        """
        if not already_tried and not self._by_age:
            # Nobody waits, so nobody is overtaken.
            first = await attempt()
            if not isinstance(first, NoRoom):
                return first
            already_tried = True
        alone = not self._by_age
        waiter = self._enqueue(tenant, priority, cost_tokens)
        self._ensure_dispatcher()
        if not (alone and already_tried):
            # An arrival may be a smaller or higher-class head that fits where the others did
            # not. One alone that just found no room waits for a release or the next poll.
            self._wake.set()
        try:
            while True:
                await waiter.turn
                try:
                    result = await attempt()
                except BaseException as exc:
                    self._leave(waiter, _drop_reason(exc))
                    raise
                if isinstance(result, NoRoom):
                    # Keeps its place at the head of its tenant's queue.
                    waiter.turn = asyncio.get_running_loop().create_future()
                    self._report(waiter, _Outcome.NO_ROOM)
                    self._ensure_dispatcher()
                    continue
                self._dispatched(waiter)
                return result
        except BaseException as exc:
            if waiter.queued:
                # Cancelled (or the dispatcher died) while waiting for its turn, or right
                # after it was granted but before it could run.
                self._leave(waiter, _drop_reason(exc))
            raise
        finally:
            _consume(waiter.turn)

    # ---- queue bookkeeping ------------------------------------------------------------

    def _enqueue(self, tenant: str, priority: int, cost: int) -> _Waiter:
        s = self.settings
        if len(self._by_age) >= s.max_queued:
            self._reject_at_door(tenant, priority, "queue_full")
        if self._per_tenant.get(tenant, 0) >= s.max_queued_per_tenant:
            self._reject_at_door(tenant, priority, "tenant_queue_full")
        now = self._clock()
        if not self._by_age:
            self._rate_mark = now
            self._wake.clear()  # stale: set when the last waiter left
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
        fifo = band.tenants.get(tenant)
        if fifo is None:
            self._lift(tenant, band)
            fifo = band.tenants[tenant] = deque()
        self._seq += 1
        waiter = _Waiter(self._seq, tenant, priority, cost, now, s.max_wait_s)
        fifo.append(waiter)
        band.waiting += 1
        self._by_age[waiter.seq] = waiter
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._tell(lambda o: o.on_enqueue(self.pool, tenant, priority))
        return waiter

    def _lift(self, tenant: str, band: _Band) -> None:
        """VTC counter lift as `tenant` becomes backlogged in `band`: up to the smallest
        counter among the class's backlogged tenants, or, with none, to the counter of the
        last tenant that left the class's backlog. An idle tenant cannot bank credit.

        Within the class, not across classes: only counters within a class are ever compared,
        and a lower class starved by strict priority keeps low counters that would let a
        newcomer to a busy higher class jump its peers. A tenant backlogged in two classes
        shares one counter; a lift only ever raises it.
        """
        backlogged = [self._counters.get(t, 0.0) for t in band.tenants]
        floor = min(backlogged) if backlogged else band.last_left
        if floor is not None and floor > self._counters.get(tenant, 0.0):
            self._counters[tenant] = floor

    def _remove(self, waiter: _Waiter) -> None:
        waiter.queued = False
        del self._by_age[waiter.seq]
        band = self._bands[waiter.priority]
        fifo = band.tenants[waiter.tenant]
        if fifo[0] is waiter:
            fifo.popleft()
        else:
            fifo.remove(waiter)
        band.waiting -= 1
        if not fifo:
            del band.tenants[waiter.tenant]
            band.last_left = self._counters.get(waiter.tenant, 0.0)
        left = self._per_tenant[waiter.tenant] - 1
        if left:
            self._per_tenant[waiter.tenant] = left
        else:
            del self._per_tenant[waiter.tenant]
        if not self._by_age:
            self._wake.set()  # lets an idle dispatcher see the empty queue and end

    def _drop(self, waiter: _Waiter, reason: DropReason) -> None:
        """Removes a waiter that leaves unserved; whoever removes it reports it, once."""
        waited = self._clock() - waiter.enqueued_at
        self._remove(waiter)
        self._tell(lambda o: o.on_drop(self.pool, waiter.tenant, waiter.priority, reason, waited))

    def _leave(self, waiter: _Waiter, reason: DropReason) -> None:
        self._drop(waiter, reason)
        self._report(waiter, _Outcome.CANCELLED if reason == "disconnected" else _Outcome.FAILED)

    def _dispatched(self, waiter: _Waiter) -> None:
        now = self._clock()
        waited = now - waiter.enqueued_at
        self._remove(waiter)
        sample = max(0.0, now - self._rate_mark)
        self._interval_ewma = (
            sample
            if self._interval_ewma is None
            else DRAIN_EWMA_ALPHA * sample + (1 - DRAIN_EWMA_ALPHA) * self._interval_ewma
        )
        self._rate_mark = now
        self._tell(lambda o: o.on_dispatch(self.pool, waiter.tenant, waiter.priority, waited))
        self._report(waiter, _Outcome.ADMITTED)

    @staticmethod
    def _report(waiter: _Waiter, outcome: _Outcome) -> None:
        if waiter.report is not None and not waiter.report.done():
            waiter.report.set_result(outcome)

    def _reject_at_door(self, tenant: str, priority: int, reason: RejectReason) -> None:
        retry_after = self._retry_after(self._waiting_at_or_above(priority) + 1)
        self._tell(lambda o: o.on_drop(self.pool, tenant, priority, reason, 0.0))
        raise QueueRejected(reason, retry_after_s=retry_after, waited_s=0.0)

    def _expire_overdue(self) -> None:
        now = self._clock()
        while self._by_age:
            oldest = next(iter(self._by_age.values()))
            if oldest.deadline > now:
                return
            if oldest.turn.done():  # its task was cancelled and has not run yet
                self._drop(oldest, "disconnected")
                continue
            # Dispatches it would need to get through if it came back now.
            retry_after = self._retry_after(self._waiting_at_or_above(oldest.priority))
            waited = now - oldest.enqueued_at
            self._drop(oldest, "wait_expired")
            oldest.turn.set_exception(
                QueueRejected("wait_expired", retry_after_s=retry_after, waited_s=waited)
            )

    def _waiting_at_or_above(self, priority: int) -> int:
        return sum(band.waiting for p, band in self._bands.items() if p >= priority)

    def _dispatch_interval(self) -> float | None:
        if self._interval_ewma is None:
            return None
        if self._by_age:
            # A drain that stalled is slower than its average says.
            return max(self._interval_ewma, self._clock() - self._rate_mark)
        return self._interval_ewma

    def _retry_after(self, dispatches_needed: int) -> float:
        interval = self._dispatch_interval()
        estimate = self.settings.max_wait_s if interval is None else dispatches_needed * interval
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate))

    def _tell(self, call: Callable[[QueueObserver], object]) -> None:
        if self._observer is None:
            return
        try:
            call(self._observer)
        except Exception:
            log.exception("queue observer failed (pool %s)", self.pool)

    # ---- dispatching ------------------------------------------------------------------

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.get_running_loop().create_task(
                self._dispatch(), name=f"kvgate-queue-{self.pool}"
            )

    async def _dispatch(self) -> None:
        """Gives turns while anybody waits; ends when the queue is empty (a later arrival
        starts a new one)."""
        progressed = False
        try:
            while True:
                self._expire_overdue()
                if not self._by_age:
                    return
                if not progressed and not self._wake.is_set():
                    await self._sleep()  # then a round: woken, or polling
                    self._expire_overdue()
                    if not self._by_age:
                        return
                self._wake.clear()  # a wake-up during the round is kept for after it
                # When a head left (served, failed, gone) there may be room for the next one.
                progressed = await self._round()
        except BaseException as exc:
            self._fail_waiters(exc)
            raise
        finally:
            self._dispatcher = None

    async def _sleep(self) -> None:
        """Until a wake-up, the next poll, or the oldest waiter's deadline."""
        oldest = next(iter(self._by_age.values()))
        timeout = min(self.settings.poll_interval_s, max(0.0, oldest.deadline - self._clock()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    async def _round(self) -> bool:
        """One round of turns. True when the head left the queue (served, failed or gone),
        so the next head should be tried at once; False when the round found no room.

        Work-conserving backfill: after the head finds no room, the heads of other tenants of
        its class that are strictly smaller than every cost that failed this round are tried,
        in VTC order, up to MAX_ATTEMPTS_PER_ROUND attempts in all; one of equal size would
        fail just the same. The trade-off: a large head can be passed over by smaller ones
        for as long as they keep fitting; it is protected by max_wait_s (it then gets a 429),
        not by leaving capacity idle. It stays first in VTC order, so it gets every first
        attempt after a release. Not across classes: backfilling from a lower class would
        take the room a higher class is waiting for, and classes are strict.
        """
        head = self._pick(None, ceiling=None)
        if head is None:
            return False
        if await self._grant(head) is not _Outcome.NO_ROOM:
            return True
        ceiling = head.cost
        for _ in range(MAX_ATTEMPTS_PER_ROUND - 1):
            self._expire_overdue()
            candidate = self._pick(head.priority, ceiling)
            if candidate is None:
                break
            if await self._grant(candidate) is _Outcome.NO_ROOM:
                ceiling = candidate.cost
        return False

    def _pick(self, priority: int | None, ceiling: int | None) -> _Waiter | None:
        """The next head: in `priority`'s class (default: the highest with waiters), the
        tenant with the smallest counter (ties: the older head), among heads cheaper than
        `ceiling`."""
        if priority is None:
            busy = [p for p, band in self._bands.items() if band.waiting]
            if not busy:
                return None
            priority = max(busy)
        band = self._bands.get(priority)
        if band is None:
            return None
        best: _Waiter | None = None
        best_key: tuple[float, int] | None = None
        for tenant, fifo in band.tenants.items():
            head = fifo[0]
            if ceiling is not None and head.cost >= ceiling:
                continue
            key = (self._counters.get(tenant, 0.0), head.seq)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    async def _grant(self, waiter: _Waiter) -> _Outcome:
        """Give `waiter` its turn and wait for its report. Its attempt runs in its own task;
        a hung attempt holds the queue, so attempts must carry their own timeouts."""
        if waiter.turn.done():  # its task was cancelled and has not run yet
            self._drop(waiter, "disconnected")
            return _Outcome.CANCELLED
        report: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        waiter.report = report
        waiter.turn.set_result(None)
        try:
            return await report
        finally:
            waiter.report = None

    def _fail_waiters(self, exc: BaseException) -> None:
        """The dispatcher is gone (loop shutdown, or a bug): nobody may wait forever."""
        if not isinstance(exc, asyncio.CancelledError):
            log.exception("queue dispatcher failed (pool %s)", self.pool)
        for waiter in list(self._by_age.values()):
            if waiter.turn.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                waiter.turn.cancel()
            else:
                waiter.turn.set_exception(RuntimeError(f"queue dispatcher failed: {exc!r}"))


def _drop_reason(exc: BaseException) -> DropReason:
    return "disconnected" if isinstance(exc, asyncio.CancelledError) else "error"


def _consume(turn: asyncio.Future[None]) -> None:
    """Marks an exception nobody awaited (cancelled right after expiry) as retrieved."""
    if turn.done() and not turn.cancelled():
        turn.exception()
