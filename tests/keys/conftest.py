"""Key directory fixtures: the same factory over the SQLite file and the real Redis.

Redis is the server on 127.0.0.1:6379 (KVGATE_TEST_REDIS_URL overrides it), under a key
prefix unique to each test, deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kvgate.keys.directory import CachedDirectory
from kvgate.keys.redis_directory import RedisKeyDirectory
from kvgate.keys.sqlite_directory import SqliteKeyDirectory
from kvgate.store.redis_store import hash_tag
from tests.store.conftest import REDIS_URL, delete_prefix

# make_directory(cache_entries=..., refresh_s=...) -> a started directory; every call gives
# another instance on the same store (another replica, or another process on the file).
MakeDirectory = Callable[..., Awaitable[CachedDirectory]]


@pytest.fixture(params=["sqlite", "redis"])
async def make_directory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[MakeDirectory]:
    made: list[CachedDirectory] = []
    clients: list[aioredis.Redis] = []
    tag = hash_tag(f"kvgate-keys-test-{uuid.uuid4().hex[:12]}")

    async def factory(*, cache_entries: int = 1000, refresh_s: float = 0.05) -> CachedDirectory:
        directory: CachedDirectory
        if request.param == "sqlite":
            directory = SqliteKeyDirectory(
                tmp_path / "keys.sqlite3", cache_entries=cache_entries, refresh_s=refresh_s
            )
        else:
            client = aioredis.Redis.from_url(REDIS_URL)
            clients.append(client)
            directory = RedisKeyDirectory(
                client, tag, cache_entries=cache_entries, refresh_s=refresh_s, timeout_s=5.0
            )
        await directory.start()
        made.append(directory)
        return directory

    yield factory
    for directory in made:
        await directory.close()
    if clients:
        await delete_prefix(clients[0], tag)
    for client in clients:
        await client.aclose()
