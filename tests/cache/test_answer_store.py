"""One contract for both idempotency stores: the memory one and real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvgate.cache.answers import (
    AnswerStore,
    ClaimState,
    MemoryAnswerStore,
    RedisAnswerStore,
    StoredAnswer,
)

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
    assert await store.complete("k", "a", ANSWER, 60)
    again = await store.claim("k", "fp1", "b", 10)
    assert again.state is ClaimState.COMPLETED
    assert again.answer == ANSWER and again.fingerprint == "fp1"
    # Completing twice, or by someone else, changes nothing.
    assert not await store.complete("k", "a", StoredAnswer(200, "x", b"other"), 60)
    assert (await store.claim("k", "fp1", "c", 10)).answer == ANSWER


async def test_a_released_key_runs_anew(store: AnswerStore) -> None:
    await store.claim("k", "fp1", "a", 10)
    await store.release("k", "b")  # not the owner: nothing happens
    assert (await store.claim("k", "fp1", "c", 10)).state is ClaimState.IN_FLIGHT
    await store.release("k", "a")
    retry = await store.claim("k", "fp1", "c", 10)
    assert retry.state is ClaimState.STARTED
    assert not await store.complete("k", "a", ANSWER, 60)  # the old owner lost it


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


async def test_the_memory_store_is_bounded_in_bytes() -> None:
    store = MemoryAnswerStore(max_bytes=10_000)
    for i in range(50):
        await store.claim(f"k{i}", "fp", "a", 10)
        await store.complete(f"k{i}", "a", StoredAnswer(200, "t", b"x" * 1000), 60)
    # The newest answers are kept, the oldest dropped; no more than the bound is held.
    assert (await store.claim("k49", "fp", "b", 10)).state is ClaimState.COMPLETED
    assert (await store.claim("k0", "fp", "b", 10)).state is ClaimState.STARTED
    assert store._bytes <= 10_000
