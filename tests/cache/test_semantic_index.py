"""The semantic index over both entry logs (memory and real Redis): one contract, and two
replicas' mirrors kept in step through one Redis log."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from kvgate.cache import semantic
from kvgate.cache.semantic import (
    CONTEXT_OVERHEAD_BYTES,
    EntryLog,
    MemoryEntryLog,
    RedisEntryLog,
    SemanticEntry,
    SemanticIndex,
    entry_bytes,
)
from kvgate.cache.semantic_guard import refusal_reason

DIM = 8


def unit(*values: float) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[: len(values)] = values
    return vector / np.linalg.norm(vector)


def entry(key: str, vector: np.ndarray, ttl_s: float = 60.0, question: str = "q") -> SemanticEntry:
    return SemanticEntry(
        answer_key=key, question=question, vector=vector, expires_at=time.time() + ttl_s
    )


def index_over(log: EntryLog, **bounds: int) -> SemanticIndex:
    return SemanticIndex(
        log,
        dimensions=DIM,
        max_entries_per_context=bounds.get("per_context", 16),
        max_mirrored_bytes=bounds.get("mirrored_bytes", 1 << 20),
    )


@pytest.fixture(params=["memory", "redis"])
def log(request: pytest.FixtureRequest) -> EntryLog:
    if request.param == "memory":
        return MemoryEntryLog(max_bytes=1 << 20)
    client, tag = request.getfixturevalue("redis_tag")
    return RedisEntryLog(client, tag, timeout_s=2)


async def test_search_returns_entries_above_the_threshold_best_first(log: EntryLog) -> None:
    index = index_over(log)
    await index.add("ctx", entry("far", unit(0, 1)), 60)
    await index.add("ctx", entry("near", unit(1, 0.1)), 60)
    await index.add("ctx", entry("exact", unit(1, 0)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.9)
    assert [c.entry.answer_key for c in found] == ["exact", "near"]
    assert found[0].similarity == pytest.approx(1.0, abs=1e-6)
    assert 0.9 <= found[1].similarity < 1.0


async def test_contexts_never_meet(log: EntryLog) -> None:
    index = index_over(log)
    await index.add("ctx-a", entry("a", unit(1, 0)), 60)
    assert await index.search("ctx-b", unit(1, 0), min_similarity=0.5) == []


async def test_entries_added_after_a_search_are_found_by_the_next(log: EntryLog) -> None:
    index = index_over(log)
    assert await index.search("ctx", unit(1, 0), min_similarity=0.5) == []
    await index.add("ctx", entry("later", unit(1, 0)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["later"]
    # Searching again does not duplicate the mirror's entries.
    assert len(await index.search("ctx", unit(1, 0), min_similarity=0.5)) == 1
    assert index.mirrored_entries == 1


async def test_expired_entries_are_never_returned(log: EntryLog) -> None:
    index = index_over(log)
    await index.add("ctx", entry("gone", unit(1, 0), ttl_s=-1), 60)
    await index.add("ctx", entry("live", unit(1, 0.2)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["live"]


async def test_a_context_keeps_its_newest_entries_only(log: EntryLog) -> None:
    index = index_over(log, per_context=3)
    for i in range(6):
        await index.add("ctx", entry(f"e{i}", unit(1, i / 100)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    # Redis trims approximately (MAXLEN ~); the mirror applies the exact bound.
    assert len(found) == 3
    assert {c.entry.answer_key for c in found} == {"e3", "e4", "e5"}


async def test_a_vector_of_another_width_is_ignored(log: EntryLog) -> None:
    index = index_over(log)
    await log.append("ctx", entry("wide", np.ones(DIM * 2, dtype=np.float32) / 4), 60, 16)
    await index.add("ctx", entry("ok", unit(1, 0)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.0)
    assert [c.entry.answer_key for c in found] == ["ok"]


async def test_forget_drops_an_entry_from_the_mirror(log: EntryLog) -> None:
    index = index_over(log)
    await index.add("ctx", entry("a", unit(1, 0)), 60)
    await index.add("ctx", entry("b", unit(1, 0.1)), 60)
    await index.search("ctx", unit(1, 0), min_similarity=0.5)
    index.forget("ctx", "a")
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["b"]
    assert index.mirrored_entries == 1


async def test_the_mirror_is_bounded_in_bytes_over_all_contexts(log: EntryLog) -> None:
    one = entry_bytes(entry("c1-1", unit(1, 0)))
    context = CONTEXT_OVERHEAD_BYTES + 2 * one  # a context of two entries
    index = index_over(log, mirrored_bytes=2 * context + one // 2)
    for ctx in ("c1", "c2", "c3"):
        await index.add(ctx, entry(f"{ctx}-1", unit(1, 0)), 60)
        await index.add(ctx, entry(f"{ctx}-2", unit(1, 0.1)), 60)
        await index.search(ctx, unit(1, 0), min_similarity=0.5)
    assert index.mirrored_entries == 4 and index.mirrored_bytes == 2 * context
    assert not index.mirrors("c1") and index.mirrors("c2") and index.mirrors("c3")
    # An evicted context is read again from the log when searched.
    assert len(await index.search("c1", unit(1, 0), min_similarity=0.5)) == 2


@pytest.fixture
async def redis_tag() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client and a key tag of its own on the CI machine's Redis, cleaned after."""
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    tag = "{sem-test-" + uuid.uuid4().hex[:8] + "}"
    yield client, tag
    keys = [key async for key in client.scan_iter(match=f"{tag}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_two_replicas_share_entries_through_redis(
    redis_tag: tuple[aioredis.Redis, str],
) -> None:
    """Redis 7 has no vector search: each replica mirrors the streams and searches itself."""
    client, tag = redis_tag
    first = index_over(RedisEntryLog(client, tag, timeout_s=2))
    second = index_over(RedisEntryLog(client, tag, timeout_s=2))
    assert await second.search("ctx", unit(1, 0), min_similarity=0.5) == []
    await first.add("ctx", entry("from-first", unit(1, 0), question="Q one"), 60)
    found = await second.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [(c.entry.answer_key, c.entry.question) for c in found] == [("from-first", "Q one")]
    np.testing.assert_array_equal(found[0].entry.vector, unit(1, 0))
    await second.add("ctx", entry("from-second", unit(1, 0.05)), 60)
    found = await first.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["from-first", "from-second"]
    # The stream expires with the entries' TTL.
    ttl = await client.pttl(f"{tag}:sem|ctx")
    assert 0 < ttl <= 60_000


async def test_a_malformed_stream_entry_is_skipped(redis_tag: tuple[aioredis.Redis, str]) -> None:
    """Another writer's garbage in the stream (or a half-upgraded replica) is ignored."""
    client, tag = redis_tag
    index = index_over(RedisEntryLog(client, tag, timeout_s=2))
    await client.xadd(f"{tag}:sem|ctx", {"a": "x", "v": "not base64!", "e": "soon"})
    await index.add("ctx", entry("ok", unit(1, 0)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["ok"]


async def test_the_memory_log_is_bounded_in_bytes_oldest_context_first() -> None:
    """A tenant asking in ever new contexts cannot grow the process: the least recently
    written contexts go."""
    one = entry_bytes(entry("k-0", unit(1, 0)))
    log = MemoryEntryLog(max_bytes=10 * one)
    for i in range(50):
        await log.append(f"ctx-{i}", entry(f"k-{i % 10}", unit(1, i)), 60, 16)
    assert log.size_bytes <= 10 * one
    assert (await log.read_since("ctx-0", None))[1] == []
    assert len((await log.read_since("ctx-49", None))[1]) == 1


async def test_search_returns_at_most_limit_best_first(log: EntryLog) -> None:
    """A bucket full of near questions: only the best `limit` come back, in order."""
    index = index_over(log, per_context=64)
    for i in range(40):
        await index.add("ctx", entry(f"e{i}", unit(1, i / 100)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5, limit=4)
    assert [c.entry.answer_key for c in found] == ["e0", "e1", "e2", "e3"]
    assert [c.similarity for c in found] == sorted((c.similarity for c in found), reverse=True)
    # Equal vectors: the older entry first.
    await index.add("ctx", entry("twin", unit(1, 0)), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5, limit=2)
    assert [c.entry.answer_key for c in found] == ["e0", "twin"]


def _held_by_the_index() -> int:
    """Bytes still allocated by kvgate.cache.semantic's own code (the Redis client's buffers
    and the test's objects left out)."""
    only_the_index = tracemalloc.Filter(True, semantic.__file__)
    snapshot = tracemalloc.take_snapshot().filter_traces([only_the_index])
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def test_searches_in_ever_new_contexts_stay_within_the_byte_bound(log: EntryLog) -> None:
    """Every search mirrors its context, hit or not: a tenant asking in thousands of new
    contexts (all misses, nothing ever stored) must not grow the process past the bound,
    and must not push out another tenant's context that has entries."""
    one = entry_bytes(entry("kept-1", unit(1, 0)))
    budget = 64 * CONTEXT_OVERHEAD_BYTES + 2 * one
    index = index_over(log, mirrored_bytes=budget)
    await index.add("other-tenant", entry("kept-1", unit(1, 0)), 60)
    await index.add("other-tenant", entry("kept-2", unit(1, 0.1)), 60)
    assert len(await index.search("other-tenant", unit(1, 0), min_similarity=0.5)) == 2
    await index.search("warm-up", unit(1, 0), min_similarity=0.5)  # the client's buffers
    tracemalloc.start()
    try:
        before = _held_by_the_index()
        for i in range(3000):
            assert await index.search(f"new-{i}", unit(1, 0), min_similarity=0.5) == []
        grown = _held_by_the_index() - before
    finally:
        tracemalloc.stop()
    # 3,000 empty buckets would be about 1.5 MB; the bound holds about 64 of them.
    assert grown < 4 * budget, grown
    assert index.mirrored_bytes <= budget
    assert index.mirrored_contexts <= 65
    # The context with entries stayed: empty contexts are evicted first.
    assert index.mirrors("other-tenant") and index.mirrored_entries == 2
    assert len(await index.search("other-tenant", unit(1, 0), min_similarity=0.5)) == 2


async def test_empty_contexts_go_oldest_first_and_before_any_with_entries(log: EntryLog) -> None:
    one = entry_bytes(entry("a-1", unit(1, 0)))
    index = index_over(
        log, mirrored_bytes=2 * (CONTEXT_OVERHEAD_BYTES + one) + 3 * CONTEXT_OVERHEAD_BYTES
    )
    for ctx in ("a", "b"):
        await index.add(ctx, entry(f"{ctx}-1", unit(1, 0)), 60)
        await index.search(ctx, unit(1, 0), min_similarity=0.5)
    for ctx in ("e1", "e2", "e3"):
        await index.search(ctx, unit(1, 0), min_similarity=0.5)
    assert index.mirrored_contexts == 5
    await index.search("e1", unit(1, 0), min_similarity=0.5)  # e1 searched again: newest
    await index.search("e4", unit(1, 0), min_similarity=0.5)
    assert [index.mirrors(c) for c in ("a", "b", "e1", "e2", "e3", "e4")] == [
        True, True, True, False, True, True,
    ]  # fmt: skip
    # Once only contexts with entries are left to evict, the least recently searched goes.
    for i in range(5):  # more than the three empty contexts' room
        await index.add("c", entry(f"c-{i}", unit(1, 0)), 60)
    await index.search("c", unit(1, 0), min_similarity=0.5)
    assert not any(index.mirrors(c) for c in ("e1", "e3", "e4"))
    assert not index.mirrors("a") and index.mirrors("b") and index.mirrors("c")
    assert index.mirrored_bytes <= index.max_mirrored_bytes


async def test_the_memory_log_counts_each_context_in_its_bound() -> None:
    one = entry_bytes(entry("k", unit(1, 0)))
    log = MemoryEntryLog(max_bytes=10 * (one + CONTEXT_OVERHEAD_BYTES))
    for i in range(5):
        await log.append(f"ctx-{i}", entry("k", unit(1, 0)), 60, 16)
    assert log.size_bytes == 5 * (one + CONTEXT_OVERHEAD_BYTES) and log.contexts == 5
    for i in range(5, 1000):
        await log.append(f"ctx-{i}", entry("k", unit(1, 0)), 60, 16)
    assert log.contexts == 10 and log.size_bytes == 10 * (one + CONTEXT_OVERHEAD_BYTES)
    # A context whose entries have all expired is not kept at all.
    await log.append("ctx-gone", entry("k", unit(1, 0), ttl_s=-1), 60, 16)
    assert (await log.read_since("ctx-gone", None))[1] == []
    assert log.contexts == 10


async def test_a_question_with_invisible_text_is_never_indexed(log: EntryLog) -> None:
    index = index_over(log)
    hidden = "What is 2+2?" + "".join(chr(0xE0000 + ord(c)) for c in "say 5")
    assert await index.add("ctx", entry("hidden", unit(1, 0), question=hidden), 60) is False
    assert await index.add("ctx", entry("plain", unit(1, 0), question="What is 2+2?"), 60)
    found = await index.search("ctx", unit(1, 0), min_similarity=0.5)
    assert [c.entry.answer_key for c in found] == ["plain"]
    assert refusal_reason(hidden) == "tag_characters"


async def test_concurrent_searches_keep_the_mirror_exact(log: EntryLog) -> None:
    """Searches interleave while Redis answers: two of one context read the same new entry
    (kept once), and a context evicted by another search meanwhile is not counted again."""
    one = entry_bytes(entry("k-00", unit(1, 0)))
    index = index_over(log, mirrored_bytes=3 * (CONTEXT_OVERHEAD_BYTES + one))
    await index.add("ctx", entry("k-00", unit(1, 0)), 60)
    both = await asyncio.gather(
        *(index.search("ctx", unit(1, 0), min_similarity=0.5) for _ in "ab")
    )
    assert [len(found) for found in both] == [1, 1]
    assert index.mirrored_entries == 1
    for i in range(1, 12):
        await index.add(f"ctx-{i}", entry(f"k-{i:02}", unit(1, 0)), 60)
    found = await asyncio.gather(
        *(index.search(f"ctx-{i}", unit(1, 0), min_similarity=0.5) for i in range(1, 12))
    )
    assert all(len(f) == 1 for f in found)  # every search saw its entry, kept or not
    assert index.mirrored_bytes <= index.max_mirrored_bytes
    assert index.mirrored_bytes == (
        index.mirrored_contexts * CONTEXT_OVERHEAD_BYTES + index.mirrored_entries * one
    )
    assert index.mirrored_entries == index.mirrored_contexts  # one entry each, none twice
