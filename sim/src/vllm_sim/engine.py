"""A GPU-like KV-cache and scheduler model.

Capacity is ``num_gpu_blocks`` blocks of ``block_size`` tokens. A running request
holds ``ceil((prompt + generated) / block_size)`` blocks, growing as it generates.
Scheduling follows vLLM v1's FCFS policy in miniature:

* waiting requests are admitted strictly in order while the head's blocks fit (and
  fewer than ``max_num_seqs`` run);
* when a running request needs one more block and none is free, the youngest running
  request is preempted (recompute style): its blocks are freed, it goes back to the
  front of the queue, and when re-admitted it re-prefills prompt + tokens so far.

Each request paces itself (TTFT for every prefill, ITL between tokens) instead of a
global step loop, so per-request latency overrides are trivial.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    """One sequence in the engine."""

    request_id: str
    prompt_tokens: int
    target_tokens: int
    finish_reason: str
    endpoint: str = "chat"
    stream: bool = False
    max_tokens: int | None = None
    state: SeqState = SeqState.WAITING
    generated: int = 0
    sent: int = 0
    blocks: int = 0
    preemptions: int = 0
    needs_prefill: bool = True
    # Bumped at every admission, so a step that slept across a preempt+readmit
    # notices it must prefill again.
    epoch: int = 0
    aborted: bool = False
    final_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    _admitted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "target_tokens": self.target_tokens,
            "completion_tokens_generated": self.generated,
            "completion_tokens_sent": self.sent,
            "finished": self.state is SeqState.FINISHED and not self.aborted,
            "aborted": self.aborted,
            "finish_reason": self.final_reason,
            "preemptions": self.preemptions,
        }


@dataclass
class EngineStats:
    """Exact counters since start (or the last reset), for tests."""

    preemptions: int = 0
    peak_kv_tokens_used: int = 0
    peak_blocks_used: int = 0
    peak_running: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    finished_total: int = 0
    aborted_total: int = 0


class EngineListener:
    """Hooks the metrics layer implements; all no-ops here."""

    def on_preemption(self) -> None: ...

    def on_prompt_tokens(self, n: int) -> None: ...

    def on_generation_token(self) -> None: ...

    def on_request_done(self, reason: str) -> None: ...


class KVEngine:
    def __init__(
        self,
        *,
        num_gpu_blocks: int,
        block_size: int,
        max_num_seqs: int,
        served_history: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self._clock = clock
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.used_blocks = 0
        # Tokens whose KV the running requests hold (kept incrementally: hot path).
        self.kv_tokens_used = 0
        self.stats = EngineStats()
        # Kept as live objects so a summary shows tokens sent after the engine
        # finished (the HTTP layer may still be writing them).
        self.served: deque[SimRequest] = deque(maxlen=served_history)
        self.listener: EngineListener = EngineListener()

    # --- accounting --------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return self.num_gpu_blocks - self.used_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.num_gpu_blocks

    def _note_peaks(self) -> None:
        # Why: the invariant the whole simulator exists to check.
        assert 0 <= self.used_blocks <= self.num_gpu_blocks, self.used_blocks
        s = self.stats
        s.peak_blocks_used = max(s.peak_blocks_used, self.used_blocks)
        s.peak_kv_tokens_used = max(s.peak_kv_tokens_used, self.kv_tokens_used)
        s.peak_running = max(s.peak_running, len(self.running))

    def _release(self, req: SimRequest) -> None:
        self.used_blocks -= req.blocks
        self.kv_tokens_used -= req.num_tokens
        req.blocks = 0

    # --- scheduling --------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        # A sequence that cannot fit the whole cache alone could never finish (and
        # would preempt itself forever); the server's context clamp rules it out.
        if self.blocks_for(req.prompt_tokens + req.target_tokens) > self.num_gpu_blocks:
            raise ValueError(
                f"request needs {req.prompt_tokens + req.target_tokens} tokens of KV, "
                f"more than the cache's {self.num_gpu_blocks * self.block_size}"
            )
        self.stats.requests_total += 1
        self.waiting.append(req)
        self._schedule()

    def _schedule(self) -> None:
        """Admit waiting requests in FIFO order while the head fits."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            need = self.blocks_for(head.num_tokens)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            head.blocks = need
            self.used_blocks += need
            self.kv_tokens_used += head.num_tokens
            head.state = SeqState.RUNNING
            head.needs_prefill = True
            head.epoch += 1
            self.running.append(head)
            head._admitted.set()
        self._note_peaks()

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.state = SeqState.WAITING
        victim.preemptions += 1
        victim._admitted.clear()
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        self.listener.on_preemption()

    def _grow(self, req: SimRequest) -> bool:
        """Reserve KV for one more token of ``req``; False if ``req`` itself got
        preempted to make room (it then waits to be re-admitted)."""
        need = self.blocks_for(req.num_tokens + 1)
        while req.blocks < need:
            if self.free_blocks > 0:
                req.blocks += 1
                self.used_blocks += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    async def _wait_admitted(self, req: SimRequest) -> None:
        while req.state is not SeqState.RUNNING:
            await req._admitted.wait()

    async def generate(self, req: SimRequest, *, ttft_s: float, itl_s: float) -> AsyncIterator[int]:
        """Yield the index of each token as it is produced; the caller writes it.

        The caller must end every request with :meth:`finish` or :meth:`abort`.
        """
        while req.generated < req.target_tokens:
            await self._wait_admitted(req)
            epoch = req.epoch
            await asyncio.sleep(ttft_s if req.needs_prefill else itl_s)
            if req.state is not SeqState.RUNNING or req.epoch != epoch:
                continue  # preempted while computing; (re-)prefill first
            preemptions_before = self.stats.preemptions
            if not self._grow(req):
                continue
            req.needs_prefill = False
            if req.generated == 0:
                # vLLM counts a request's prompt once, when its first token appears
                # (a recompute after preemption is not counted again).
                req.first_token_at = self._clock()
                self.stats.prompt_tokens_total += req.prompt_tokens
                self.listener.on_prompt_tokens(req.prompt_tokens)
            req.generated += 1
            self.kv_tokens_used += 1
            self.stats.completion_tokens_total += 1
            self.listener.on_generation_token()
            self._note_peaks()
            # A step that preempted nobody may pull waiting requests in, as vLLM
            # schedules the waiting queue after the running batch (and not at all in
            # a step that had to preempt).
            if self.waiting and self.stats.preemptions == preemptions_before:
                self._schedule()
            yield req.generated - 1

    def _retire(self, req: SimRequest, reason: str, *, aborted: bool) -> None:
        if req.state is SeqState.FINISHED:
            return
        if req.state is SeqState.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.state = SeqState.FINISHED
        req.aborted = aborted
        req.final_reason = reason
        req.finished_at = self._clock()
        if aborted:
            self.stats.aborted_total += 1
        else:
            self.stats.finished_total += 1
        self.listener.on_request_done(reason)
        self.served.append(req)
        self._schedule()

    def finish(self, req: SimRequest) -> None:
        self._retire(req, req.finish_reason, aborted=False)

    def abort(self, req: SimRequest) -> None:
        self._retire(req, "abort", aborted=True)

    # --- introspection -----------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = EngineStats()
        self.served.clear()
        self._note_peaks()

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "preemptions": s.preemptions,
            "peak_kv_tokens_used": s.peak_kv_tokens_used,
            "peak_blocks_used": s.peak_blocks_used,
            "peak_running": s.peak_running,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": self.used_blocks,
            "kv_tokens_used": self.kv_tokens_used,
            "kv_blocks_total": self.num_gpu_blocks,
            "block_size": self.block_size,
            "kv_cache_usage": self.kv_usage,
            "requests_total": s.requests_total,
            "finished_total": s.finished_total,
            "aborted_total": s.aborted_total,
            "prompt_tokens_total": s.prompt_tokens_total,
            "completion_tokens_total": s.completion_tokens_total,
            "served": [r.summary() for r in self.served],
        }
