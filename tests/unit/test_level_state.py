"""Level state (a tenant's teams, users and keys) stays bounded in the memory store, and
whatever sequence of reserves, settlements, abandons and expiries runs over the levels,
nothing stays in flight or reserved."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BucketSpec,
    BudgetRule,
    ConcurrencyRule,
    Level,
    LevelKind,
    ManualClock,
    Period,
    RateRule,
    Reservation,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
    period_key,
)
from kvgate.policy.tenant import LEVEL_LEDGER_KEEP_S
from kvgate.store import MemoryStore
from kvgate.store.memory import LEVEL_PRUNE_INTERVAL_S

B = BackendLimits(name="b", kv_budget_tokens=10**6, kv_block_size=1, max_concurrent_requests=64)
LIMITS = ScopeLimits(
    rpm=RateRule(BucketSpec(60, 1.0)),
    tpm=RateRule(BucketSpec(1000, 1000 / 60)),
    concurrency=ConcurrencyRule(3),
)


def user(name: str) -> Level:
    return Level(LevelKind.USER, name, LIMITS, (BudgetRule(Period.DAY, 10**6),))


def caller(*levels: Level) -> TenantPolicy:
    return TenantPolicy(name="t").with_levels(levels)


def req(rid: str, cost: int = 10) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid,
        tenant="t",
        model="m",
        backend="b",
        prompt_tokens=10,
        max_new_tokens=10,
        cost_pico=cost,
    )


async def serve(store: MemoryStore, policy: TenantPolicy, rid: str) -> Reservation:
    decision = await store.reserve(req(rid), B, policy)
    assert decision.admitted and decision.reservation is not None, decision
    return decision.reservation


async def test_idle_level_scopes_are_pruned_and_busy_ones_kept() -> None:
    clock = ManualClock()
    store = MemoryStore(lease_ttl_s=600, clock=clock)
    for n in range(200):
        policy = caller(user(f"u{n}"))
        held = await serve(store, policy, f"r{n}")
        await store.settle(
            held, SettleCause.COMPLETED, ActualUsage(10, 10), cost_pico=5, tenant=policy
        )
    busy = caller(user("busy"))
    await serve(store, busy, "busy")
    assert store.prune_idle_levels() == 0  # every bucket is still refilling
    clock.advance(2)  # every bucket is full again
    assert store.prune_idle_levels() == 200  # the busy user's scope stays
    assert store.prune_idle_levels() == 0
    # A pruned user is a fresh one with its money kept: its budget still counts.
    tight = replace(user("u0"), budgets=(BudgetRule(Period.DAY, 12),))
    refused = await store.reserve(req("again"), B, caller(tight))
    assert not refused.admitted and {v.limit for v in refused.violations} == {"user:budget_day"}
    day = period_key(Period.DAY, clock.wall())
    usage = await store.tenant_usage("t", [day], levels=["@user:u0"])
    assert usage.level_spent_pico == {("@user:u0", day): 5}
    # Long after, the idle users' money goes too; the busy one's (money reserved) stays.
    clock.advance(LEVEL_LEDGER_KEEP_S)
    # A day and a month entry per idle user, and u0's scope the refusal looked at; the busy
    # user's lease is not swept yet: its scope and money stay.
    assert store.prune_idle_levels() == 2 * 200 + 1
    assert store.prune_idle_levels() == 0
    usage = await store.tenant_usage("t", [day], levels=["@user:u0"])
    assert usage.level_spent_pico == {("@user:u0", day): 0}


async def test_the_sweep_prunes_idle_levels_on_its_own() -> None:
    clock = ManualClock()
    store = MemoryStore(lease_ttl_s=600, clock=clock)
    await store.backend_status()  # the first sweep's prune
    for n in range(50):
        policy = caller(user(f"u{n}"))
        held = await serve(store, policy, f"r{n}")
        await store.settle(
            held, SettleCause.COMPLETED, ActualUsage(10, 10), cost_pico=5, tenant=policy
        )
    clock.advance(LEVEL_PRUNE_INTERVAL_S)
    await store.backend_status()  # sweeps, and prunes
    assert store.prune_idle_levels() == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "settle", "abandon", "expire", "wait"]),
        st.integers(0, 3),  # which user (with the team)
        st.integers(0, 40),  # tokens used, or the cost
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_any_sequence_over_levels_returns_in_flight_and_reserved_to_zero(
    ops: list[tuple[str, int, int]],
) -> None:
    asyncio.run(_run(ops))


async def _run(ops: list[tuple[str, int, int]]) -> None:
    clock = ManualClock()
    store = MemoryStore(lease_ttl_s=30, clock=clock)
    team = Level(LevelKind.TEAM, "research", LIMITS, (BudgetRule(Period.MONTH, 10**6),))
    policies = [caller(team, user(f"u{n}")) for n in range(4)]
    open_: list[tuple[Reservation, TenantPolicy]] = []
    for step, (op, who, amount) in enumerate(ops):
        policy = policies[who]
        if op == "reserve":
            decision = await store.reserve(req(f"r{step}", cost=amount), B, policy)
            if decision.reservation is not None:
                open_.append((decision.reservation, policy))
        elif op in ("settle", "abandon") and open_:
            reservation, owner = open_.pop(who % len(open_))
            if op == "settle":
                await store.settle(
                    reservation,
                    SettleCause.COMPLETED,
                    ActualUsage(10, amount % 11),
                    cost_pico=amount,
                    tenant=owner,
                )
            else:
                await store.abandon(reservation.request)
        elif op == "expire":
            clock.advance(31)
            await store.backend_status()
        elif op == "wait":
            clock.advance(amount)
    for reservation, owner in open_:
        await store.settle(
            reservation, SettleCause.COMPLETED, ActualUsage(1, 1), cost_pico=0, tenant=owner
        )
    state = store._tenants.get("t")  # the state itself: what must have come back to zero
    if state is None:
        return
    assert all(scope.in_flight == 0 for scope in state.scopes.values())
    assert all(amount == 0 for amount in state.reserved.values())
    assert all(amount == 0 for amount in state.level_reserved.values())
    assert all(status.requests_in_flight == 0 for status in await store.backend_status())
