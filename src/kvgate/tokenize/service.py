"""The async facade the gRPC server uses to count tokens without blocking its loop.

Rendering and tokenizing run on worker threads: both engines release the GIL while they
encode. Counts of prompt segments (the text between added tokens) are kept in one bounded
LRU shared by every model (``segments.SegmentCountCache``), so a conversation's history, a
shared system prompt and retries are counted once.

The workers are shared by every tenant, so they are scheduled fairly instead of FIFO:

* each tenant has its own queue, and the next job is the one with the smallest start tag
  of start-time fair queueing weighted by cost (about the input's bytes): a tenant that
  queued 18 MB of prompts cannot push another tenant's 1 KB count behind all of it;
* a large job (cost >= ``large_job_cost``) never takes the last ``reserved_workers``
  threads, so huge prompts cannot occupy every worker and a small count waits at most for
  another small one (a 6 MB chat prompt holds a worker for seconds);
* a job whose caller was cancelled (client gone, deadline) is dropped before it runs; one
  already running finishes, and its result is discarded;
* one tenant's outstanding work (queued + running) is bounded; past the bound the call
  raises ``TokenizerBusy`` with a retry hint, to be answered with a 429.

A model counted by its engine (``engine_counting``) takes the same scheduling for its
/tokenize calls: each engine URL has a lane of ``max_concurrency`` slots handed out by the
same fair queueing and per-tenant bound; the call itself is made on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kvgate.tokenize.counter import CountingApi, CountPlan
from kvgate.tokenize.engine_counting import EngineCall, EngineCounter, EngineEndpoint
from kvgate.tokenize.segments import CacheStats, SegmentCountCache

THREAD_NAME_PREFIX = "kvgate-tokenize"

T = TypeVar("T")

# Per tenant, queued + running. 32 MiB lets a tenant have a few of the largest bodies Envoy
# buffers in flight, not a backlog that takes minutes to drain.
DEFAULT_MAX_JOBS_PER_TENANT = 64
DEFAULT_MAX_COST_PER_TENANT = 32 * 1024 * 1024
# About 0.1 s of rendering + encoding: above this a job may not take the reserved workers.
DEFAULT_LARGE_JOB_COST = 256 * 1024
DEFAULT_RESERVED_WORKERS = 1
# Cost units (input bytes) one worker gets through per second, until measured: a 6 MB
# chat prompt takes about 2-3 s.
_INITIAL_RATE = 2_000_000.0
# Only jobs this big say something about throughput (small ones are all overhead).
_RATE_SAMPLE_MIN_COST = 64 * 1024
# Bodies up to this size are rendered, cut and looked up in the segment cache on the event
# loop (that is Python holding the GIL: a worker would block the loop for it anyway), so
# only uncached text goes to a worker. Larger ones go to a worker whole, in the tenant's
# fair share, so the GIL is handed back to the loop between its slices.
PLAN_ON_LOOP_MAX_COST = 1024 * 1024
# How much of the input structure the fallback cost estimate walks on the event loop.
_COST_WALK_NODES = 10_000


class TokenizerBusy(Exception):
    """A tenant already has as much tokenizing work outstanding as it may: answer 429.

    ``retry_after_s`` estimates when the tenant's own outstanding work will have drained.
    """

    def __init__(self, tenant: str, jobs: int, cost: int, retry_after_s: float) -> None:
        super().__init__(
            f"tenant '{tenant}' already has {jobs} prompts ({cost} bytes) waiting to be "
            f"tokenized; retry in {retry_after_s:.1f} s"
        )
        self.tenant = tenant
        self.jobs = jobs
        self.cost = cost
        self.retry_after_s = retry_after_s


def approx_cost(*values: Any) -> int:
    """A cheap estimate of an input's size in bytes, for when the caller has no body length.

    Strings count their length, containers their number of items; only the first
    ``_COST_WALK_NODES`` nodes are walked, so this stays cheap on the event loop.
    """
    total = 0
    stack = list(values)
    walked = 0
    while stack:
        item = stack.pop()
        walked += 1
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict | list | tuple):
            total += len(item)
            if walked + len(stack) + len(item) <= _COST_WALK_NODES:
                stack.extend(item.values() if isinstance(item, dict) else item)
        else:
            total += 1
    return max(1, total)


@dataclass(eq=False)
class _Job:
    tenant: str
    cost: int
    tag: float  # start tag: the tenant's virtual start time
    seq: int  # ties go to the earlier submission
    work: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    large: bool
    state: str = "queued"  # queued -> running -> done, or queued -> dropped


@dataclass(eq=False)
class _TenantQueue:
    queue: deque[_Job] = field(default_factory=deque)
    finish: float = 0.0  # virtual finish time of the tenant's last submitted job
    jobs: int = 0  # queued + running
    cost: int = 0


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile: nobody waits for this
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class _FairScheduler:
    """Worker threads that take jobs from per-tenant queues by start-time fair queueing."""

    def __init__(
        self,
        workers: int,
        *,
        max_jobs_per_tenant: int,
        max_cost_per_tenant: int,
        large_job_cost: int,
        reserved_workers: int,
    ) -> None:
        self.max_jobs_per_tenant = max_jobs_per_tenant
        self.max_cost_per_tenant = max_cost_per_tenant
        self.large_job_cost = large_job_cost
        self.reserved_workers = reserved_workers
        self._cond = threading.Condition()
        self._tenants: dict[str, _TenantQueue] = {}
        self._vtime = 0.0
        self._seq = itertools.count()
        self._names = itertools.count()
        self._target = 0
        self._live = 0
        self._large_running = 0
        self._rate = _INITIAL_RATE
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.resize(workers)

    @property
    def workers(self) -> int:
        return self._target

    def resize(self, workers: int) -> None:
        """Grow now; shrink as workers finish their current job."""
        if workers < 1:
            raise ValueError("a tokenizer needs at least one worker thread")
        with self._cond:
            if self._closed:
                return
            self._target = workers
            self._threads = [t for t in self._threads if t.is_alive()]
            while self._live < workers:
                self._live += 1
                thread = threading.Thread(
                    target=self._worker,
                    name=f"{THREAD_NAME_PREFIX}_{next(self._names)}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()

    def pending(self, tenant: str) -> tuple[int, int]:
        """(jobs, cost) the tenant has queued or running."""
        with self._cond:
            state = self._tenants.get(tenant)
            return (state.jobs, state.cost) if state else (0, 0)

    def submit(self, tenant: str, work: Callable[[], Any], cost: int, *, bounded: bool) -> _Job:
        loop = asyncio.get_running_loop()
        cost = max(1, int(cost))
        with self._cond:
            if self._closed:
                raise RuntimeError("TokenizerService is closed")
            state = self._tenants.get(tenant)
            if state is None:
                state = self._tenants[tenant] = _TenantQueue()
            # A tenant with nothing outstanding is always served, however big the job:
            # the bound limits a backlog, not the size of one request.
            if (
                bounded
                and tenant
                and state.jobs > 0
                and (
                    state.jobs >= self.max_jobs_per_tenant
                    or state.cost + cost > self.max_cost_per_tenant
                )
            ):
                raise TokenizerBusy(tenant, state.jobs, state.cost, self._retry_after(state))
            start = max(self._vtime, state.finish)
            state.finish = start + cost
            job = _Job(
                tenant=tenant,
                cost=cost,
                tag=start,
                seq=next(self._seq),
                work=work,
                loop=loop,
                future=loop.create_future(),
                large=cost >= self.large_job_cost,
            )
            state.queue.append(job)
            state.jobs += 1
            state.cost += cost
            self._cond.notify_all()
        return job

    def drop(self, job: _Job) -> None:
        """The caller is gone: a queued job never runs (a running one just finishes)."""
        with self._cond:
            if job.state == "queued":
                self._tenants[job.tenant].queue.remove(job)
                self._retire(job, "dropped")

    def close(self, *, wait: bool) -> None:
        with self._cond:
            self._closed = True
            queued = [job for state in self._tenants.values() for job in state.queue]
            for job in queued:
                self._tenants[job.tenant].queue.remove(job)
                self._retire(job, "dropped")
            self._cond.notify_all()
            threads = list(self._threads)
        for job in queued:
            self._resolve(job, False, RuntimeError("TokenizerService is closed"))
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    # -- worker side (the lock is held where noted) --------------------------------------

    def _retry_after(self, state: _TenantQueue) -> float:
        # Roughly when the tenant's own backlog is through, on one worker.
        return max(1.0, state.cost / self._rate)

    def _retire(self, job: _Job, final: str) -> None:  # lock held
        job.state = final
        state = self._tenants[job.tenant]
        state.jobs -= 1
        state.cost -= job.cost
        if state.jobs == 0:
            del self._tenants[job.tenant]

    def _next(self) -> _Job | None:  # lock held
        large_cap = max(1, self._target - self.reserved_workers)
        best: _Job | None = None
        for state in list(self._tenants.values()):
            queue = state.queue
            while queue and queue[0].future.cancelled():
                # Cancelled before the caller's own clean-up ran: drop it here.
                self._retire(queue.popleft(), "dropped")
            if not queue:
                continue
            head = queue[0]
            if head.large and self._large_running >= large_cap:
                continue
            if best is None or (head.tag, head.seq) < (best.tag, best.seq):
                best = head
        if best is None:
            return None
        self._tenants[best.tenant].queue.popleft()
        best.state = "running"
        self._vtime = max(self._vtime, best.tag)
        if best.large:
            self._large_running += 1
        return best

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed or self._live > self._target:
                        self._live -= 1
                        return
                    job = self._next()
                    if job is not None:
                        break
                    self._cond.wait()
            started = time.perf_counter()
            try:
                value, ok = job.work(), True
            except Exception as exc:  # delivered to the awaiting caller
                value, ok = exc, False
            elapsed = time.perf_counter() - started
            with self._cond:
                if job.large:
                    self._large_running -= 1
                self._retire(job, "done")
                if job.cost >= _RATE_SAMPLE_MIN_COST and elapsed > 0:
                    self._rate = 0.8 * self._rate + 0.2 * (job.cost / elapsed)
                self._cond.notify_all()
            self._resolve(job, ok, value)

    @staticmethod
    def _resolve(job: _Job, ok: bool, value: Any) -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(_settle, job.future, ok, value)


class _EngineLane(_FairScheduler):
    """Calls in flight to one engine's /tokenize: ``slots`` at once, handed out by the
    same start-time fair queueing and per-tenant bound as the workers (a slot is a
    permit, not a thread: the caller makes the call on the event loop).

    It runs on the event loop (but for a resize by a reload's thread); the inherited lock
    is taken uncontended.
    """

    def __init__(self, slots: int, **bounds: Any) -> None:
        self._in_flight = 0
        super().__init__(slots, **bounds)

    def resize(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("an engine lane needs at least one slot")
        with self._cond:
            self._target = workers
        self._grant()

    def submit(self, tenant: str, work: Callable[[], Any], cost: int, *, bounded: bool) -> _Job:
        job = super().submit(tenant, work, cost, bounded=bounded)
        self._grant()
        return job

    def finish(self, job: _Job, elapsed_s: float) -> None:
        """The caller is done with its slot (or gave up waiting for one)."""
        if job.state == "queued":
            self.drop(job)
            return
        with self._cond:
            if job.state != "running":
                return
            if job.large:
                self._large_running -= 1
            self._in_flight -= 1
            self._retire(job, "done")
            if job.cost >= _RATE_SAMPLE_MIN_COST and elapsed_s > 0:
                self._rate = 0.8 * self._rate + 0.2 * (job.cost / elapsed_s)
        self._grant()

    def _grant(self) -> None:
        granted: list[_Job] = []
        with self._cond:
            while not self._closed and self._in_flight < self._target:
                job = self._next()
                if job is None:
                    break
                self._in_flight += 1
                granted.append(job)
        for job in granted:
            if _on_loop(job.loop):
                _settle(job.future, True, None)
            else:  # a reload's thread resized the lane
                self._resolve(job, True, None)


class TokenizerService:
    """Counts tokens for registered models on fairly shared workers, with an LRU in front.

    Every counting call takes the ``tenant`` it works for (fair share and the per-tenant
    bound), an optional ``cost`` (bytes of input; the request body's length is best,
    otherwise it is estimated) and ``bounded`` (False for work that must not be refused,
    like counting a finished answer's output at settlement). A count is planned on the
    loop (bodies up to ``PLAN_ON_LOOP_MAX_COST``): when no more than ``inline_max_cost``
    characters are left to tokenize after the segment cache, they are tokenized there too.
    """

    def __init__(
        self,
        *,
        max_workers: int = 4,
        cache_size: int = 65536,
        max_jobs_per_tenant: int = DEFAULT_MAX_JOBS_PER_TENANT,
        max_cost_per_tenant: int = DEFAULT_MAX_COST_PER_TENANT,
        large_job_cost: int = DEFAULT_LARGE_JOB_COST,
        reserved_workers: int = DEFAULT_RESERVED_WORKERS,
        inline_max_cost: int = 0,
    ) -> None:
        """``inline_max_cost``: characters left to tokenize that are done on the loop."""
        self._counters: dict[str, CountingApi] = {}
        # Models counted by their engine's /tokenize, the one client per URL and key, and
        # the fair lane of calls in flight per URL.
        self._engine_counters: dict[str, EngineCounter] = {}
        self._endpoints: dict[tuple[str, str | None], EngineEndpoint] = {}
        self._lanes: dict[str, _EngineLane] = {}
        self._lane_bounds = {
            "max_jobs_per_tenant": max_jobs_per_tenant,
            "max_cost_per_tenant": max_cost_per_tenant,
            "large_job_cost": large_job_cost,
            "reserved_workers": reserved_workers,
        }
        self.inline_max_cost = inline_max_cost
        self._cache = SegmentCountCache(cache_size)
        self._scheduler = _FairScheduler(
            max_workers,
            max_jobs_per_tenant=max_jobs_per_tenant,
            max_cost_per_tenant=max_cost_per_tenant,
            large_job_cost=large_job_cost,
            reserved_workers=reserved_workers,
        )
        self._closed = False

    # -- registry -----------------------------------------------------------------------

    def register(self, model_name: str, counter: CountingApi | EngineCounter) -> None:
        """The model's counter from now on: local, or its engine's /tokenize."""
        if isinstance(counter, EngineCounter):
            self._register_engine(model_name, counter)
            return
        # Each counter keys its own cache entries: a swapped tokenizer never reads old counts.
        counter.use_cache(self._cache)
        self._engine_counters.pop(model_name, None)
        self._counters[model_name] = counter

    def _register_engine(self, model_name: str, counter: EngineCounter) -> None:
        # One client per URL and key: every model asking that engine reuses its connections.
        counter.endpoint = self._endpoints.setdefault(counter.endpoint.key, counter.endpoint)
        url = counter.endpoint.url
        sharing = [c for n, c in self._engine_counters.items() if n != model_name]
        slots = max(
            [counter.max_concurrency]
            + [c.max_concurrency for c in sharing if c.endpoint.url == url]
        )
        lane = self._lanes.get(url)
        if lane is None:
            self._lanes[url] = _EngineLane(slots, **self._lane_bounds)
        elif lane.workers != slots:
            lane.resize(slots)
        self._counters.pop(model_name, None)
        self._engine_counters[model_name] = counter

    def unregister(self, model_name: str) -> None:
        self._counters.pop(model_name, None)
        self._engine_counters.pop(model_name, None)

    def models(self) -> list[str]:
        return sorted([*self._counters, *self._engine_counters])

    def counter(self, model: str) -> CountingApi:
        """The model's counter; ``KeyError`` if the model is not registered."""
        try:
            return self._counters[model]
        except KeyError:
            raise KeyError(model) from None

    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def engines(self) -> dict[str, str]:
        """Model -> the engine counting its segments (compiled-bpe or reference), or
        engine-tokenize for a model its engine counts."""
        engines = {name: counter.engine for name, counter in self._counters.items()}
        engines.update((name, EngineCounter.engine) for name in self._engine_counters)
        return engines

    @property
    def max_workers(self) -> int:
        return self._scheduler.workers

    def resize(
        self,
        *,
        max_workers: int | None = None,
        cache_size: int | None = None,
        max_jobs_per_tenant: int | None = None,
        max_cost_per_tenant: int | None = None,
        inline_max_cost: int | None = None,
    ) -> None:
        """Apply new sizes on a config reload; work already accepted is not affected."""
        if inline_max_cost is not None:
            self.inline_max_cost = inline_max_cost
        if max_workers is not None:
            self._scheduler.resize(max_workers)
        if cache_size is not None:
            self._cache.resize(cache_size)
        for scheduler in (self._scheduler, *self._lanes.values()):
            if max_jobs_per_tenant is not None:
                scheduler.max_jobs_per_tenant = max_jobs_per_tenant
            if max_cost_per_tenant is not None:
                scheduler.max_cost_per_tenant = max_cost_per_tenant
        if max_jobs_per_tenant is not None:
            self._lane_bounds["max_jobs_per_tenant"] = max_jobs_per_tenant
        if max_cost_per_tenant is not None:
            self._lane_bounds["max_cost_per_tenant"] = max_cost_per_tenant

    def pending(self, tenant: str) -> tuple[int, int]:
        """(jobs, cost) of the tenant's work that is queued or running."""
        return self._scheduler.pending(tenant)

    # -- async counting API -------------------------------------------------------------

    async def count_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tenant: str = "",
        cost: int | None = None,
        bounded: bool = True,
        response_format: Any = None,
        tool_choice: Any = None,
    ) -> int:
        """Prompt tokens of a chat request. ``response_format`` is the request's, which only
        a model counted by its engine can take into account (vLLM's renderers read it);
        ``tool_choice`` too, for an engine that leaves tools out when it is "none"."""
        if cost is None:
            cost = approx_cost(messages, tools)
        engine = self._engine_counters.get(model)
        flags = engine.engine_flags if engine is not None else self.counter(model).engine_flags
        tools = flags.tools_for(tools, tool_choice)
        chat_template_kwargs = flags.template_kwargs(chat_template_kwargs)
        if engine is not None:
            call = engine.chat_call(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
                response_format=response_format,
            )
            return await self._ask_engine(tenant, cost, bounded, engine, call)
        counter = self.counter(model)

        def plan() -> CountPlan:
            return counter.plan_chat(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
            )

        return await self._count(tenant, cost, bounded, counter, plan)

    async def count_completion(
        self,
        model: str,
        prompt: str | list[int] | list[str] | list[list[int]],
        *,
        tenant: str = "",
        cost: int | None = None,
        bounded: bool = True,
    ) -> int:
        """Prompt tokens of a completions request; a batch counts as the sum."""
        if cost is None:
            cost = approx_cost(prompt)
        engine = self._engine_counters.get(model)
        if engine is not None:
            known, calls = engine.completion_calls(prompt)
            share = max(1, cost // max(1, len(calls)))
            for call in calls:
                known += await self._ask_engine(tenant, share, bounded, engine, call)
            return known
        counter = self.counter(model)
        return await self._count(
            tenant, cost, bounded, counter, lambda: counter.plan_completion(prompt)
        )

    async def count_text(
        self,
        model: str,
        text: str,
        *,
        tenant: str = "",
        cost: int | None = None,
        bounded: bool = False,
    ) -> int:
        """Tokens of generated text. Not bounded by default: settlement must not be refused."""
        if cost is None:
            cost = approx_cost(text)
        engine = self._engine_counters.get(model)
        if engine is not None:
            # The text as a completion prompt without special tokens: the output's tokens.
            call = engine.text_call(text, add_special_tokens=False)
            return await self._ask_engine(tenant, cost, bounded, engine, call)
        counter = self.counter(model)
        return await self._count(tenant, cost, bounded, counter, lambda: counter.plan_output(text))

    async def _count(
        self,
        tenant: str,
        cost: int,
        bounded: bool,
        counter: CountingApi,
        plan: Callable[[], CountPlan],
    ) -> int:
        """Plan on the loop (render, cut, cache lookups), tokenize what is left on a worker
        unless it is small; a body too large to even plan on the loop goes whole."""
        if self._closed:
            raise RuntimeError("TokenizerService is closed")
        if cost > PLAN_ON_LOOP_MAX_COST:
            return await self._submit(tenant, lambda: counter.finish(plan()), cost, bounded)
        counted = plan()
        if counted.pending_chars <= self.inline_max_cost:
            # Cached history and small prompts: about a tenth of a millisecond, less than
            # a round trip through a worker.
            return counter.finish(counted)
        return await self._submit(tenant, lambda: counter.finish(counted), cost, bounded)

    async def _ask_engine(
        self, tenant: str, cost: int, bounded: bool, engine: EngineCounter, call: EngineCall
    ) -> int:
        """One count by the engine: from the cache, or a call made in the tenant's fair
        share of the engine's slots, all within the counter's deadline.

        Raises ``TokenizerBusy`` past the tenant's bound, ``EngineCountUnavailable`` when
        the engine cannot answer in time, ``PromptRenderError`` when it refuses the prompt.
        """
        if self._closed:
            raise RuntimeError("TokenizerService is closed")
        if call.cache_key is not None:
            cached = engine.cache.get(call.cache_key)
            if cached is not None:
                return cached
        lane = self._lanes[engine.endpoint.url]
        job = lane.submit(tenant, _no_work, cost, bounded=bounded)
        started = 0.0
        try:
            async with asyncio.timeout(engine.timeout_s):
                await job.future  # a slot
                started = time.perf_counter()
                return await engine.send(call)
        except TimeoutError:
            where = "waiting for a free connection" if not started else "the engine did not answer"
            raise engine.unavailable(f"no count within {engine.timeout_s:g} s ({where})") from None
        finally:
            lane.finish(job, time.perf_counter() - started if started else 0.0)

    async def close_engines(self) -> None:
        """Close the engines' HTTP clients (after ``close``)."""
        for endpoint in list(self._endpoints.values()):
            await endpoint.close()

    async def run(
        self, tenant: str, work: Callable[[], T], *, cost: int = 1, bounded: bool = True
    ) -> T:
        """Run ``work`` on a worker under the same fairness and bound (e.g. parsing a body).

        Raises ``TokenizerBusy`` past the tenant's bound and ``RuntimeError`` once closed;
        ``work``'s own exception propagates. If the caller is cancelled first, ``work``
        never runs.
        """
        return await self._submit(tenant, work, cost, bounded)

    async def _submit(self, tenant: str, work: Callable[[], T], cost: int, bounded: bool) -> T:
        if self._closed:
            raise RuntimeError("TokenizerService is closed")
        job = self._scheduler.submit(tenant, work, cost, bounded=bounded)
        try:
            return cast(T, await job.future)
        except asyncio.CancelledError:
            self._scheduler.drop(job)
            raise

    def close(self, *, wait: bool = True) -> None:
        """Stop the workers; queued jobs fail with RuntimeError, running ones finish."""
        self._closed = True
        self._scheduler.close(wait=wait)
        for lane in self._lanes.values():
            lane.close(wait=False)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _no_work() -> None:
    """An engine lane's job is a slot: the caller makes the call itself."""
