"""The key directory's behaviour, the same on the SQLite file and on Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.config.model import LevelConfig, hash_api_key
from kvgate.keys import KeyRefusal
from kvgate.keys import directory as directory_module
from kvgate.keys.directory import CachedDirectory
from tests.keys.conftest import MakeDirectory

# Generous: a loaded machine may be slow, the bound (refresh_s) is small.
PROPAGATION_DEADLINE_S = 10.0


async def until_refused(directory: CachedDirectory, key_hash: str) -> KeyRefusal | None:
    """Poll the other instance's lookup until it refuses the key, or the deadline passes."""
    deadline = time.monotonic() + PROPAGATION_DEADLINE_S
    while True:
        record = await directory.lookup(key_hash)
        assert record is not None
        refusal = record.refusal(time.time())
        if refusal is not None or time.monotonic() > deadline:
            return refusal
        await asyncio.sleep(0.01)


async def test_created_key_is_found_by_its_hash(make_directory: MakeDirectory) -> None:
    directory = await make_directory()
    limits = LevelConfig.model_validate({"models": ["qwen2.5-demo"]})
    made = await directory.create(
        "acme", team="search", user="u-1", labels={"env": "prod"}, limits=limits
    )
    assert made.secret.startswith("kvg-") and len(made.secret) >= 4 + 43
    assert made.record.key_id.startswith("key_") and len(made.record.key_id) == 4 + 16
    assert made.record.key_hash == hash_api_key(made.secret)
    found = await directory.lookup(hash_api_key(made.secret))
    assert found == made.record
    assert found is not None and found.limits == limits and dict(found.labels) == {"env": "prod"}
    assert found.refusal(time.time()) is None
    assert await directory.get(made.record.key_id) == made.record
    assert await directory.lookup(hash_api_key("kvg-not-a-key")) is None
    assert await directory.get("key_0000000000000000") is None


async def test_revoke_is_in_force_on_another_instance(make_directory: MakeDirectory) -> None:
    here, there = await make_directory(), await make_directory()
    made = await here.create("acme")
    key_hash = made.record.key_hash
    # The other replica has it cached as usable.
    before = await there.lookup(key_hash)
    assert before is not None and before.refusal(time.time()) is None
    revoked = await here.revoke(made.record.key_id)
    assert revoked is not None and revoked.refusal(time.time()) is KeyRefusal.REVOKED
    # Here at once (a local change empties the local cache) ...
    local = await here.lookup(key_hash)
    assert local is not None and local.refusal(time.time()) is KeyRefusal.REVOKED
    # ... there after its next generation poll.
    assert await until_refused(there, key_hash) is KeyRefusal.REVOKED
    assert await here.revoke("key_0000000000000000") is None


async def test_expiry(make_directory: MakeDirectory) -> None:
    directory = await make_directory()
    now = time.time()
    expired = await directory.create("acme", expires_at=now - 1)
    later = await directory.create("acme", expires_at=now + 3600)
    old = await directory.lookup(expired.record.key_hash)
    assert old is not None and old.refusal(time.time()) is KeyRefusal.EXPIRED
    fresh = await directory.lookup(later.record.key_hash)
    assert fresh is not None and fresh.refusal(time.time()) is None
    assert fresh.refusal(now + 3600) is KeyRefusal.EXPIRED


async def test_rotation_with_grace(make_directory: MakeDirectory) -> None:
    directory = await make_directory()
    limits = LevelConfig.model_validate({"limits": {"rpm": 5}})
    old = await directory.create("acme", team="t", labels={"a": "b"}, limits=limits)
    await directory.lookup(old.record.key_hash)  # cached as usable
    new = await directory.rotate(old.record.key_id, grace_s=3600)
    assert new is not None and new.secret != old.secret
    assert new.record.key_id != old.record.key_id
    assert (new.record.tenant, new.record.team, dict(new.record.labels), new.record.limits) == (
        "acme",
        "t",
        {"a": "b"},
        limits,
    )
    now = time.time()
    fresh = await directory.lookup(hash_api_key(new.secret))
    assert fresh is not None and fresh.refusal(now) is None
    # The old key keeps working until the grace ends, and is refused from then on.
    during = await directory.lookup(old.record.key_hash)
    assert during is not None and during.revoked_at is not None
    assert during.refusal(now) is None
    assert during.refusal(during.revoked_at) is KeyRefusal.REVOKED
    assert during.revoked_at >= now + 3000
    # Rotating without grace revokes at once; a revoked key cannot be rotated.
    again = await directory.rotate(new.record.key_id)
    assert again is not None
    gone = await directory.lookup(new.record.key_hash)
    assert gone is not None and gone.refusal(time.time()) is KeyRefusal.REVOKED
    assert await directory.rotate(new.record.key_id) is None
    assert await directory.rotate("key_0000000000000000") is None


async def test_list_pages_in_key_id_order(make_directory: MakeDirectory) -> None:
    directory = await make_directory()
    acme = {(await directory.create("acme")).record.key_id for _ in range(7)}
    other = {(await directory.create("other")).record.key_id for _ in range(3)}
    pages: list[list[str]] = []
    after = ""
    while True:
        page = await directory.list(tenant="acme", after_key_id=after, limit=3)
        if not page:
            break
        pages.append([record.key_id for record in page])
        after = page[-1].key_id
    assert [len(page) for page in pages] == [3, 3, 1]
    listed = [key_id for page in pages for key_id in page]
    assert listed == sorted(acme)
    everything = await directory.list(limit=100)
    assert [r.key_id for r in everything] == sorted(acme | other)
    assert {r.tenant for r in await directory.list(tenant="other")} == {"other"}
    assert await directory.list(tenant="nobody") == []


async def test_cache_is_bounded_under_a_flood_of_unknown_keys(
    make_directory: MakeDirectory,
) -> None:
    directory = await make_directory(cache_entries=50, refresh_s=60.0)
    made = await directory.create("acme")
    await directory.refresh()  # the generation as of now: no clearing in between
    await directory.lookup(made.record.key_hash)
    for i in range(500):
        assert await directory.lookup(hash_api_key(f"kvg-random-{i}")) is None
        assert directory.cached_entries <= 50
    # The misses have an LRU of their own (a tenth of the bound): the known key was not
    # pushed out by them.
    assert directory.cached_entries == 1 + 5
    assert directory._cache.get(made.record.key_hash) == (True, made.record)
    assert await directory.lookup(made.record.key_hash) == made.record


async def test_cached_miss_is_forgotten_when_the_generation_moves(
    make_directory: MakeDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = await make_directory()
    there = await make_directory(refresh_s=60.0)  # polled by hand below
    await there.refresh()
    secret = "kvg-chosen-by-the-test-so-its-hash-is-known-before"
    monkeypatch.setattr(directory_module, "new_secret", lambda: secret)
    assert await there.lookup(hash_api_key(secret)) is None  # a cached miss
    made = await here.create("acme")
    assert made.secret == secret
    assert await there.lookup(hash_api_key(secret)) is None  # still the cached miss
    assert await there.refresh()  # the generation moved: emptied
    assert await there.lookup(hash_api_key(secret)) == made.record
    assert not await there.refresh()  # nothing changed since: kept


async def test_nothing_is_loaded_at_start(make_directory: MakeDirectory) -> None:
    first = await make_directory()
    for _ in range(20):
        await first.create("acme")
    second = await make_directory()
    assert second.cached_entries == 0
