"""Benchmark the state stores side by side: the memory store and the Redis store.

Not a test. Measures, for each store, with the same tenants, limits and requests:

- latency: one decision at a time (reserve), then its settlement; p50 / p99 / mean in µs.
  The memory store's latency is kvgate's own decision cost; the Redis store's is that plus
  one round trip and the script, i.e. what Redis adds per decision.
- throughput: `--concurrency` coroutines each looping reserve + settle for `--seconds`;
  decisions per second (one decision = one reserve; each also settles).
- a rejection that walks `--in-flight` leases to estimate Retry-After (KV budget full).

    .venv/bin/python bench/store_bench.py [--redis redis://127.0.0.1:6379/0] [--n 5000]

Every Redis key it writes carries a fresh prefix and is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import redis.asyncio as aioredis

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BucketSpec,
    BudgetRule,
    ConcurrencyRule,
    Period,
    RateRule,
    Reason,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
)
from kvgate.store import MemoryStore, RedisStore, StateStore

BACKEND = BackendLimits(
    "bench", kv_budget_tokens=10**9, kv_block_size=16, max_concurrent_requests=10**6
)
SMALL = BackendLimits(
    "bench-small", kv_budget_tokens=1_000_000, kv_block_size=16, max_concurrent_requests=10**6
)


def tenant_policy(i: int) -> TenantPolicy:
    """Every limit on: RPM, TPM, concurrency, a model scope, daily and monthly budgets."""
    scope = ScopeLimits(
        rpm=RateRule(BucketSpec(10**9, 10**9 / 60)),
        tpm=RateRule(BucketSpec(10**12, 10**12 / 60)),
        concurrency=ConcurrencyRule(10**6),
    )
    return TenantPolicy(
        name=f"tenant-{i}",
        limits=scope,
        model_limits=MappingProxyType({"model": scope}),
        budgets=(BudgetRule(Period.DAY, 10**20), BudgetRule(Period.MONTH, 10**21)),
    )


TENANTS = [tenant_policy(i) for i in range(50)]


def request(n: int, backend: BackendLimits = BACKEND) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=f"req-{n}",
        tenant=f"tenant-{n % len(TENANTS)}",
        model="model",
        backend=backend.name,
        prompt_tokens=800,
        max_new_tokens=256,
        cost_pico=1_234_567_890,
    )


@dataclass
class Result:
    store: str
    reserve_us: list[float]
    settle_us: list[float]
    decisions_per_s: float
    rejection_us: list[float]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(store: StateStore, n: int) -> tuple[list[float], list[float]]:
    reserve_us: list[float] = []
    settle_us: list[float] = []
    for i in range(n):
        policy = TENANTS[i % len(TENANTS)]
        started = time.perf_counter()
        decision = await store.reserve(request(i), BACKEND, policy)
        reserve_us.append((time.perf_counter() - started) * 1e6)
        assert decision.admitted and decision.reservation is not None
        started = time.perf_counter()
        await store.settle(
            decision.reservation,
            SettleCause.COMPLETED,
            ActualUsage(800, 100),
            cost_pico=999_999,
            tenant=policy,
        )
        settle_us.append((time.perf_counter() - started) * 1e6)
    return reserve_us, settle_us


async def throughput(store: StateStore, concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < deadline:
            policy = TENANTS[i % len(TENANTS)]
            decision = await store.reserve(request(i), BACKEND, policy)
            assert decision.reservation is not None
            await store.settle(
                decision.reservation,
                SettleCause.COMPLETED,
                ActualUsage(800, 100),
                cost_pico=999_999,
                tenant=policy,
            )
            done += 1
            i += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - started)


async def rejections(store: StateStore, in_flight: int, n: int) -> list[float]:
    """KV-budget rejections while `in_flight` leases are held (Retry-After walks them)."""
    per = SMALL.round_to_blocks(request(0, SMALL).cost_tokens)
    budget = BackendLimits(SMALL.name, per * in_flight, SMALL.kv_block_size, 10**6)
    for i in range(in_flight):
        decision = await store.reserve(request(i, SMALL), budget, TENANTS[i % len(TENANTS)])
        assert decision.admitted
    out: list[float] = []
    for i in range(n):
        started = time.perf_counter()
        decision = await store.reserve(request(i, SMALL), budget, TENANTS[i % len(TENANTS)])
        out.append((time.perf_counter() - started) * 1e6)
        assert decision.reason is Reason.KV_BUDGET_EXHAUSTED
    return out


async def run(name: str, make: Callable[[], StateStore], args: argparse.Namespace) -> Result:
    store = make()
    await latency(store, 200)  # warm-up (script load, connections, caches)
    reserve_us, settle_us = await latency(store, args.n)
    per_s = await throughput(make(), args.concurrency, args.seconds)
    rejection_us = await rejections(make(), args.in_flight, min(args.n, 1000))
    return Result(name, reserve_us, settle_us, per_s, rejection_us)


def row(label: str, values: list[float]) -> str:
    return (
        f"{label:<34} {statistics.median(values):>9.1f} {pct(values, 0.99):>9.1f}"
        f" {statistics.fmean(values):>9.1f}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--n", type=int, default=5000, help="sequential decisions per store")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, default=256)
    args = parser.parse_args()

    client = aioredis.Redis.from_url(args.redis, max_connections=args.concurrency + 8)
    tags: list[str] = []

    def redis_store() -> StateStore:
        store = RedisStore(
            client,
            lease_ttl_s=900,
            key_prefix=f"kvgate-bench-{uuid.uuid4().hex[:8]}",
            timeout_s=5,
            max_in_flight=args.concurrency,
        )
        tags.append(store.key_tag)
        return store

    try:
        memory = await run("memory", lambda: MemoryStore(lease_ttl_s=900), args)
        shared = await run("redis", redis_store, args)
    finally:
        for tag in tags:
            keys = [k async for k in client.scan_iter(match=f"{tag}*", count=1000)]
            if keys:
                await client.delete(*keys)
        server = await client.info("server")
        await client.aclose()

    print(
        f"python {platform.python_version()}, redis-server {server.get('redis_version')}, "
        f"{platform.machine()}; {args.n} sequential decisions, {args.concurrency} concurrent "
        f"workers for {args.seconds:g} s, rejections with {args.in_flight} leases in flight\n"
    )
    print(f"{'latency (µs)':<34} {'p50':>9} {'p99':>9} {'mean':>9}")
    for result in (memory, shared):
        print(row(f"{result.store}: reserve (one decision)", result.reserve_us))
        print(row(f"{result.store}: settle", result.settle_us))
        print(row(f"{result.store}: KV rejection + Retry-After", result.rejection_us))
    added = [statistics.median(shared.reserve_us) - statistics.median(memory.reserve_us)]
    print(f"\nadded by Redis per decision (p50): {added[0]:.1f} µs")
    print(f"\n{'throughput (reserve + settle)':<34} {'decisions/s':>12}")
    for result in (memory, shared):
        print(f"{result.store:<34} {result.decisions_per_s:>12,.0f}")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
