"""A GPU-like KV-cache and scheduler model.

Capacity is ``num_gpu_blocks`` blocks of ``block_size`` tokens. A running request
holds ``ceil((prompt + generated) / block_size)`` blocks, growing as it generates.
Scheduling follows vLLM v1's FCFS policy in miniature:

* waiting requests are admitted strictly in order while the head's blocks fit (and
  fewer than ``max_num_seqs`` run);
* when a running request needs one more block and none is free, the youngest running
  request is preempted (recompute style): its blocks are freed, it goes back to the
  front of the queue, and when re-admitted it re-prefills prompt + tokens so far.

With automatic prefix caching (vLLM v1's ``--enable-prefix-caching``), every full
block of a request's tokens gets a hash chained from its parent block's hash and its
token ids. A request being admitted takes the longest run of leading blocks whose
hashes are cached, sharing them (reference counted, charged once) instead of
allocating; at least its last token is always recomputed. Freed blocks keep their
hashes and count as free: they are evicted, least recently freed first and a
request's tail before its head, only when an allocation takes them.

Each request paces itself (TTFT for every prefill, plus a cost per uncached token;
ITL between tokens) instead of a global step loop, so per-request latency overrides
are trivial.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    """One sequence in the engine.

    ``prompt_ids`` (and ``output_id``, the id of the i-th generated token) let the
    prefix cache hash the request's blocks; without them the request neither hits
    nor fills the cache.
    """

    request_id: str
    prompt_tokens: int
    target_tokens: int
    finish_reason: str
    endpoint: str = "chat"
    stream: bool = False
    max_tokens: int | None = None
    prompt_ids: Sequence[int] | None = None
    output_id: Callable[[int], int] | None = None
    # vLLM mixes a request's cache_salt into its first block's hash.
    cache_salt: str | None = None
    # False for requests with prompt logprobs: vLLM computes their whole prompt.
    prefix_lookup: bool = True
    state: SeqState = SeqState.WAITING
    generated: int = 0
    sent: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hashes of the request's full blocks computed so far (a chain: i-th covers
    # tokens [0, (i + 1) * block_size)).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # How many of block_ids are registered in the prefix cache.
    cached_blocks: int = 0
    # Prefix-cache hit at the first admission (vLLM's num_cached_tokens); -1 before.
    num_cached_tokens: int = -1
    # Tokens the latest admission has to compute (prompt + generated - hit).
    prefill_tokens: int = 0
    preemptions: int = 0
    needs_prefill: bool = True
    # Bumped at every admission, so a step that slept across a preempt+readmit
    # notices it must prefill again.
    epoch: int = 0
    # Engine-wide order of first admission and of retirement (which choice's
    # cached-token count a response reports follows vLLM's output order).
    admit_order: int = -1
    finish_order: int = -1
    aborted: bool = False
    final_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    _admitted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def blocks(self) -> int:
        return len(self.block_ids)

    @property
    def cached_tokens(self) -> int:
        return max(self.num_cached_tokens, 0)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "max_tokens": self.max_tokens,
            "target_tokens": self.target_tokens,
            "completion_tokens_generated": self.generated,
            "completion_tokens_sent": self.sent,
            "finished": self.state is SeqState.FINISHED and not self.aborted,
            "aborted": self.aborted,
            "finish_reason": self.final_reason,
            "preemptions": self.preemptions,
        }


class BlockPool:
    """vLLM v1's block pool in miniature: reference-counted blocks, the free queue
    in eviction order, and the prefix cache's hash -> block map.

    vLLM's free queue starts as every block in id order and freed blocks join its
    tail, so never-used blocks are always handed out first; ``_fresh`` stands for
    them instead of queueing every id.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_used = 0
        # Sum over blocks in use of (references - 1): block references that share.
        self.shared = 0
        # Cached blocks no request holds: free, but still hits until evicted.
        self.num_evictable = 0
        self.evictions = 0
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        # Several blocks may hold the same content (a full hit recomputes its last
        # block); lookups take the first one cached, as vLLM does.
        self._by_hash: dict[int, dict[int, None]] = {}

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0

    def allocate(self) -> int:
        """Take the free queue's head (the caller checked :attr:`num_free`)."""
        if self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
        else:
            block, _ = self._free.popitem(last=False)
            if block in self._hash_of:
                self._uncache(block)
                self.num_evictable -= 1
                self.evictions += 1
        self._refs[block] = 1
        self.num_used += 1
        return block

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cache hits (out of the free queue if unheld)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
                self.num_used += 1
                self.num_evictable -= 1
            else:
                self.shared += 1
            self._refs[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        # Tail first, as vLLM: a request's last blocks are evicted before the
        # prefix other requests are likelier to share.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                self.shared -= 1
                continue
            self.num_used -= 1
            self._free[block] = None
            if block in self._hash_of:
                self.num_evictable += 1

    def cache(self, block: int, block_hash: int) -> None:
        self._hash_of[block] = block_hash
        self._by_hash.setdefault(block_hash, {})[block] = None

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """Blocks of the longest cached run of leading hashes."""
        hit: list[int] = []
        for block_hash in hashes:
            holders = self._by_hash.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        holders = self._by_hash[block_hash]
        del holders[block]
        if not holders:
            del self._by_hash[block_hash]

    def clear_cache(self) -> None:
        """Forget every cached block no request holds (blocks in use keep their
        hashes: vLLM refuses a reset while any are in use)."""
        for block in [b for b in self._hash_of if self._refs[b] == 0]:
            self._uncache(block)
        self.num_evictable = 0


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
    # vLLM's prefix-cache stats, in tokens: looked up at an admission, and found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineListener:
    """Hooks the metrics layer implements; all no-ops here."""

    def on_preemption(self) -> None: ...

    def on_prompt_tokens(self, n: int) -> None: ...

    def on_generation_token(self) -> None: ...

    def on_request_done(self, reason: str) -> None: ...

    def on_prefix_cache_lookup(self, queries: int, hits: int) -> None: ...


class KVEngine:
    def __init__(
        self,
        *,
        num_gpu_blocks: int,
        block_size: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = False,
        served_history: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self._clock = clock
        self.pool = BlockPool(num_gpu_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        # Tokens of the running requests, shared blocks counted once per holder
        # (kept incrementally: hot path).
        self._held_tokens = 0
        self._admissions = 0
        self._retirements = 0
        self.stats = EngineStats()
        self._evictions_at_reset = 0
        # Kept as live objects so a summary shows tokens sent after the engine
        # finished (the HTTP layer may still be writing them).
        self.served: deque[SimRequest] = deque(maxlen=served_history)
        self.listener: EngineListener = EngineListener()

    # --- accounting --------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def free_blocks(self) -> int:
        """Blocks no running request holds (evictable cached blocks included, as in
        vLLM's usage figure)."""
        return self.pool.num_free

    @property
    def kv_tokens_used(self) -> int:
        """Tokens whose KV the running requests hold, a shared block counted once."""
        return self._held_tokens - self.pool.shared * self.block_size

    @property
    def kv_usage(self) -> float:
        return self.pool.num_used / self.num_gpu_blocks

    def _note_peaks(self) -> None:
        # Why: the invariant the whole simulator exists to check.
        assert 0 <= self.pool.num_used <= self.num_gpu_blocks, self.pool.num_used
        s = self.stats
        s.peak_blocks_used = max(s.peak_blocks_used, self.pool.num_used)
        s.peak_kv_tokens_used = max(s.peak_kv_tokens_used, self.kv_tokens_used)
        s.peak_running = max(s.peak_running, len(self.running))

    def _release(self, req: SimRequest) -> None:
        self.pool.free(req.block_ids)
        self._held_tokens -= req.num_tokens
        req.block_ids = []
        req.cached_blocks = 0

    # --- prefix cache ------------------------------------------------------------

    def _hash_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Extend ``req.block_hashes`` over the full blocks of its first
        ``num_tokens`` tokens (as far as its token ids are known)."""
        prompt = req.prompt_ids
        if prompt is None:
            return
        known = req.num_tokens if req.output_id is not None else len(prompt)
        full = min(num_tokens, known) // self.block_size
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < full:
            i = len(hashes)
            start, end = i * bs, (i + 1) * bs
            if end <= len(prompt):
                ids = tuple(prompt[start:end])
            else:
                assert req.output_id is not None
                n_prompt = len(prompt)
                ids = tuple(
                    prompt[p] if p < n_prompt else req.output_id(p - n_prompt)
                    for p in range(start, end)
                )
            # Why chained: a block's KV depends on every token before it, so equal
            # hashes mean equal prefixes (Python's tuple hash: vLLM's "builtin").
            parent = hashes[-1] if i else None
            salt = req.cache_salt if i == 0 else None
            hashes.append(hash((parent, ids, salt)))

    def _lookup(self, req: SimRequest) -> list[int]:
        if not (self.enable_prefix_caching and req.prefix_lookup and req.prompt_ids):
            return []
        # vLLM never serves the whole sequence from cache: the last token is
        # computed again to get logits, so a full hit recomputes the last block.
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._hash_blocks(req, max_blocks * self.block_size)
        return self.pool.lookup(req.block_hashes[:max_blocks])

    def _cache_computed(self, req: SimRequest, num_tokens: int) -> None:
        """Register the request's blocks filled by its first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching or req.prompt_ids is None:
            return
        self._hash_blocks(req, num_tokens)
        full = min(num_tokens // self.block_size, len(req.block_ids), len(req.block_hashes))
        for i in range(req.cached_blocks, full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        req.cached_blocks = max(req.cached_blocks, full)

    def reset_prefix_cache(self) -> None:
        self.pool.clear_cache()

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
        pool = self.pool
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            hit = self._lookup(head)
            new = self.blocks_for(head.num_tokens) - len(hit)
            # A hit on an unheld cached block takes it off the free list too.
            if new + sum(pool.is_free(b) for b in hit) > pool.num_free:
                break
            self.waiting.popleft()
            pool.touch(hit)
            head.block_ids = hit + [pool.allocate() for _ in range(new)]
            head.cached_blocks = len(hit)
            hit_tokens = len(hit) * self.block_size
            if self.enable_prefix_caching and head.prefix_lookup and head.prompt_ids:
                # vLLM counts every lookup, a re-admission after preemption too.
                self.stats.prefix_cache_queries += head.num_tokens
                self.stats.prefix_cache_hits += hit_tokens
                self.listener.on_prefix_cache_lookup(head.num_tokens, hit_tokens)
            if head.num_cached_tokens < 0:
                head.num_cached_tokens = hit_tokens
                head.admit_order = self._admissions
                self._admissions += 1
            head.prefill_tokens = head.num_tokens - hit_tokens
            self._held_tokens += head.num_tokens
            # vLLM caches a prefill's full blocks when it schedules it, so a request
            # admitted right after (n > 1, concurrent twins) already shares them.
            self._cache_computed(head, head.num_tokens)
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
        while len(req.block_ids) < need:
            if self.pool.num_free > 0:
                req.block_ids.append(self.pool.allocate())
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    async def _wait_admitted(self, req: SimRequest) -> None:
        while req.state is not SeqState.RUNNING:
            await req._admitted.wait()

    async def generate(
        self,
        req: SimRequest,
        *,
        ttft_s: float,
        itl_s: float,
        prefill_s_per_token: float = 0.0,
    ) -> AsyncIterator[int]:
        """Yield the index of each token as it is produced; the caller writes it.

        A prefill takes ``ttft_s`` plus ``prefill_s_per_token`` for every token the
        admission did not find in the prefix cache. The caller must end every
        request with :meth:`finish` or :meth:`abort`.
        """
        while req.generated < req.target_tokens:
            await self._wait_admitted(req)
            epoch = req.epoch
            if req.needs_prefill:
                delay = ttft_s + prefill_s_per_token * req.prefill_tokens
            else:
                delay = itl_s
            await asyncio.sleep(delay)
            if req.state is not SeqState.RUNNING or req.epoch != epoch:
                continue  # preempted while computing; (re-)prefill first
            preemptions_before = self.stats.preemptions
            if not self._grow(req):
                continue
            # This step computed the token sampled last (vLLM caches a block once
            # the tokens fed to the model fill it; the newest sample is not fed yet).
            if self.enable_prefix_caching and req.num_tokens // self.block_size > req.cached_blocks:
                self._cache_computed(req, req.num_tokens)
            req.needs_prefill = False
            if req.generated == 0:
                # vLLM counts a request's prompt once, when its first token appears
                # (a recompute after preemption is not counted again).
                req.first_token_at = self._clock()
                self.stats.prompt_tokens_total += req.prompt_tokens
                self.listener.on_prompt_tokens(req.prompt_tokens)
            req.generated += 1
            self._held_tokens += 1
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
        req.finish_order = self._retirements
        self._retirements += 1
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
        self._evictions_at_reset = self.pool.evictions
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
            "kv_blocks_used": self.pool.num_used,
            "kv_tokens_used": self.kv_tokens_used,
            "kv_blocks_total": self.num_gpu_blocks,
            "block_size": self.block_size,
            "kv_cache_usage": self.kv_usage,
            "requests_total": s.requests_total,
            "finished_total": s.finished_total,
            "aborted_total": s.aborted_total,
            "prompt_tokens_total": s.prompt_tokens_total,
            "completion_tokens_total": s.completion_tokens_total,
            "prefix_caching": self.enable_prefix_caching,
            "prefix_cache_queries_total": s.prefix_cache_queries,
            "prefix_cache_hits_total": s.prefix_cache_hits,
            "prefix_cache_evictions_total": self.pool.evictions - self._evictions_at_reset,
            "prefix_cache_blocks": self.pool.num_cached,
            "prefix_cache_evictable_blocks": self.pool.num_evictable,
            "kv_blocks_shared": self.pool.shared,
            "served": [r.summary() for r in self.served],
        }
