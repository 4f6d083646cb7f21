"""Store fixtures: the same factory over the memory store and the real Redis store.

The Redis store uses the server on 127.0.0.1:6379 (override with KVGATE_TEST_REDIS_URL), a
key prefix unique to each test, and deletes its keys afterwards. Time is a ManualClock in
both stores, so nothing sleeps.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from kvgate.policy import ManualClock
from kvgate.store import FailurePolicy, FallbackStore, MemoryStore, StateStore
from kvgate.store.base import ExpiredLeaseHook
from kvgate.store.redis_store import RedisStore
from testbed.redis_harness import RedisClusterNodes

REDIS_URL = os.environ.get("KVGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

StoreFactory = Callable[..., StateStore]


async def delete_prefix(client: aioredis.Redis | RedisCluster, tag: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{tag}*", count=1000)]
    if keys:
        await client.delete(*keys)  # one hash tag: one slot, one node


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A real three-master Redis Cluster, started once (about 2 s) for the whole session."""
    with RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


@pytest.fixture(params=["memory", "redis", "redis-cluster", "fallback"])
async def make_store(
    request: pytest.FixtureRequest, clock: ManualClock
) -> AsyncIterator[StoreFactory]:
    """make_store(lease_ttl_s=60, on_lease_expired=None, bill_retention_s=24 h) -> a fresh
    store on `clock`.

    "redis-cluster" runs the same store on a real Redis Cluster (the key prefix, hence the
    slot and the node, differs per test). "fallback" is the Redis store behind the failure
    policy (FallbackStore, fail_open), as kvgate runs it, while Redis answers."""
    clients: list[aioredis.Redis | RedisCluster] = []
    tags: list[str] = []
    fallbacks: list[FallbackStore] = []
    cluster_url = (
        request.getfixturevalue("redis_cluster").url if request.param == "redis-cluster" else None
    )

    def factory(
        *,
        lease_ttl_s: float = 60.0,
        on_lease_expired: ExpiredLeaseHook | None = None,
        bill_retention_s: float | None = None,
    ) -> StateStore:
        # Only passed when a test sets it (the stores' default otherwise).
        extra: dict[str, Any] = {}
        if bill_retention_s is not None:
            extra["bill_retention_s"] = bill_retention_s
        if request.param == "memory":
            return MemoryStore(
                lease_ttl_s=lease_ttl_s, clock=clock, on_lease_expired=on_lease_expired, **extra
            )
        client: aioredis.Redis | RedisCluster = (
            RedisCluster.from_url(cluster_url)
            if cluster_url
            else aioredis.Redis.from_url(REDIS_URL)
        )
        store = RedisStore(
            client,
            lease_ttl_s=lease_ttl_s,
            key_prefix=f"kvgate-test-{uuid.uuid4().hex[:12]}",
            timeout_s=5.0,
            clock=clock,
            on_lease_expired=on_lease_expired,
            **extra,
        )
        clients.append(client)
        tags.append(store.key_tag)
        if request.param == "fallback":
            local = MemoryStore(lease_ttl_s=lease_ttl_s, clock=clock, **extra)
            fallback = FallbackStore(store, local, policy=FailurePolicy.FAIL_OPEN)
            fallbacks.append(fallback)
            return fallback
        return store

    yield factory
    for fallback in fallbacks:
        assert fallback.available  # Redis answered every call: nothing was decided locally
    for client, tag in zip(clients, tags, strict=True):
        await delete_prefix(client, tag)
        await client.aclose()
