"""The Redis store answers exactly as the memory store does: random runs, compared step by step.

Both stores get the same random sequence of reservations (half of them after a pre-check that
takes the RPM request), settlements (short, exact and overshooting answers; of live and of
expired leases), lease renewals, abandoned reserves, limit reloads and clock moves, on one
ManualClock. Every decision and pre-check (reason, detail, Retry-After, violations,
x-ratelimit-* view, budget left, reservation), every settlement, every expired lease and the
final ledgers must be equal.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BucketSpec,
    BudgetRule,
    ConcurrencyRule,
    Decision,
    ManualClock,
    Period,
    RateRule,
    Reservation,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
)
from kvgate.store import MemoryStore
from kvgate.store.redis_store import RedisStore
from tests.store.conftest import REDIS_URL, delete_prefix

BACKENDS = [
    BackendLimits("b1", kv_budget_tokens=4000, kv_block_size=16, max_concurrent_requests=6),
    BackendLimits("b2", kv_budget_tokens=2000, kv_block_size=10, max_concurrent_requests=50),
]
MODELS = {"m1": "b1", "m2": "b1", "m3": "b2"}


def random_policy(rng: random.Random, name: str) -> TenantPolicy:
    def scope() -> ScopeLimits:
        return ScopeLimits(
            rpm=RateRule(
                BucketSpec(rng.choice([2, 5, 30]), rng.choice([2, 5, 30]) / 60), rng.random() < 0.2
            )
            if rng.random() < 0.6
            else None,
            tpm=RateRule(
                BucketSpec(rng.choice([500, 1500, 4000]), rng.choice([1000 / 60, 7.5, 100.0])),
                rng.random() < 0.2,
            )
            if rng.random() < 0.7
            else None,
            concurrency=ConcurrencyRule(rng.choice([1, 2, 4]), rng.random() < 0.2)
            if rng.random() < 0.5
            else None,
        )

    budgets = []
    if rng.random() < 0.6:
        budgets.append(BudgetRule(Period.DAY, rng.choice([10**9, 5 * 10**17]), rng.random() < 0.2))
    if rng.random() < 0.4:
        budgets.append(BudgetRule(Period.MONTH, rng.choice([3 * 10**9, 10**18]), False))
    model_limits = {m: scope() for m in MODELS if rng.random() < 0.3}
    return TenantPolicy(
        name=name,
        limits=scope(),
        model_limits=MappingProxyType(model_limits),
        budgets=tuple(budgets),
    )


def comparable(decision: Decision) -> Any:
    """A decision without its random reservation id."""
    reservation = decision.reservation
    if reservation is not None:
        reservation = replace(reservation, reservation_id="-")
    return replace(decision, reservation=reservation)


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("EQ_SEEDS", "6"))))
async def test_redis_store_matches_memory_store(seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock(start=1000.0, wall_start=1_780_012_800.0 + 86400 - 400)  # near midnight
    mem_expired: list[Reservation] = []
    red_expired: list[Reservation] = []
    memory = MemoryStore(lease_ttl_s=30, clock=clock, on_lease_expired=mem_expired.append)
    client = aioredis.Redis.from_url(REDIS_URL)
    redis_store = RedisStore(
        client,
        lease_ttl_s=30,
        key_prefix=f"kvgate-eq-{uuid.uuid4().hex[:12]}",
        timeout_s=5.0,
        clock=clock,
        on_lease_expired=red_expired.append,
    )
    policies = {name: random_policy(rng, name) for name in ("a", "b", "c")}
    # Open reservations, paired: (memory's, redis's).
    open_: list[tuple[Reservation, Reservation]] = []
    ids: dict[str, str] = {}  # redis id -> memory id
    try:
        for step in range(300):
            roll = rng.random()
            if roll < 0.5:
                tenant = rng.choice(list(policies))
                model = rng.choice(list(MODELS))
                backend = next(b for b in BACKENDS if b.name == MODELS[model])
                request = AdmissionRequest(
                    request_id=f"r{step}",
                    tenant=tenant,
                    model=model,
                    backend=backend.name,
                    prompt_tokens=rng.randint(1, 900),
                    max_new_tokens=rng.randint(1, 700),
                    choices=rng.choice([1, 1, 1, 2]),
                    cost_pico=rng.choice([0, rng.randint(1, 10**8), rng.randint(1, 10**17)]),
                )
                if rng.random() < 0.5:
                    # The pre-check on a lower bound, taking the RPM request when it passes
                    # (before the prompt is counted); the reserve then says whether it was taken.
                    bound = replace(
                        request,
                        prompt_tokens=1,
                        cost_pico=request.cost_pico // rng.choice([1, 3]),
                    )
                    want_p = await memory.precheck(
                        bound, backend, policies[tenant], take_request_slot=True
                    )
                    got_p = await redis_store.precheck(
                        bound, backend, policies[tenant], take_request_slot=True
                    )
                    assert got_p == want_p, f"step {step}"
                    request = replace(request, request_slot_taken=want_p is None)
                want = await memory.reserve(request, backend, policies[tenant])
                got = await redis_store.reserve(request, backend, policies[tenant])
                assert comparable(got) == comparable(want), f"step {step}"
                if want.reservation is not None and got.reservation is not None:
                    open_.append((want.reservation, got.reservation))
                    ids[got.reservation.reservation_id] = want.reservation.reservation_id
            elif roll < 0.75 and open_:
                mem_res, red_res = open_.pop(rng.randrange(len(open_)))
                tokens = red_res.request.cost_tokens
                usage = ActualUsage(
                    prompt_tokens=red_res.request.prompt_tokens,
                    output_tokens=rng.choice([0, rng.randint(0, tokens), tokens + 50]),
                    cached_tokens=rng.choice([0, 3]),
                )
                cause = rng.choice(list(SettleCause))
                cost = rng.randint(0, 10**16)
                policy = policies[red_res.request.tenant]
                want_s = await memory.settle(mem_res, cause, usage, cost_pico=cost, tenant=policy)
                got_s = await redis_store.settle(
                    red_res, cause, usage, cost_pico=cost, tenant=policy
                )
                assert replace(got_s, reservation_id="-") == replace(want_s, reservation_id="-"), (
                    f"step {step}"
                )
                if rng.random() < 0.1:  # settle twice: applies nothing
                    assert not (
                        await redis_store.settle(red_res, cause, usage, cost_pico=1, tenant=policy)
                    ).applied
                    assert not (
                        await memory.settle(mem_res, cause, usage, cost_pico=1, tenant=policy)
                    ).applied
            elif roll < 0.82 and open_:
                mem_res, red_res = rng.choice(open_)
                assert await redis_store.renew(red_res) == await memory.renew(mem_res)
            elif roll < 0.84 and open_:
                # An interrupted reserve: the compensating release.
                mem_res, red_res = open_.pop(rng.randrange(len(open_)))
                await memory.abandon(mem_res.request)
                await redis_store.abandon(red_res.request)
                backend = next(b for b in BACKENDS if b.name == red_res.request.backend)
                policy = policies[red_res.request.tenant]
                # A late copy of the reserve commits nothing (and sweeps as any reserve).
                want = await memory.reserve(mem_res.request, backend, policy)
                got = await redis_store.reserve(red_res.request, backend, policy)
                assert not got.admitted and got == want, f"step {step}"
            elif roll < 0.86:
                name = rng.choice(list(policies))
                policies[name] = random_policy(rng, name)  # a reload
            elif roll < 0.9:
                assert sorted(await redis_store.backend_status(), key=lambda s: s.name) == sorted(
                    await memory.backend_status(), key=lambda s: s.name
                )
            else:
                clock.advance(rng.choice([1, 2, 5, 13, 31]))
            # The same leases expire at the same step (the order within a sweep is free).
            assert sorted(ids[r.reservation_id] for r in red_expired) == sorted(
                r.reservation_id for r in mem_expired
            ), f"step {step}"

        assert await redis_store.usage_totals() == await memory.usage_totals()
        day = Period.DAY
        keys = {
            key
            for mem_res, _ in open_
            for _, key in (mem_res.hold.period_keys if mem_res.hold else ())
        } | {"2026-05-29", "2026-05-30", "2026-05"}
        for name in policies:
            assert await redis_store.tenant_usage(name, keys) == await memory.tenant_usage(
                name, keys
            ), (name, day)
    finally:
        await delete_prefix(client, redis_store.key_tag)
        await client.aclose()
