"""A reserve interrupted at any await point leaks nothing once abandoned.

The reserve runs as a task that is cancelled after k event-loop iterations, for k = 0, 1, 2,
... until the reserve completes before it can be cancelled: so the cancellation lands before
the call starts, while it waits for a connection, after the script was sent (it commits in
Redis while its reply is lost), and after the reply arrived. After each, the caller does what
the admission path does, `abandon(request)`, and every limit must be whole again: nothing in
flight, and the tenant can take its full RPM, TPM, budget and concurrency.

Real Redis (the shared server), no mocks: the test also checks, with a second client, that
some of the cancelled reserves really had committed in Redis before they were abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvgate.policy import (
    AdmissionRequest,
    BackendLimits,
    BucketSpec,
    BudgetRule,
    ConcurrencyRule,
    Decision,
    ManualClock,
    Period,
    RateRule,
    ScopeLimits,
    TenantPolicy,
)
from kvgate.store import FailurePolicy, FallbackStore, MemoryStore, RedisStore, StateStore
from tests.store.conftest import REDIS_URL, delete_prefix

BACKEND = BackendLimits("b", kv_budget_tokens=1000, kv_block_size=10, max_concurrent_requests=1)
POLICY = TenantPolicy(
    name="t",
    limits=ScopeLimits(
        rpm=RateRule(BucketSpec(2, 1e-9)),
        tpm=RateRule(BucketSpec(1000, 1e-9)),
        concurrency=ConcurrencyRule(1),
    ),
    budgets=(BudgetRule(Period.DAY, 1000),),
)
MAX_K = 5000


def request(rid: str, prompt: int = 400, max_new: int = 400, cost: int = 600) -> AdmissionRequest:
    return AdmissionRequest(rid, "t", "m", "b", prompt, max_new, cost_pico=cost)


async def reserve_cancelled_after(store: StateStore, req: AdmissionRequest, k: int) -> bool:
    """Reserve, cancelling after k loop iterations; True if it had finished by then.

    A cancellation may also be absorbed (redis-py finishes a command it has started and
    returns its reply): the caller then does not know the outcome either way, and abandons.
    """
    task = asyncio.create_task(store.reserve(req, BACKEND, POLICY))
    for _ in range(k):
        await asyncio.sleep(0)
    if task.done():
        assert task.result().admitted
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def assert_whole(store: StateStore, probe: int) -> None:
    """Nothing in flight, and the tenant's whole limits are free (then given back)."""
    statuses = {s.name: s for s in await store.backend_status()}
    if "b" in statuses:
        assert (statuses["b"].kv_tokens_in_flight, statuses["b"].requests_in_flight) == (0, 0)
    full = request(f"probe-{probe}", prompt=500, max_new=500, cost=1000)
    decision: Decision = await store.reserve(full, BACKEND, POLICY)
    assert decision.admitted, decision  # all 1000 tokens, the whole budget, the one slot
    assert decision.budget_left_pico == 1000
    assert decision.rate_limits is not None
    assert decision.rate_limits.remaining_requests == 1  # only the probe's own request
    assert decision.rate_limits.remaining_tokens == 0
    await store.abandon(full)


async def run_every_await_point(store: StateStore, landed: object = None) -> tuple[int, int]:
    """Returns (cancelled reserves, of which committed before their abandon)."""
    cancelled = committed = 0
    for k in range(MAX_K):
        req = request(f"r{k}")
        finished = await reserve_cancelled_after(store, req, k)
        if not finished:
            cancelled += 1
            if landed is not None and await landed(req):  # type: ignore[operator]
                committed += 1
        await store.abandon(req)
        await store.abandon(req)  # idempotent
        await assert_whole(store, k)
        # A copy of the reserve landing after the abandon commits nothing.
        assert not (await store.reserve(req, BACKEND, POLICY)).admitted
        await assert_whole(store, 10_000 + k)
        if finished:
            return cancelled, committed
    raise AssertionError("the reserve never completed")


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(REDIS_URL)
    yield connection
    await connection.aclose()


def redis_store(client: aioredis.Redis) -> RedisStore:
    # A pool of its own: cancelled calls drop their connections, the checks use `client`.
    return RedisStore(
        aioredis.Redis.from_url(REDIS_URL),
        lease_ttl_s=60,
        key_prefix=f"kvgate-cancel-{uuid.uuid4().hex[:12]}",
        timeout_s=5,
        clock=ManualClock(),
    )


def landed_in(client: aioredis.Redis, store: RedisStore) -> object:
    async def landed(req: AdmissionRequest) -> bool:
        await asyncio.sleep(0.01)  # the script was sent on another connection
        return bool(await client.hexists(f"{store.key_tag}:rq", f"{req.tenant}|{req.request_id}"))

    return landed


async def test_memory_store_reserve_interrupted_anywhere_leaks_nothing() -> None:
    cancelled, _ = await run_every_await_point(MemoryStore(lease_ttl_s=60, clock=ManualClock()))
    assert cancelled >= 1  # k = 0: cancelled before it ran


async def test_redis_reserve_interrupted_anywhere_leaks_nothing(client: aioredis.Redis) -> None:
    store = redis_store(client)
    try:
        cancelled, committed = await run_every_await_point(store, landed_in(client, store))
        assert cancelled >= 2
        assert committed >= 1, "no cancelled reserve had committed: the test proved nothing"
    finally:
        await delete_prefix(client, store.key_tag)
        await store.close()


async def test_fallback_reserve_interrupted_anywhere_leaks_nothing(client: aioredis.Redis) -> None:
    shared = redis_store(client)
    store = FallbackStore(
        shared, MemoryStore(lease_ttl_s=60), policy=FailurePolicy.FAIL_OPEN, probe_interval_s=0.2
    )
    try:
        cancelled, committed = await run_every_await_point(store, landed_in(client, shared))
        assert cancelled >= 2 and committed >= 1
        assert store.available
    finally:
        await delete_prefix(client, shared.key_tag)
        await store.close()
