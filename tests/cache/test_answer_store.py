"""One contract for both idempotency stores: the memory one and real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kvgate.cache.answers import (
    AnswerQuota,
    AnswerStore,
    ClaimState,
    MemoryAnswerStore,
    RedisAnswerStore,
    StoredAnswer,
    StoreResult,
    entry_bytes,
)
from testbed.redis_harness import RedisServer

ANSWER = StoredAnswer(200, "text/event-stream", b'data: {"x": 1}\n\ndata: [DONE]\n\n\x00\xff')


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AnswerStore]:
    if request.param == "memory":
        yield MemoryAnswerStore(max_bytes=1 << 20)
        return
    client = aioredis.Redis(host="127.0.0.1", port=6379)
    tag = "{idem-test-" + uuid.uuid4().hex[:8] + "}"
    yield RedisAnswerStore(client, tag, timeout_s=2)
    keys = [key async for key in client.scan_iter(match=f"{tag}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_the_first_claim_runs_and_a_duplicate_sees_it_in_flight(
    store: AnswerStore,
) -> None:
    first = await store.claim("k", "fp1", "a", 10)
    assert first.state is ClaimState.STARTED
    duplicate = await store.claim("k", "fp1", "b", 10)
    assert duplicate.state is ClaimState.IN_FLIGHT and duplicate.fingerprint == "fp1"
    other_body = await store.claim("k", "fp2", "c", 10)
    assert other_body.state is ClaimState.IN_FLIGHT and other_body.fingerprint == "fp1"


async def test_a_completed_key_replays_its_answer_byte_for_byte(store: AnswerStore) -> None:
    await store.claim("k", "fp1", "a", 10)
    assert await store.complete("k", "a", ANSWER, 60) is StoreResult.STORED
    again = await store.claim("k", "fp1", "b", 10)
    assert again.state is ClaimState.COMPLETED
    assert again.answer == ANSWER and again.fingerprint == "fp1"
    # Completing twice, or by someone else, changes nothing.
    assert await store.complete("k", "a", StoredAnswer(200, "x", b"other"), 60) is (
        StoreResult.LOST
    )
    assert (await store.claim("k", "fp1", "c", 10)).answer == ANSWER


async def test_a_released_key_runs_anew(store: AnswerStore) -> None:
    await store.claim("k", "fp1", "a", 10)
    await store.release("k", "b")  # not the owner: nothing happens
    assert (await store.claim("k", "fp1", "c", 10)).state is ClaimState.IN_FLIGHT
    await store.release("k", "a")
    retry = await store.claim("k", "fp1", "c", 10)
    assert retry.state is ClaimState.STARTED
    # The old owner lost it.
    assert await store.complete("k", "a", ANSWER, 60) is StoreResult.LOST


async def test_a_lock_whose_owner_vanished_expires(store: AnswerStore) -> None:
    await store.claim("k", "fp1", "a", 0.2)
    await asyncio.sleep(0.3)
    assert (await store.claim("k", "fp1", "b", 10)).state is ClaimState.STARTED


async def test_an_answer_expires_after_its_retention(store: AnswerStore) -> None:
    await store.claim("k", "fp1", "a", 10)
    await store.complete("k", "a", ANSWER, 0.2)
    await asyncio.sleep(0.3)
    assert (await store.claim("k", "fp1", "b", 10)).state is ClaimState.STARTED


async def test_concurrent_claims_start_exactly_one(store: AnswerStore) -> None:
    claims = await asyncio.gather(*(store.claim("k", "fp", f"o{i}", 10) for i in range(20)))
    assert sum(c.state is ClaimState.STARTED for c in claims) == 1


def _quota(tenant: str, max_bytes: int, namespace: str = "cache") -> AnswerQuota:
    return AnswerQuota(namespace, tenant, max_bytes)


BIG = StoredAnswer(200, "t", b"x" * 4000)


async def test_a_tenant_over_its_quota_is_refused_and_nobody_else_is_evicted(
    store: AnswerStore,
) -> None:
    room = entry_bytes("a0", BIG) * 3 + entry_bytes("a3", None) + 100
    for i in range(3):
        quota = _quota("abuser", room)
        assert (await store.claim(f"a{i}", "fp", "o", 10, quota=quota)).state is (
            ClaimState.STARTED
        )
        assert await store.complete(f"a{i}", "o", BIG, 60, quota=quota) is StoreResult.STORED
    # The fourth answer does not fit the abuser's quota: not stored, its key released.
    quota = _quota("abuser", room)
    assert (await store.claim("a3", "fp", "o", 10, quota=quota)).state is ClaimState.STARTED
    assert await store.complete("a3", "o", BIG, 60, quota=quota) is StoreResult.NOT_KEPT
    assert (await store.claim("a3", "fp", "p", 10, quota=quota)).state is ClaimState.STARTED
    # Another tenant's quota is its own; the abuser's entries are all still there.
    other = _quota("victim", room)
    assert (await store.claim("v0", "fp", "o", 10, quota=other)).state is ClaimState.STARTED
    assert await store.complete("v0", "o", BIG, 60, quota=other) is StoreResult.STORED
    for i in range(3):
        assert (await store.claim(f"a{i}", "fp", "x", 10)).state is ClaimState.COMPLETED


async def test_a_tenant_without_room_for_a_lock_gets_no_claim(store: AnswerStore) -> None:
    quota = _quota("t", entry_bytes("k0", None) * 2 + 10, "idempotency")
    assert (await store.claim("k0", "fp", "o", 10, quota=quota)).state is ClaimState.STARTED
    assert (await store.claim("k1", "fp", "o", 10, quota=quota)).state is ClaimState.STARTED
    assert (await store.claim("k2", "fp", "o", 10, quota=quota)).state is ClaimState.OVER_QUOTA
    # Giving a key up gives its bytes back.
    await store.release("k0", "o", quota=quota)
    assert (await store.claim("k2", "fp", "o", 10, quota=quota)).state is ClaimState.STARTED


async def test_an_answer_that_does_not_fit_leaves_its_marker(store: AnswerStore) -> None:
    quota = _quota("t", entry_bytes("k", None) + 50, "idempotency")
    answer = StoredAnswer(200, "t", b"y" * 5000, 10, 20, (("x-kvgate-fallback", "a -> b"),))
    assert (await store.claim("k", "fp", "o", 10, quota=quota)).state is ClaimState.STARTED
    result = await store.complete(
        "k", "o", answer, 60, quota=quota, marker=answer.marker("over_quota")
    )
    assert result is StoreResult.NOT_KEPT
    again = await store.claim("k", "fp", "p", 10, quota=quota)
    assert again.state is ClaimState.COMPLETED and again.answer is not None
    assert again.answer.not_kept == "over_quota" and again.answer.body == b""
    assert again.answer.headers == (("x-kvgate-fallback", "a -> b"),)


async def test_expired_entries_give_their_bytes_back(store: AnswerStore) -> None:
    quota = _quota("t", entry_bytes("k0", BIG) + entry_bytes("k1", None) + 100)
    await store.claim("k0", "fp", "o", 10, quota=quota)
    assert await store.complete("k0", "o", BIG, 0.2, quota=quota) is StoreResult.STORED
    await store.claim("k1", "fp", "o", 10, quota=quota)
    assert await store.complete("k1", "o", BIG, 60, quota=quota) is StoreResult.NOT_KEPT
    await asyncio.sleep(0.3)
    await store.claim("k1", "fp", "o", 10, quota=quota)
    assert await store.complete("k1", "o", BIG, 60, quota=quota) is StoreResult.STORED


async def test_a_renewed_lock_outlives_its_first_ttl(store: AnswerStore) -> None:
    quota = _quota("t", 1 << 20, "idempotency")
    await store.claim("k", "fp", "o", 0.3, quota=quota)
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await store.renew("k", "o", 0.3, quota=quota)
    assert (await store.claim("k", "fp", "p", 10, quota=quota)).state is ClaimState.IN_FLIGHT
    assert not await store.renew("k", "p", 0.3, quota=quota)  # not the owner


async def test_the_memory_store_is_bounded_in_bytes_and_evicts_nothing() -> None:
    store = MemoryAnswerStore(max_bytes=20_000)
    stored = 0
    for i in range(50):
        if (await store.claim(f"k{i}", "fp", "a", 10)).state is not ClaimState.STARTED:
            continue
        if await store.complete(f"k{i}", "a", BIG, 60) is StoreResult.STORED:
            stored += 1
    # Full means refused: the first answers are all kept, no more than the bound is held.
    assert stored == 20_000 // entry_bytes("k0", BIG)
    assert (await store.claim("k0", "fp", "b", 10)).state is ClaimState.COMPLETED
    assert store.bytes_used <= 20_000


async def test_redis_near_maxmemory_takes_no_new_entries(tmp_path: Path) -> None:
    """kvgate never lets Redis reach maxmemory (noeviction: every write would then fail)."""
    with RedisServer(tmp_path) as server:
        client = aioredis.Redis(port=server.port)
        try:
            store = RedisAnswerStore(client, "{mem}", timeout_s=2, max_memory_fraction=0.8)
            assert (await store.claim("k0", "fp", "o", 10)).state is ClaimState.STARTED
            used = int((await client.info("memory"))["used_memory"])
            # Now used memory is 90 % of maxmemory: past the store's fraction.
            await client.config_set("maxmemory", str(int(used / 0.9)))
            await asyncio.sleep(1.05)  # the store looks at memory once a second
            assert await store.complete("k0", "o", BIG, 60) is StoreResult.NOT_KEPT
            assert (await store.claim("k1", "fp", "o", 10)).state is ClaimState.OVER_QUOTA
            await client.config_set("maxmemory", "0")
            await asyncio.sleep(1.05)
            assert (await store.claim("k1", "fp", "o", 10)).state is ClaimState.STARTED
        finally:
            await client.aclose()
