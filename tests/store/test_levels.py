"""Team, user and key levels under a tenant, against every store (the contract's factory):
each level's limits and budgets are checked and reserved in the tenant's one atomic step."""

from __future__ import annotations

import pytest

from kvgate.policy import (
    ActualUsage,
    BudgetRule,
    ConcurrencyRule,
    Level,
    LevelKind,
    ManualClock,
    Period,
    Reason,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
    period_key,
    requests_only,
    shadowed,
)
from kvgate.store.redis_store import RedisStore
from tests.store.conftest import StoreFactory
from tests.store.test_contract import B, admitted, in_flight, req, reserve, rpm, settle, tpm


def team(name: str = "research", **kwargs: object) -> Level:
    return Level(LevelKind.TEAM, name, **kwargs)  # type: ignore[arg-type]


def user(name: str = "bob", **kwargs: object) -> Level:
    return Level(LevelKind.USER, name, **kwargs)  # type: ignore[arg-type]


def key(name: str = "key_0123abcd", **kwargs: object) -> Level:
    return Level(LevelKind.KEY, name, **kwargs)  # type: ignore[arg-type]


def caller(*levels: Level, **kwargs: object) -> TenantPolicy:
    return TenantPolicy(name="t", **kwargs).with_levels(levels)  # type: ignore[arg-type]


def labels(decision: object) -> set[str]:
    return {v.limit for v in decision.violations}  # type: ignore[attr-defined]


async def test_team_rpm_refuses_while_the_tenant_has_room(make_store: StoreFactory) -> None:
    store = make_store()
    policy = caller(team(limits=ScopeLimits(rpm=rpm(1))), limits=ScopeLimits(rpm=rpm(100)))
    await admitted(store, req(10, 10, rid="a"), policy)
    refused = await reserve(store, req(10, 10, rid="b"), policy)
    assert not refused.admitted
    assert refused.reason is Reason.RPM_EXCEEDED
    assert labels(refused) == {"team:rpm"}
    assert "for team 'research'" in refused.detail
    # Another team of the same tenant is not held back by this one.
    other = caller(team("infra", limits=ScopeLimits(rpm=rpm(1))), limits=ScopeLimits(rpm=rpm(100)))
    await admitted(store, req(10, 10, rid="c"), other)


async def test_a_level_tpm_refusal_names_the_level(make_store: StoreFactory) -> None:
    store = make_store()
    policy = caller(team(limits=ScopeLimits(tpm=tpm(1000, refill=0.001))))
    await admitted(store, req(800, 80, rid="a"), policy)
    refused = await reserve(store, req(100, 30, rid="b"), policy)
    assert refused.reason is Reason.TPM_EXCEEDED
    assert refused.detail == (
        "Rate limit reached for tokens per minute for team 'research': limit 1000, "
        "available 120, requested 130."
    )
    assert labels(refused) == {"team:tpm"}


async def test_a_key_budget_refuses_that_key_while_another_key_passes(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    first = caller(key("key_a", budgets=(BudgetRule(Period.DAY, 100),)))
    second = caller(key("key_b", budgets=(BudgetRule(Period.DAY, 100),)))
    held = await admitted(store, req(10, 10, rid="a", cost=60), first)
    assert await settle(store, held, 10, 10, cost=60, policy=first)
    refused = await reserve(store, req(10, 10, rid="b", cost=60), first)
    assert refused.reason is Reason.BUDGET_EXCEEDED
    assert refused.detail == "The daily budget of key 'key_a' is exhausted."
    assert labels(refused) == {"key:budget_day"}
    assert refused.level_budget_refused
    assert refused.budget_left_pico is None  # the tenant has no budget of its own
    await admitted(store, req(10, 10, rid="c", cost=60), second)


async def test_a_level_budget_holds_money_in_flight(make_store: StoreFactory) -> None:
    store = make_store()
    policy = caller(user(budgets=(BudgetRule(Period.MONTH, 100),)))
    held = await admitted(store, req(10, 10, rid="a", cost=60), policy)
    refused = await reserve(store, req(10, 10, rid="b", cost=60), policy)
    assert labels(refused) == {"user:budget_month"}
    assert refused.detail == "The monthly budget of user 'bob' is exhausted."
    # Settled cheaper than reserved: the rest of the hold comes back.
    assert await settle(store, held, 10, 1, cost=20, policy=policy)
    await admitted(store, req(10, 10, rid="c", cost=60), policy)


async def test_user_concurrency_is_freed_at_settle_abandon_and_expiry(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store(lease_ttl_s=30)
    policy = caller(user(limits=ScopeLimits(concurrency=ConcurrencyRule(1))))
    first = await admitted(store, req(10, 10, rid="a"), policy)
    refused = await reserve(store, req(10, 10, rid="b"), policy)
    assert refused.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
    assert labels(refused) == {"user:concurrency"}
    assert "for user 'bob'" in refused.detail
    assert await settle(store, first, 10, 10, policy=policy)
    await admitted(store, req(10, 10, rid="c"), policy)
    await store.abandon(req(10, 10, rid="c"))
    await admitted(store, req(10, 10, rid="d"), policy)
    clock.advance(31)
    assert await in_flight(store) == (0, 0)  # the status sweep expired the lease
    await admitted(store, req(10, 10, rid="e"), policy)


async def test_each_level_reports_its_spend_per_period(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    research, bob = team(), user()
    policy = caller(research, bob)
    held = await admitted(store, req(10, 10, rid="a", cost=90), policy)
    assert await settle(store, held, 10, 5, cost=70, policy=policy)
    alone = await admitted(store, req(10, 10, rid="b", cost=9), caller(research))
    assert await settle(store, alone, 10, 5, cost=5, policy=caller(research))
    day = period_key(Period.DAY, clock.wall())
    month = period_key(Period.MONTH, clock.wall())
    usage = await store.tenant_usage(
        "t", [day, month], levels=[research.scope_key, bob.scope_key, "@key:unused"]
    )
    assert usage.level_spent_pico == {
        ("@team:research", day): 75,
        ("@team:research", month): 75,
        ("@user:bob", day): 70,
        ("@user:bob", month): 70,
        ("@key:unused", day): 0,
        ("@key:unused", month): 0,
    }
    assert usage.spent_pico == {day: 75, month: 75}  # the tenant's own ledger, as before
    assert usage.reserved_pico == {day: 0, month: 0}
    assert (await store.tenant_usage("t", [day])).level_spent_pico == {}


async def test_shadowed_levels_are_only_reported(make_store: StoreFactory) -> None:
    store = make_store()
    policy = shadowed(
        caller(
            team(
                limits=ScopeLimits(rpm=rpm(1), concurrency=ConcurrencyRule(1)),
                budgets=(BudgetRule(Period.DAY, 10),),
            )
        )
    )
    await admitted(store, req(10, 10, rid="a", cost=8), policy)
    passed = await reserve(store, req(10, 10, rid="b", cost=8), policy)
    assert passed.admitted
    assert labels(passed) == {"team:rpm", "team:concurrency", "team:budget_day"}
    assert all(v.shadow for v in passed.violations)


async def test_a_level_refusal_reserves_nothing_anywhere(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    tenant_limits = ScopeLimits(rpm=rpm(2), tpm=tpm(1000, refill=0.001))
    budgets = (BudgetRule(Period.DAY, 1000),)
    narrow = caller(
        team(limits=ScopeLimits(tpm=tpm(100, refill=0.001))),
        user(budgets=(BudgetRule(Period.DAY, 1000),)),
        limits=tenant_limits,
        budgets=budgets,
    )
    refused = await reserve(store, req(100, 50, rid="a", cost=400), narrow)
    assert refused.reason is Reason.REQUEST_EXCEEDS_TPM
    assert labels(refused) == {"team:tpm"}
    assert await in_flight(store) == (0, 0)
    day = period_key(Period.DAY, clock.wall())
    usage = await store.tenant_usage("t", [day], levels=["@user:bob"])
    assert usage.reserved_pico == {day: 0}
    # The tenant's buckets and budget and the user's budget are whole: a request taking
    # the tenant's every token and the whole budget still passes, twice for RPM.
    wide = caller(
        user(budgets=(BudgetRule(Period.DAY, 1000),)), limits=tenant_limits, budgets=budgets
    )
    await admitted(store, req(10, 10, rid="b"), wide)
    await admitted(store, req(900, 80, rid="c", cost=1000), wide)


async def test_requests_only_and_the_precheck_take_the_levels_rpm(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    policy = caller(
        key(limits=ScopeLimits(rpm=rpm(1), tpm=tpm(10)), budgets=(BudgetRule(Period.DAY, 1),))
    )
    only = requests_only(policy)
    assert only.levels[0].limits == ScopeLimits(rpm=rpm(1)) and only.levels[0].budgets == ()
    bound = req(1, 100, rid="a", backend=B)
    assert await store.precheck(bound, B, only, take_request_slot=True) is None
    refused = await store.precheck(req(1, 100, rid="b"), B, only, take_request_slot=True)
    assert refused is not None and labels(refused) == {"key:rpm"}
    assert "for key 'key_0123abcd'" in refused.detail


async def test_the_precheck_slot_counts_for_the_reserve(make_store: StoreFactory) -> None:
    store = make_store()
    policy = caller(team(limits=ScopeLimits(rpm=rpm(1))))
    assert await store.precheck(req(1, 1, rid="a"), B, policy, take_request_slot=True) is None
    await admitted(store, req(5, 5, rid="a", request_slot_taken=True), policy)
    refused = await store.precheck(req(1, 1, rid="b"), B, policy, take_request_slot=True)
    assert refused is not None and labels(refused) == {"team:rpm"}


async def test_a_sweep_under_another_callers_rules_keeps_a_levels_buckets(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """The tenant's last reservation was another user's: an expired lease of the first user
    still gives its tokens back to that user's bucket."""
    store = make_store(lease_ttl_s=30)
    slow = ScopeLimits(tpm=tpm(100, refill=0.001))
    alice = caller(user("alice", limits=slow))
    await admitted(store, req(60, 40, rid="a"), alice)
    await admitted(store, req(10, 10, rid="b"), caller(user("carol", limits=slow)))
    clock.advance(31)
    assert await in_flight(store) == (0, 0)
    await admitted(store, req(60, 40, rid="c"), alice)


async def test_a_settle_of_an_expired_lease_charges_the_levels(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store(lease_ttl_s=30)
    policy = caller(team(limits=ScopeLimits(tpm=tpm(100, refill=0.001))))
    held = await admitted(store, req(50, 30, rid="a", cost=10), policy)
    clock.advance(31)
    assert await in_flight(store) == (0, 0)
    settlement = await store.settle(
        held, SettleCause.COMPLETED, ActualUsage(50, 30), cost_pico=7, tenant=policy
    )
    assert settlement.applied and settlement.lease_expired
    refused = await reserve(store, req(20, 10, rid="b"), policy)  # 80 of 100 used
    assert labels(refused) == {"team:tpm"}
    day = period_key(Period.DAY, clock.wall())
    usage = await store.tenant_usage("t", [day], levels=["@team:research"])
    assert usage.level_spent_pico == {("@team:research", day): 7}


@pytest.mark.parametrize("make_store", ["redis", "redis-cluster"], indirect=True)
async def test_redis_level_scopes_expire_when_idle_and_never_while_in_flight(
    make_store: StoreFactory,
) -> None:
    """The Redis keys of level scopes (the memory store's pruning: test_level_state.py)."""
    store = make_store()
    assert isinstance(store, RedisStore)
    policy = caller(user(limits=ScopeLimits(rpm=rpm(60), concurrency=ConcurrencyRule(2))))
    scope = f"{store.key_tag}:ls|t|@user:bob"
    held = await admitted(store, req(10, 10, rid="a", cost=5), policy)
    assert await store.client.ttl(scope) == -1  # in flight: kept
    assert await settle(store, held, 10, 10, cost=5, policy=policy)
    # Idle: gone once its bucket is full again (1 s to refill one request) plus a grace.
    assert 0 < await store.client.ttl(scope) <= 61 + 1
    # Its money per period (day and month) is kept long after its last change, not forever.
    money = [k async for k in store.client.scan_iter(match=f"{store.key_tag}:lm|t|*")]
    assert len(money) == 2
    for name in money:
        assert 0 < await store.client.ttl(name) <= 40 * 86400
