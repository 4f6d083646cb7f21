"""The semantic cache's index: stored questions as vectors, searched by cosine similarity.

Entries are grouped by *context*: the hash of everything in a request except the last user
turn (tenant or model scope, model, system prompt and history, every parameter). Only
questions asked in the same context are ever compared, so the vector search runs over one
small bucket (bounded by `max_entries_per_context`) with one matrix product.

Where the entries live is an `EntryLog`:

* `MemoryEntryLog`: this process only.
* `RedisEntryLog`: shared by the replicas. Redis 7 has no vector search, so it only keeps
  the entries, one stream per context (`XADD ... MAXLEN ~ N`, the key expiring with the
  entries' TTL); each replica searches its own mirror of the contexts it has seen and brings
  it up to date before every search with one `XRANGE key (last-seen-id +`: only entries
  newer than the last it read travel, usually none.

`SemanticIndex` is the mirror: contexts in LRU order, bounded in bytes; each bucket keeps
its cursor in the log and its matrix of vectors. Every search mirrors its context, so a
context that never got an entry (a tenant asking in ever new contexts, all misses) costs
`CONTEXT_OVERHEAD_BYTES` too; such empty contexts are evicted first, oldest first, so a flood
of them never pushes out a context with entries.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from kvgate.cache.semantic_guard import refusal_reason

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    """One answered question: where its answer is stored, and when it stops counting."""

    answer_key: str
    question: str
    vector: Vector
    expires_at: float  # wall clock (time.time()): comparable across replicas


# What one context costs besides its entries, about: its key (a 64-character hex digest) in
# the LRU and as the log's key, the bucket or list object, its cursor and the dict slots.
CONTEXT_OVERHEAD_BYTES = 512


def entry_bytes(entry: SemanticEntry) -> int:
    """What an entry holds in memory, about: its vector twice (the entry's and its row in
    the bucket's matrix), the question's UTF-8 and the objects around them."""
    return 2 * entry.vector.nbytes + len(entry.question.encode()) + len(entry.answer_key) + 200


@dataclass(frozen=True, slots=True)
class Candidate:
    similarity: float
    entry: SemanticEntry


class EntryLog(Protocol):
    async def append(
        self, context: str, entry: SemanticEntry, ttl_s: float, max_entries: int
    ) -> None: ...

    async def read_since(
        self, context: str, cursor: str | None
    ) -> tuple[str | None, list[SemanticEntry]]:
        """The context's entries after `cursor` (all when None), and the new cursor."""
        ...

    async def close(self) -> None: ...


class MemoryEntryLog:
    """One process's entries, bounded per context and in bytes over all contexts, each
    context's overhead included (the least recently written context dropped first)."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self._max_bytes = max_bytes
        self._clock = clock
        self._next_id = 0
        # context -> [(sequence number, entry)], oldest first
        self._contexts: OrderedDict[str, list[tuple[int, SemanticEntry]]] = OrderedDict()
        self._bytes = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def contexts(self) -> int:
        return len(self._contexts)

    async def append(
        self, context: str, entry: SemanticEntry, ttl_s: float, max_entries: int
    ) -> None:
        self._next_id += 1
        entries = self._contexts.pop(context, None)
        if entries is None:
            entries = []
        else:
            self._bytes -= _context_bytes(item for _, item in entries)
        entries.append((self._next_id, entry))
        now = self._clock()
        entries = [item for item in entries[-max_entries:] if item[1].expires_at > now]
        if entries:  # a context whose entries all expired is not kept
            self._contexts[context] = entries
            self._bytes += _context_bytes(item for _, item in entries)
        while self._bytes > self._max_bytes and len(self._contexts) > 1:
            _, dropped = self._contexts.popitem(last=False)
            self._bytes -= _context_bytes(item for _, item in dropped)

    async def read_since(
        self, context: str, cursor: str | None
    ) -> tuple[str | None, list[SemanticEntry]]:
        entries = self._contexts.get(context, [])
        after = int(cursor) if cursor is not None else 0
        fresh = [entry for seq, entry in entries if seq > after]
        last = str(entries[-1][0]) if entries else cursor
        return last, fresh

    async def close(self) -> None:
        self._contexts.clear()
        self._bytes = 0


class RedisEntryLog:
    """Entries shared by every replica: one Redis stream per context."""

    # An XRANGE returns at most this many entries; a mirror far behind catches up over
    # several searches.
    READ_BATCH = 512

    def __init__(
        self, client: aioredis.Redis | RedisCluster, key_tag: str, timeout_s: float
    ) -> None:
        self._client = client
        self._prefix = f"{key_tag}:sem|"
        self._timeout_s = timeout_s

    async def append(
        self, context: str, entry: SemanticEntry, ttl_s: float, max_entries: int
    ) -> None:
        key = self._prefix + context
        fields = {
            "a": entry.answer_key,
            "q": entry.question,
            "v": base64.b64encode(np.asarray(entry.vector, dtype="<f4").tobytes()),
            "e": repr(entry.expires_at),
        }
        async with asyncio.timeout(self._timeout_s):
            pipe = self._client.pipeline(transaction=False)
            pipe.xadd(key, fields, maxlen=max_entries, approximate=True)  # type: ignore[arg-type]
            pipe.pexpire(key, max(1, round(ttl_s * 1000)))
            await pipe.execute()

    async def read_since(
        self, context: str, cursor: str | None
    ) -> tuple[str | None, list[SemanticEntry]]:
        start = "-" if cursor is None else f"({cursor}"
        async with asyncio.timeout(self._timeout_s):
            rows = await self._client.xrange(
                self._prefix + context, min=start, max="+", count=self.READ_BATCH
            )
        entries: list[SemanticEntry] = []
        last = cursor
        # The client's types allow None for other stream commands; XRANGE always answers a
        # list (empty when nothing is newer) of entries with their fields.
        assert rows is not None
        for entry_id, fields in rows:
            assert fields is not None
            last = _text(entry_id)
            entry = _decode(fields)
            if entry is not None:
                entries.append(entry)
        return last, entries

    async def close(self) -> None:
        return None  # the client belongs to the state store


def _context_bytes(entries: Iterable[SemanticEntry]) -> int:
    return CONTEXT_OVERHEAD_BYTES + sum(entry_bytes(entry) for entry in entries)


def _decode(fields: dict[bytes | str, bytes | str]) -> SemanticEntry | None:
    """An entry as another replica wrote it; None when it is malformed (skipped)."""
    try:
        values = {_text(k): v for k, v in fields.items()}
        vector = np.frombuffer(base64.b64decode(values["v"]), dtype="<f4").astype(np.float32)
        return SemanticEntry(
            answer_key=_text(values["a"]),
            question=_text(values["q"]),
            vector=vector,
            expires_at=float(_text(values["e"])),
        )
    except (KeyError, ValueError, TypeError):
        return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _Bucket:
    cursor: str | None = None
    entries: list[SemanticEntry] = field(default_factory=list)
    matrix: Vector | None = None  # the entries' vectors, one row each; rebuilt on change


class SemanticIndex:
    """Searches one context's stored questions; a mirror of the `EntryLog`, bounded in
    bytes over all contexts, empty ones included (`CONTEXT_OVERHEAD_BYTES` each)."""

    def __init__(
        self,
        log: EntryLog,
        *,
        dimensions: int,
        max_entries_per_context: int,
        max_mirrored_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._log = log
        self._dimensions = dimensions
        self._max_per_context = max_entries_per_context
        self._max_mirrored_bytes = max_mirrored_bytes
        self._clock = clock
        # Least recently searched first; `_empty` holds those without entries, the first
        # to go when the mirror is over its bound.
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._empty: OrderedDict[str, None] = OrderedDict()
        self._mirrored = 0
        self._mirrored_bytes = 0

    @property
    def log(self) -> EntryLog:
        return self._log

    @property
    def mirrored_entries(self) -> int:
        return self._mirrored

    @property
    def mirrored_bytes(self) -> int:
        return self._mirrored_bytes

    @property
    def mirrored_contexts(self) -> int:
        return len(self._buckets)

    @property
    def max_mirrored_bytes(self) -> int:
        return self._max_mirrored_bytes

    def mirrors(self, context: str) -> bool:
        """Whether this replica holds the context's bucket (else the next search reads the
        whole context from the log again)."""
        return context in self._buckets

    async def search(
        self, context: str, vector: Vector, *, min_similarity: float, limit: int = 4
    ) -> list[Candidate]:
        """The context's `limit` most similar live entries with similarity >=
        `min_similarity`, best first (ties: the older entry first)."""
        bucket = await self._sync(context)
        if not bucket.entries or limit < 1:
            return []
        if bucket.matrix is None:
            bucket.matrix = np.stack([entry.vector for entry in bucket.entries])
        similarities = bucket.matrix @ vector.astype(np.float32, copy=False)
        # Only the best `limit` are sorted: a bucket full of near questions costs no more.
        if len(similarities) > limit:
            best = np.argpartition(-similarities, limit - 1)[:limit]
        else:
            best = np.arange(len(similarities))
        best = best[np.lexsort((best, -similarities[best]))]
        now = self._clock()
        found: list[Candidate] = []
        for index in best:
            similarity = float(similarities[index])
            entry = bucket.entries[int(index)]
            if similarity >= min_similarity and entry.expires_at > now:
                found.append(Candidate(similarity, entry))
        return found

    async def add(self, context: str, entry: SemanticEntry, ttl_s: float) -> bool:
        """Store an answered question; the next search of this replica sees it (and, through
        the shared log, every other replica's). A question the guard refuses outright
        (invisible text, `refusal_reason`) is never indexed: False."""
        if refusal_reason(entry.question) is not None:
            return False
        await self._log.append(context, entry, ttl_s, self._max_per_context)
        return True

    def forget(self, context: str, answer_key: str) -> None:
        """Drop an entry whose answer is gone from this mirror (it expired or was evicted)."""
        bucket = self._buckets.get(context)
        if bucket is None:
            return
        kept = [entry for entry in bucket.entries if entry.answer_key != answer_key]
        self._replace(context, bucket, kept)

    async def _sync(self, context: str) -> _Bucket:
        bucket = self._buckets.pop(context, None)
        if bucket is None:
            bucket = _Bucket()
            self._mirrored_bytes += CONTEXT_OVERHEAD_BYTES
        self._buckets[context] = bucket  # most recently used last
        if not bucket.entries:
            self._empty[context] = None
            self._empty.move_to_end(context)
        cursor, fresh = await self._log.read_since(context, bucket.cursor)
        now = self._clock()
        # Another search of this context may have read the same entries meanwhile.
        known = {entry.answer_key for entry in bucket.entries}
        valid = [
            entry
            for entry in fresh
            if entry.vector.shape == (self._dimensions,)
            and entry.expires_at > now
            and entry.answer_key not in known
        ]
        live = [entry for entry in bucket.entries if entry.expires_at > now]
        if self._buckets.get(context) is not bucket:
            # Evicted while the log answered (other searches ran meanwhile): this search
            # still sees everything, the mirror keeps nothing of it.
            return _Bucket(cursor, (live + valid)[-self._max_per_context :])
        bucket.cursor = cursor
        if valid or len(live) < len(bucket.entries):
            self._replace(context, bucket, (live + valid)[-self._max_per_context :])
        self._evict(keep=context)
        return bucket

    def _evict(self, keep: str) -> None:
        """Over the byte bound: empty contexts first, oldest first, then the least recently
        searched; never `keep`, the context being searched."""
        while self._mirrored_bytes > self._max_mirrored_bytes:
            victim = next((c for c in self._empty if c != keep), None)
            if victim is None:
                victim = next((c for c in self._buckets if c != keep), None)
            if victim is None:
                return
            dropped = self._buckets.pop(victim)
            self._empty.pop(victim, None)
            self._mirrored -= len(dropped.entries)
            self._mirrored_bytes -= _context_bytes(dropped.entries)

    def _replace(self, context: str, bucket: _Bucket, entries: list[SemanticEntry]) -> None:
        self._mirrored += len(entries) - len(bucket.entries)
        self._mirrored_bytes += sum(entry_bytes(e) for e in entries) - sum(
            entry_bytes(e) for e in bucket.entries
        )
        bucket.entries, bucket.matrix = entries, None
        if entries:
            self._empty.pop(context, None)
        elif context in self._buckets:
            self._empty[context] = None
            self._empty.move_to_end(context, last=False)  # emptied by expiry: first out
