"""API keys at scale: a directory's start-up time does not grow with the keys Redis holds.

    .venv/bin/python -m bench.keys_scale                       # 1,000,000 keys
    .venv/bin/python -m bench.keys_scale --keys 100000 --redis redis://127.0.0.1:6379/0

Writes key records the way `RedisKeyDirectory` stores them (pipelined, under a prefix of its
own, deleted at the end), and for 0 keys and then for all of them measures: building and
starting a directory (nothing is loaded), its first lookup of a key (one store read), a
cached lookup, and a lookup of an unknown key. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as aioredis

from kvgate.config.model import hash_api_key
from kvgate.keys.directory import FIELDS, new_key_id, record_fields
from kvgate.keys.records import KeyRecord
from kvgate.keys.redis_directory import RedisKeyDirectory
from kvgate.store.redis_store import hash_tag

BATCH = 10_000


async def write_keys(
    client: aioredis.Redis, tag: str, count: int, *, tenant: str | None = None
) -> list[str]:
    """``count`` key records in the directory's layout (the key i's secret is
    ``kvg-bench-<i>``), all of ``tenant`` or spread over t0..t99; returns a few hashes."""
    samples: list[str] = []
    for start in range(0, count, BATCH):
        pipe = client.pipeline(transaction=False)
        ids: dict[str, str] = {}
        by_tenant: dict[str, dict[str, int]] = {}
        for i in range(start, min(start + BATCH, count)):
            key_hash = hash_api_key(f"kvg-bench-{i}")
            record = KeyRecord(
                key_id=new_key_id(),
                key_hash=key_hash,
                tenant=tenant or f"t{i % 100}",
                created_at=0.0,
            )
            fields = record_fields(record)
            pipe.hset(f"{tag}:apikey|h|{key_hash}", mapping={n: fields[n] for n in FIELDS})
            ids[f"{tag}:apikey|id|{record.key_id}"] = key_hash
            by_tenant.setdefault(record.tenant, {})[record.key_id] = 0
            if i % (count // 10 or 1) == 0:
                samples.append(key_hash)
        pipe.mset(ids)
        for tenant, members in by_tenant.items():
            pipe.zadd(f"{tag}:apikeys|t|{tenant}", members)
        pipe.zadd(f"{tag}:apikeys|all", {key_id: 0 for m in by_tenant.values() for key_id in m})
        pipe.incr(f"{tag}:apikeys|gen")
        await pipe.execute()
    return samples


async def measure(url: str, tag: str, samples: list[str], label: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        began = time.perf_counter()
        directory = RedisKeyDirectory(
            client, tag, cache_entries=100_000, refresh_s=0.25, timeout_s=5.0
        )
        await directory.start()
        started_ms = (time.perf_counter() - began) * 1000
        first, cached = [], []
        for key_hash in samples:
            t0 = time.perf_counter()
            await directory.lookup(key_hash)
            first.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            await directory.lookup(key_hash)
            cached.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        await directory.lookup(hash_api_key(f"kvg-unknown-{uuid.uuid4()}"))
        unknown_ms = (time.perf_counter() - t0) * 1000
        await directory.close()
        print(
            f"{label:<22} start {started_ms:7.3f} ms   first lookup median "
            f"{statistics.median(first) if first else 0:6.3f} ms   cached "
            f"{statistics.median(cached) if cached else 0:6.4f} ms   unknown {unknown_ms:6.3f} ms"
        )
    finally:
        await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    tag = hash_tag(f"kvgate-bench-keys-{uuid.uuid4().hex[:8]}")
    client = aioredis.Redis.from_url(args.redis)
    try:
        empty_samples = [hash_api_key(f"kvg-bench-{i}") for i in range(10)]
        await measure(args.redis, tag, empty_samples, "0 keys")
        began = time.perf_counter()
        samples = await write_keys(client, tag, args.keys)
        print(f"wrote {args.keys:,} keys in {time.perf_counter() - began:.1f} s")
        await measure(args.redis, tag, samples, f"{args.keys:,} keys")
        print(f"redis used_memory: {(await client.info('memory'))['used_memory_human']}")
    finally:
        doomed: list[bytes] = []
        async for key in client.scan_iter(match=f"{tag}*", count=10_000):
            doomed.append(key)
            if len(doomed) >= BATCH:
                await client.unlink(*doomed)
                doomed.clear()
        if doomed:
            await client.unlink(*doomed)
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
