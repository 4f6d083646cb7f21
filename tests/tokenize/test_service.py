"""TokenizerService counts off the event loop, caches repeats, and knows its models."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvgate.tokenize import PromptCounter, PromptRenderError, TokenizerService
from kvgate.tokenize.counter import CountPlan
from kvgate.tokenize.service import THREAD_NAME_PREFIX, TokenizerBusy

MSGS = [{"role": "user", "content": "How many tokens is this?"}]
LONG = "How many tokens is this sentence, counted once and then read from the cache? " * 3
LONG_MSGS = [{"role": "user", "content": LONG}]


class SpyCounter(PromptCounter):
    """The real counter, recording on which thread each count was finished."""

    def __init__(self, inner: PromptCounter) -> None:
        self.__dict__.update(inner.__dict__)
        self.threads: list[str] = []
        self.calls = 0

    def finish(self, plan: CountPlan) -> int:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return super().finish(plan)


@pytest.fixture
def spy(counter: PromptCounter) -> SpyCounter:
    return SpyCounter(counter)


@pytest.fixture
def service(spy: SpyCounter) -> Any:
    svc = TokenizerService(max_workers=2, cache_size=8)
    svc.register("demo", spy)
    yield svc
    svc.close()


async def test_runs_off_the_event_loop(service: TokenizerService, spy: SpyCounter) -> None:
    loop_thread = threading.current_thread()
    n = await service.count_chat("demo", LONG_MSGS)
    assert n == spy.count_chat(LONG_MSGS) > 0
    assert spy.threads[0] != loop_thread.name
    assert spy.threads[0].startswith(THREAD_NAME_PREFIX)
    assert await service.count_completion("demo", LONG + "!") == spy.count_completion(LONG + "!")
    assert await service.count_text("demo", LONG) == spy.count_text(LONG)
    assert all(name.startswith(THREAD_NAME_PREFIX) for name in spy.threads[2::2])
    # Nothing left to tokenize (short segments are counted while planning): no worker.
    assert await service.count_completion("demo", "hello world") == 2
    assert spy.threads[-1] == loop_thread.name


async def test_loop_stays_responsive(service: TokenizerService) -> None:
    big = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 20000}]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await service.count_chat("demo", big)
    task.cancel()
    assert ticks > 1  # the loop kept running while the worker tokenized


async def test_segment_cache_hits_on_repeat(
    service: TokenizerService, counter: PromptCounter
) -> None:
    first = await service.count_chat("demo", LONG_MSGS)
    assert service.cache_stats().hits == 0
    second = await service.count_chat("demo", [dict(m) for m in LONG_MSGS])
    assert first == second == counter.count_chat(LONG_MSGS)
    stats = service.cache_stats()
    # The user turn's segment is long enough to be cached; the short ones are counted.
    assert (stats.hits, stats.size) == (1, 1)
    # A parameter that changes the rendered prompt changes the count, not the cached segment.
    without = await service.count_chat("demo", LONG_MSGS, add_generation_prompt=False)
    assert without == counter.count_chat(LONG_MSGS, add_generation_prompt=False) < first
    assert service.cache_stats().hits == 2
    # Generated text is never cached: it would only evict prompts.
    await service.count_text("demo", LONG)
    assert service.cache_stats().size == 1


async def test_history_is_counted_once(counter: PromptCounter) -> None:
    """Each resend of a growing conversation counts only its new turns."""
    svc = TokenizerService(max_workers=1, cache_size=64)
    svc.register("demo", SpyCounter(counter))  # a copy: the shared fixture keeps no cache
    history: list[dict[str, str]] = [
        {"role": "system", "content": "You review code carefully. " * 20}
    ]
    try:
        for turn in range(6):
            if turn:
                history.append({"role": "assistant", "content": f"Answer {turn}. " + "ok " * 40})
            history.append({"role": "user", "content": f"Question {turn}: " + "why? " * 30})
            before = svc.cache_stats()
            assert await svc.count_chat("demo", history) == counter.count_chat(history)
            after = svc.cache_stats()
            # Only the turns added since the last resend are counted; the rest are hits.
            new_segments = 2
            assert after.misses - before.misses == new_segments
            assert after.hits - before.hits == len(history) - new_segments
    finally:
        svc.close()


async def test_cache_is_bounded(service: TokenizerService) -> None:
    for i in range(20):
        await service.count_completion("demo", f"text {i} " + "x" * 80)
    stats = service.cache_stats()
    assert stats.size == stats.capacity == 8


async def test_errors_propagate(service: TokenizerService) -> None:
    with pytest.raises(KeyError):
        await service.count_chat("no-such-model", MSGS)
    with pytest.raises(KeyError):
        await service.count_text("no-such-model", "x")
    with pytest.raises(PromptRenderError):
        await service.count_chat("demo", [{"role": "user", "content": [{"type": "image_url"}]}])
    assert service.models() == ["demo"]


async def test_concurrent_requests(service: TokenizerService, spy: SpyCounter) -> None:
    texts = [f"request number {i} " * (i + 1) for i in range(32)]
    got = await asyncio.gather(*(service.count_completion("demo", t) for t in texts))
    assert got == [spy.count_completion(t) for t in texts]


async def test_closed_service_refuses(spy: SpyCounter) -> None:
    svc = TokenizerService(max_workers=1)
    svc.register("demo", spy)
    assert await svc.count_text("demo", "a") == 1
    svc.close()
    with pytest.raises(RuntimeError):
        await svc.count_text("demo", "a")


# -- fair scheduling between tenants ---------------------------------------------------------


class GatedCounter(PromptCounter):
    """Stands in for a tokenizer so the scheduler is what is tested: each prompt blocks on
    its own gate until the test opens it, and the order in which prompts start is kept."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _gate(self, text: str) -> threading.Event:
        with self._lock:
            return self._gates.setdefault(text, threading.Event())

    def open(self, *texts: str) -> None:
        for text in texts:
            self._gate(text).set()

    def plan_completion(self, prompt: Any, *, add_special_tokens: bool = True) -> CountPlan:
        return CountPlan(0, [(None, prompt)], len(prompt))

    def plan_output(self, text: str) -> CountPlan:
        return self.plan_completion(text)

    def finish(self, plan: CountPlan) -> int:
        [(_, prompt)] = plan.pending
        with self._lock:
            self.started.append(prompt)
        if not self._gate(prompt).wait(10):
            raise TimeoutError(prompt)
        return len(prompt)


async def until(predicate: Any, within_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


@pytest.fixture
def gated() -> GatedCounter:
    return GatedCounter()


def fair_service(gated: GatedCounter, **kwargs: Any) -> TokenizerService:
    svc = TokenizerService(cache_size=0, **{"max_workers": 1, "reserved_workers": 0, **kwargs})
    svc.register("m", gated)
    return svc


def submit(svc: TokenizerService, tenant: str, text: str, cost: int) -> asyncio.Task[int]:
    return asyncio.create_task(svc.count_completion("m", text, tenant=tenant, cost=cost))


async def test_a_backlog_does_not_delay_another_tenant(gated: GatedCounter) -> None:
    svc = fair_service(gated)
    try:
        a1 = submit(svc, "A", "a1", 100)
        await until(lambda: gated.started == ["a1"])
        rest = [submit(svc, "A", "a2", 100), submit(svc, "A", "a3", 100)]
        b1 = submit(svc, "B", "b1", 100)
        await until(lambda: svc.pending("B") == (1, 100))
        gated.open("a1")
        await until(lambda: len(gated.started) == 2)
        # FIFO would run a2 next; B's only job goes first.
        assert gated.started == ["a1", "b1"]
        gated.open("b1", "a2", "a3")
        assert await asyncio.gather(a1, b1, *rest) == [2, 2, 2, 2]
        assert gated.started == ["a1", "b1", "a2", "a3"]
    finally:
        svc.close()


async def test_share_is_weighted_by_cost(gated: GatedCounter) -> None:
    """One 1000-byte job of A is worth ten 100-byte jobs of B (not one: round robin)."""
    svc = fair_service(gated)
    try:
        tasks = [submit(svc, "A", "a0", 1000)]
        await until(lambda: gated.started == ["a0"])
        tasks += [submit(svc, "A", f"a{i}", 1000) for i in (1, 2)]
        tasks += [submit(svc, "B", f"b{i}", 100) for i in range(12)]
        await until(lambda: svc.pending("B")[0] == 12)
        gated.open("a0", "a1", "a2", *(f"b{i}" for i in range(12)))
        await asyncio.gather(*tasks)
        order = gated.started
        # B's tags start at A's running job: b0..b9 fit before a1, a1 before b10.
        assert order[:11] == ["a0", *(f"b{i}" for i in range(10))]
        assert order.index("a1") < order.index("b11")
        assert order.index("a2") == len(order) - 1
    finally:
        svc.close()


async def test_large_jobs_never_take_the_last_worker(gated: GatedCounter) -> None:
    svc = fair_service(gated, max_workers=2, reserved_workers=1, large_job_cost=1000)
    try:
        big = [submit(svc, "A", f"A{i}", 5000) for i in range(3)]
        await until(lambda: gated.started == ["A0"])
        small = submit(svc, "B", "b", 10)
        # A0 still holds its worker and A1, A2 wait: the reserved one serves B at once.
        await until(lambda: "b" in gated.started)
        gated.open("b")
        assert await small == 1
        assert gated.started == ["A0", "b"]
        gated.open("A0", "A1", "A2")
        assert await asyncio.gather(*big) == [2, 2, 2]
    finally:
        svc.close()


async def test_a_lone_tenant_is_not_throttled_by_fair_sharing(gated: GatedCounter) -> None:
    svc = fair_service(gated, max_workers=2, reserved_workers=1, large_job_cost=1000)
    try:
        tasks = [submit(svc, "A", f"s{i}", 10) for i in range(2)]
        # Small jobs may use every worker.
        await until(lambda: sorted(gated.started) == ["s0", "s1"])
        gated.open("s0", "s1")
        await asyncio.gather(*tasks)
    finally:
        svc.close()


async def test_a_cancelled_caller_s_job_is_dropped(gated: GatedCounter) -> None:
    svc = fair_service(gated)
    try:
        running = submit(svc, "A", "running", 10)
        await until(lambda: gated.started == ["running"])
        queued = submit(svc, "A", "queued", 10)
        await until(lambda: svc.pending("A") == (2, 20))
        queued.cancel()
        running.cancel()  # a running job finishes; nobody waits for it
        for task in (queued, running):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert svc.pending("A") == (1, 10)  # the dropped job is gone from the bound too
        gated.open("running", "next")
        assert await svc.count_completion("m", "next", tenant="A") == 4
        assert gated.started == ["running", "next"]  # "queued" never ran
        assert svc.pending("A") == (0, 0)
    finally:
        svc.close()


async def test_the_per_tenant_bound_refuses_with_a_hint(gated: GatedCounter) -> None:
    svc = fair_service(gated, max_jobs_per_tenant=2, max_cost_per_tenant=1000)
    try:
        held = [submit(svc, "A", "a1", 10)]
        await until(lambda: gated.started == ["a1"])
        held.append(submit(svc, "A", "a2", 10))
        await until(lambda: svc.pending("A") == (2, 20))
        with pytest.raises(TokenizerBusy) as info:
            await svc.count_completion("m", "a3", tenant="A", cost=10)
        assert info.value.tenant == "A" and info.value.jobs == 2
        assert info.value.retry_after_s >= 1
        assert "'A'" in str(info.value) and "retry" in str(info.value)
        # Other tenants, unattributed work and unbounded calls are still accepted.
        held.append(submit(svc, "B", "b1", 10))
        held.append(submit(svc, "", "x1", 10))
        held.append(
            asyncio.create_task(svc.count_text("m", "t1", tenant="A"))  # settlement: unbounded
        )
        await until(lambda: svc.pending("B") == (1, 10) and svc.pending("A")[0] == 3)
        gated.open("a1", "a2", "b1", "x1", "t1")
        await asyncio.gather(*held)
        # By bytes: one job alone may be of any size, a backlog may not exceed the bound.
        gated.open("more", "again")
        first = submit(svc, "A", "huge", 5000)
        await until(lambda: gated.started[-1:] == ["huge"])
        second = submit(svc, "A", "more", 1)
        with pytest.raises(TokenizerBusy):
            await second
        # A reload may raise the bound; it applies to the next call.
        svc.resize(max_cost_per_tenant=10_000)
        gated.open("huge")
        assert await asyncio.gather(first, submit(svc, "A", "again", 1)) == [4, 5]
    finally:
        svc.close()


async def test_run_shares_the_workers(service: TokenizerService) -> None:
    name = await service.run("A", lambda: threading.current_thread().name, cost=10)
    assert name.startswith(THREAD_NAME_PREFIX)

    def fail() -> None:
        raise ValueError("bad body")

    with pytest.raises(ValueError, match="bad body"):
        await service.run("A", fail)
    assert service.pending("A") == (0, 0)


async def test_close_fails_queued_work(gated: GatedCounter) -> None:
    svc = fair_service(gated)
    running = submit(svc, "A", "r", 1)
    await until(lambda: gated.started == ["r"])
    queued = submit(svc, "B", "q", 1)
    await until(lambda: svc.pending("B") == (1, 1))
    svc.close(wait=False)  # before "r" ends, so the worker cannot take "q" first
    gated.open("r")
    assert await running == 1
    with pytest.raises(RuntimeError, match="closed"):
        await queued
    assert gated.started == ["r"]


async def test_resize_applies_threads_and_cache(spy: SpyCounter) -> None:
    svc = TokenizerService(max_workers=1, cache_size=8)
    svc.register("demo", spy)
    try:
        for i in range(8):
            await svc.count_completion("demo", f"text {i} " + "x" * 80)
        svc.resize(max_workers=3, cache_size=2)
        assert svc.max_workers == 3
        assert svc.cache_stats().size == svc.cache_stats().capacity == 2
        names = {await svc.run("", lambda: threading.current_thread().name) for _ in range(3)}
        assert all(n.startswith(THREAD_NAME_PREFIX) for n in names)
        svc.resize(max_workers=1)
        assert await svc.count_text("demo", "still counting") == spy.count_text("still counting")
    finally:
        svc.close()


async def test_real_tokenizer_small_count_passes_a_backlog(counter: PromptCounter) -> None:
    """With the demo tokenizer: while tenant A's huge chat prompts hold and queue for the
    workers, tenant B's small prompt is counted, exactly and from the cache on repeat."""
    gate = threading.Event()

    class HeldForA(SpyCounter):
        def finish(self, plan: CountPlan) -> int:
            if any(segment.startswith("user\nA") for _, segment in plan.pending):
                assert gate.wait(10)
            return super().finish(plan)

    held = HeldForA(counter)
    svc = TokenizerService(max_workers=2, cache_size=8)  # the app's default thread count
    svc.register("demo", held)
    words = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB: a large job
    big = [[{"role": "user", "content": f"A{i} {words}"}] for i in range(3)]
    try:
        a_tasks = [asyncio.create_task(svc.count_chat("demo", m, tenant="A")) for m in big]
        await until(lambda: svc.pending("A")[0] == 3)
        n = await asyncio.wait_for(svc.count_chat("demo", LONG_MSGS, tenant="B"), 5)
        assert n == counter.count_chat(LONG_MSGS)
        assert not any(t.done() for t in a_tasks)
        assert await svc.count_chat("demo", LONG_MSGS, tenant="B") == n
        assert svc.cache_stats().hits == 1
        gate.set()
        got = await asyncio.gather(*a_tasks)
        assert got == [counter.count_chat(m) for m in big]
    finally:
        gate.set()
        svc.close()


async def test_small_counts_run_inline(spy: SpyCounter) -> None:
    """Up to inline_max_cost characters left to tokenize, a count runs on the caller's
    thread (no worker round trip); above it, on the fair workers; cached history is not
    tokenized again, so a resent conversation is counted inline."""
    svc = TokenizerService(max_workers=1, inline_max_cost=len(LONG) + 10, cache_size=64)
    svc.register("demo", spy)
    loop_thread = threading.current_thread().name
    history = [{"role": "user", "content": LONG * 3}]
    try:
        assert await svc.count_chat("demo", LONG_MSGS) == spy.count_chat(LONG_MSGS)
        assert spy.threads[0] == loop_thread
        assert await svc.count_chat("demo", history) == spy.count_chat(history)
        assert spy.threads[2].startswith(THREAD_NAME_PREFIX)
        history.append({"role": "assistant", "content": "Short answer."})
        history.append({"role": "user", "content": LONG})
        assert await svc.count_chat("demo", history) == spy.count_chat(history)
        assert spy.threads[4] == loop_thread  # only the new turn was tokenized
        svc.resize(inline_max_cost=0)
        await svc.count_text("demo", LONG)
        assert spy.threads[-1].startswith(THREAD_NAME_PREFIX)
    finally:
        svc.close()
