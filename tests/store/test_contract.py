"""The store contract: one behavioural suite, run against every store.

Every test takes `make_store` (tests/store/conftest.py), parametrized over the memory store,
the Redis store (standalone and a real Cluster) and the FallbackStore over Redis, and a
ManualClock shared by the store and the test.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from types import MappingProxyType

import pytest

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
    Reason,
    Reservation,
    ScopeLimits,
    SettleCause,
    TenantPolicy,
    UsageTotals,
)
from kvgate.store import StateStore
from tests.store.conftest import StoreFactory

B = BackendLimits(name="b", kv_budget_tokens=1000, kv_block_size=10, max_concurrent_requests=8)
HUGE = BackendLimits(
    name="huge", kv_budget_tokens=10**9, kv_block_size=16, max_concurrent_requests=10**6
)
KNOWN = {B.name: B, HUGE.name: HUGE}
FREE = TenantPolicy(name="t")


def req(
    prompt: int,
    max_new: int,
    *,
    tenant: str = "t",
    model: str = "m",
    backend: BackendLimits = B,
    cost: int = 0,
    rid: str = "r",
    request_slot_taken: bool = False,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid,
        tenant=tenant,
        model=model,
        backend=backend.name,
        prompt_tokens=prompt,
        max_new_tokens=max_new,
        cost_pico=cost,
        request_slot_taken=request_slot_taken,
    )


def tpm(capacity: float, refill: float | None = None, shadow: bool = False) -> RateRule:
    return RateRule(BucketSpec(capacity, capacity / 60 if refill is None else refill), shadow)


def rpm(limit: int, shadow: bool = False) -> RateRule:
    return RateRule(BucketSpec(limit, limit / 60), shadow)


def tenant(name: str = "t", **kwargs: object) -> TenantPolicy:
    return TenantPolicy(name=name, **kwargs)  # type: ignore[arg-type]


async def reserve(
    store: StateStore,
    request: AdmissionRequest,
    policy: TenantPolicy = FREE,
    backend: BackendLimits | None = None,
) -> Decision:
    backend = backend or KNOWN[request.backend]
    assert backend.name == request.backend
    return await store.reserve(request, backend, policy)


async def admitted(
    store: StateStore,
    request: AdmissionRequest,
    policy: TenantPolicy = FREE,
    backend: BackendLimits | None = None,
) -> Reservation:
    decision = await reserve(store, request, policy, backend)
    assert decision.admitted, decision
    assert decision.reservation is not None
    return decision.reservation


async def settle(
    store: StateStore,
    reservation: Reservation,
    prompt: int = 0,
    output: int = 0,
    *,
    cost: int = 0,
    policy: TenantPolicy = FREE,
    cause: SettleCause = SettleCause.COMPLETED,
    cached: int = 0,
) -> bool:
    settlement = await store.settle(
        reservation, cause, ActualUsage(prompt, output, cached), cost_pico=cost, tenant=policy
    )
    return settlement.applied


async def in_flight(store: StateStore, backend: str = "b") -> tuple[int, int]:
    for status in await store.backend_status():
        if status.name == backend:
            return status.kv_tokens_in_flight, status.requests_in_flight
    return 0, 0


# ---------------------------------------------------------------- all or nothing


async def test_admission_reserves_on_every_limit(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(10), tpm=tpm(1000), concurrency=ConcurrencyRule(5)),
        budgets=(BudgetRule(Period.DAY, 10**12),),
    )
    decision = await reserve(store, req(95, 100, cost=1234), policy)
    assert decision.admitted and decision.reason is Reason.ADMITTED
    assert decision.reservation is not None
    assert decision.reservation.kv_tokens == 200  # 195 rounded up to 10-token blocks
    assert decision.rate_limits is not None
    assert decision.rate_limits.limit_requests == 10
    assert decision.rate_limits.remaining_requests == 9
    assert decision.rate_limits.remaining_tokens == 805
    assert decision.rate_limits.reset_tokens_s == pytest.approx(195 * 60 / 1000)
    assert decision.budget_left_pico == 10**12  # before this request's reservation
    assert await in_flight(store) == (200, 1)


async def test_a_full_backend_takes_nothing_from_the_tenant(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(rpm=rpm(10), tpm=tpm(1000), concurrency=ConcurrencyRule(2)))
    first = await admitted(store, req(500, 500), FREE)  # another tenant fills the backend
    rejected = await reserve(store, req(50, 50), policy)
    assert rejected.reason is Reason.KV_BUDGET_EXHAUSTED
    assert rejected.rate_limits is not None
    assert rejected.rate_limits.remaining_tokens == 1000
    assert rejected.rate_limits.remaining_requests == 10
    assert await settle(store, first)
    one = await reserve(store, req(50, 50), policy)
    two = await reserve(store, req(50, 50), policy)
    assert one.admitted and two.admitted  # the concurrency slot was not taken by the rejection
    assert two.rate_limits is not None and two.rate_limits.remaining_tokens == 800


async def test_a_model_scope_rejection_takes_nothing_elsewhere(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(tpm=tpm(1000), concurrency=ConcurrencyRule(3)),
        model_limits=MappingProxyType({"m": ScopeLimits(tpm=tpm(150))}),
    )
    rejected = await reserve(store, req(100, 100), policy)
    assert rejected.reason is Reason.REQUEST_EXCEEDS_TPM
    assert rejected.retry_after_s is None
    assert "for model 'm'" in rejected.detail
    assert rejected.rate_limits is not None and rejected.rate_limits.remaining_tokens == 1000
    assert await in_flight(store) == (0, 0)
    other = await reserve(store, req(100, 100, model="other"), policy)
    assert other.admitted


# ---------------------------------------------------------------- each limit's boundary


async def test_rpm_boundary_and_refill(make_store: StoreFactory, clock: ManualClock) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(rpm=rpm(3)))
    for _ in range(3):
        await admitted(store, req(1, 1), policy)
    rejected = await reserve(store, req(1, 1), policy)
    assert rejected.reason is Reason.RPM_EXCEEDED
    assert rejected.retry_after_s == pytest.approx(20.0)  # one request refills in 60/3 s
    assert rejected.rate_limits is not None and rejected.rate_limits.remaining_requests == 0
    clock.advance(19)
    assert (await reserve(store, req(1, 1), policy)).reason is Reason.RPM_EXCEEDED
    clock.advance(1.5)
    assert (await reserve(store, req(1, 1), policy)).admitted


async def test_tpm_boundary_refund_and_overshoot(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(tpm=tpm(1000, refill=10)))
    too_big = await reserve(store, req(1000, 1, backend=HUGE), policy, HUGE)
    assert too_big.reason is Reason.REQUEST_EXCEEDS_TPM and too_big.retry_after_s is None
    full = await admitted(store, req(500, 500, backend=HUGE), policy, HUGE)  # exactly the capacity
    rejected = await reserve(store, req(0, 1, backend=HUGE), policy, HUGE)
    assert rejected.reason is Reason.TPM_EXCEEDED
    assert rejected.retry_after_s == 1.0  # 0.1 s, but Retry-After is at least 1 s
    assert "available 0, requested 1" in rejected.detail
    # Settlement refunds what was not used: 1000 reserved, 400 used.
    assert await settle(store, full, 300, 100, policy=policy)
    after = await reserve(store, req(300, 300, backend=HUGE), policy, HUGE)
    assert after.admitted and after.rate_limits is not None
    assert after.rate_limits.remaining_tokens == 0
    assert after.reservation is not None
    # An answer longer than reserved is charged: the bucket goes into debt.
    assert await settle(store, after.reservation, 300, 500, policy=policy)  # 200 over
    debt = await reserve(store, req(0, 1, backend=HUGE), policy, HUGE)
    assert debt.reason is Reason.TPM_EXCEEDED
    assert debt.retry_after_s == pytest.approx((1 + 200) / 10)
    clock.advance(20.2)
    assert (await reserve(store, req(0, 1, backend=HUGE), policy, HUGE)).admitted


async def test_tenant_concurrency_boundary(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(concurrency=ConcurrencyRule(2)))
    held = [await admitted(store, req(10, 10), policy) for _ in range(2)]
    rejected = await reserve(store, req(10, 10), policy)
    assert rejected.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
    assert rejected.retry_after_s is not None and rejected.retry_after_s >= 1
    assert rejected.detail == "Too many concurrent requests: limit 2."
    assert await settle(store, held[0], policy=policy)
    assert (await reserve(store, req(10, 10), policy)).admitted


async def test_model_scope_applies_to_its_model_only(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(
        model_limits=MappingProxyType({"m": ScopeLimits(concurrency=ConcurrencyRule(1))})
    )
    await admitted(store, req(10, 10), policy)
    rejected = await reserve(store, req(10, 10), policy)
    assert rejected.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
    assert rejected.detail == "Too many concurrent requests for model 'm': limit 1."
    assert rejected.violations[0].limit == "model:concurrency"
    assert (await reserve(store, req(10, 10, model="other"), policy)).admitted


async def test_budget_boundaries_are_exact_beyond_2_53(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    cost = 3 * 10**18 + 7  # far beyond 2**53: a double would lose the last digits
    cap = 3 * cost - 1
    policy = tenant(budgets=(BudgetRule(Period.DAY, cap), BudgetRule(Period.MONTH, 10 * cost)))
    first = await admitted(store, req(1, 1, cost=cost), policy)
    second = await reserve(store, req(1, 1, cost=cost), policy)
    assert second.admitted and second.budget_left_pico == cap - cost
    third = await reserve(store, req(1, 1, cost=cost), policy)
    assert third.reason is Reason.BUDGET_EXCEEDED
    assert third.budget_left_pico == cost - 1
    midnight = (clock.wall() // 86400 + 1) * 86400
    assert third.retry_after_s == pytest.approx(midnight - clock.wall())
    assert (await reserve(store, req(1, 1, cost=cost - 1), policy)).admitted  # exactly fits
    never = await reserve(store, req(1, 1, cost=10 * cost + 1), policy)
    assert never.reason is Reason.BUDGET_EXCEEDED and never.retry_after_s is None
    # Settlement moves the real cost from reserved to spent, to the pico-dollar.
    assert await settle(store, first, 1, 1, cost=cost - 12_345, policy=policy)
    day = datetime.fromtimestamp(clock.wall(), UTC).strftime("%Y-%m-%d")
    usage = await store.tenant_usage("t", [day])
    assert usage.spent_pico[day] == cost - 12_345
    assert usage.reserved_pico[day] == cost + (cost - 1)
    again = await reserve(store, req(1, 1, cost=12_345), policy)
    assert again.admitted and again.budget_left_pico == 12_345


async def test_backend_kv_rounding_and_boundaries(make_store: StoreFactory) -> None:
    store = make_store()
    for _ in range(5):
        reservation = await admitted(store, req(95, 100))
        assert reservation.kv_tokens == 200
    rejected = await reserve(store, req(1, 0))
    assert rejected.reason is Reason.KV_BUDGET_EXHAUSTED
    assert rejected.retry_after_s is not None and rejected.retry_after_s >= 1
    assert "has 0 of 1000 KV tokens free; this request needs 10" in rejected.detail
    never = await reserve(store, req(1000, 1))
    assert never.reason is Reason.REQUEST_EXCEEDS_KV_BUDGET and never.retry_after_s is None
    assert await in_flight(store) == (1000, 5)


async def test_backend_concurrency_boundary(make_store: StoreFactory) -> None:
    store = make_store()
    narrow = BackendLimits("b", kv_budget_tokens=1000, kv_block_size=10, max_concurrent_requests=2)
    held = [await admitted(store, req(1, 1), backend=narrow) for _ in range(2)]
    rejected = await reserve(store, req(1, 1), backend=narrow)
    assert rejected.reason is Reason.BACKEND_CONCURRENCY_LIMIT
    assert await settle(store, held[1])
    assert (await reserve(store, req(1, 1), backend=narrow)).admitted


# ---------------------------------------------------------------- shadow and choice


async def test_shadow_limits_are_reported_not_enforced(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(1, shadow=True), tpm=tpm(100, shadow=True)),
        budgets=(BudgetRule(Period.DAY, 10, shadow=True),),
    )
    first = await reserve(store, req(150, 50, cost=11), policy)
    assert first.admitted
    assert {(v.reason, v.shadow) for v in first.violations} == {
        (Reason.REQUEST_EXCEEDS_TPM, True),
        (Reason.BUDGET_EXCEEDED, True),
    }
    second = await reserve(store, req(1, 1), policy)
    assert second.admitted
    assert {v.reason for v in second.violations} == {
        Reason.RPM_EXCEEDED,
        Reason.TPM_EXCEEDED,
        Reason.BUDGET_EXCEEDED,  # the first request's reservation already went over
    }
    assert all(v.shadow for v in second.violations)
    assert second.budget_left_pico is None  # no enforced budget


async def test_the_longest_wait_is_reported(make_store: StoreFactory) -> None:
    store = make_store()
    # RPM waits 60 s, TPM about 0.06 s: RPM is the answer.
    policy = tenant(limits=ScopeLimits(rpm=rpm(1), tpm=tpm(1000)))
    await admitted(store, req(500, 500), policy)
    decision = await reserve(store, req(0, 1), policy)
    assert decision.reason is Reason.RPM_EXCEEDED
    assert {v.reason for v in decision.violations} == {Reason.RPM_EXCEEDED, Reason.TPM_EXCEEDED}
    # TPM waits 999 s, RPM 60 s: TPM is the answer.
    slow = tenant("u", limits=ScopeLimits(rpm=rpm(1), tpm=tpm(1000, refill=1)))
    await admitted(store, req(500, 500, tenant="u", backend=HUGE), slow, HUGE)
    assert (await reserve(store, req(0, 999, tenant="u", backend=HUGE), slow, HUGE)).reason is (
        Reason.TPM_EXCEEDED
    )
    # A limit waiting cannot fix (None) beats any wait.
    broke = tenant("v", limits=ScopeLimits(rpm=rpm(1)), budgets=(BudgetRule(Period.DAY, 5),))
    await admitted(store, req(1, 1, tenant="v", backend=HUGE), broke, HUGE)
    never = await reserve(store, req(1, 1, tenant="v", cost=6, backend=HUGE), broke, HUGE)
    assert never.reason is Reason.BUDGET_EXCEEDED and never.retry_after_s is None


# ---------------------------------------------------------------- the pre-check's RPM slot


async def precheck(
    store: StateStore, request: AdmissionRequest, policy: TenantPolicy, *, take: bool = True
) -> Decision | None:
    return await store.precheck(request, KNOWN[request.backend], policy, take_request_slot=take)


def remaining_requests(decision: Decision) -> int | None:
    assert decision.rate_limits is not None
    return decision.rate_limits.remaining_requests


async def test_a_passing_precheck_takes_one_request_from_every_rpm_scope(
    make_store: StoreFactory,
) -> None:
    """The RPM slot is taken before the prompt is tokenized."""
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(3)),
        model_limits=MappingProxyType({"m": ScopeLimits(rpm=rpm(1))}),
    )
    assert await precheck(store, req(1, 10, rid="a"), policy) is None
    # The model's bucket (1) is empty now: the next request for it is refused up front.
    refused = await precheck(store, req(1, 10, rid="b"), policy)
    assert refused is not None and refused.reason is Reason.RPM_EXCEEDED
    assert refused.violations[0].limit == "model:rpm"
    assert refused.retry_after_s == pytest.approx(60.0)
    assert remaining_requests(refused) == 2  # tenant-wide: exactly one taken
    # The reserve of the request that took its slot takes no other, in neither scope.
    held = await reserve(store, req(50, 50, rid="a", request_slot_taken=True), policy)
    assert held.admitted and remaining_requests(held) == 2
    assert not any(v.reason is Reason.RPM_EXCEEDED for v in held.violations)
    # Another model only meets the tenant-wide bucket: 2 left, then 1.
    assert await precheck(store, req(1, 10, model="o", rid="c"), policy) is None
    other = await reserve(store, req(50, 50, model="o", rid="c", request_slot_taken=True), policy)
    assert other.admitted and remaining_requests(other) == 1


async def test_a_rejecting_precheck_takes_nothing(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(rpm=rpm(2), concurrency=ConcurrencyRule(1)))
    held = await admitted(store, req(10, 10, rid="held"), policy)  # 1 request left
    for _ in range(3):
        busy = await precheck(store, req(1, 10, rid="busy"), policy)
        assert busy is not None and busy.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
        assert remaining_requests(busy) == 1
    assert await settle(store, held, policy=policy)
    assert await precheck(store, req(1, 10, rid="next"), policy) is None  # the last one
    over = await precheck(store, req(1, 10, rid="over"), policy)
    assert over is not None and over.reason is Reason.RPM_EXCEEDED
    assert over.retry_after_s == pytest.approx(30.0)  # 1 request refills in 60/2 s
    clock.advance(29)
    again = await precheck(store, req(1, 10, rid="over"), policy)
    assert again is not None and again.retry_after_s == pytest.approx(1.0)  # took nothing
    clock.advance(1)
    assert await precheck(store, req(1, 10, rid="over"), policy) is None


async def test_precheck_without_taking_changes_nothing(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(rpm=rpm(2)))
    for _ in range(3):
        assert await precheck(store, req(1, 10), policy, take=False) is None
    first = await reserve(store, req(10, 10, rid="a"), policy)
    assert first.admitted and remaining_requests(first) == 1
    # A reserve without the flag checks and takes RPM as before.
    assert (await reserve(store, req(10, 10, rid="b"), policy)).admitted
    assert (await reserve(store, req(10, 10, rid="c"), policy)).reason is Reason.RPM_EXCEEDED
    # The flag on a lower bound whose slot was taken already takes nothing more.
    assert await precheck(store, req(1, 10, rid="b", request_slot_taken=True), policy) is None
    late = await reserve(store, req(10, 10, rid="d"), policy)
    assert late.reason is Reason.RPM_EXCEEDED and late.retry_after_s == pytest.approx(30.0)


async def test_a_refused_or_abandoned_reserve_keeps_the_precheck_slot(
    make_store: StoreFactory,
) -> None:
    """The request was made: a refusal after the pre-check (here by TPM, once its size is
    known) or an abandon does not give its request back; an abandon still gives back what
    the reserve took (tokens, concurrency, money, KV)."""
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(3), tpm=tpm(1000, refill=1e-9), concurrency=ConcurrencyRule(1))
    )
    assert await precheck(store, req(1, 10, rid="big"), policy) is None
    refused = await reserve(store, req(2000, 10, rid="big", request_slot_taken=True), policy)
    assert refused.reason is Reason.REQUEST_EXCEEDS_TPM
    assert remaining_requests(refused) == 2
    assert await precheck(store, req(1, 10, rid="lost"), policy) is None
    lost = req(400, 400, rid="lost", request_slot_taken=True)
    taken = await reserve(store, lost, policy)
    assert taken.admitted and remaining_requests(taken) == 1
    await store.abandon(lost)
    assert await in_flight(store) == (0, 0)
    # Without the pre-check's slot, the reserve takes the last request itself.
    full = await reserve(store, req(500, 500, rid="full"), policy)
    assert full.admitted and remaining_requests(full) == 0
    assert full.rate_limits is not None and full.rate_limits.remaining_tokens == 0


async def test_shadow_rpm_at_the_precheck_never_refuses_and_is_reported(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    policy = tenant(limits=ScopeLimits(rpm=rpm(1, shadow=True)))
    decisions = []
    for rid in ("a", "b"):
        assert await precheck(store, req(1, 10, rid=rid), policy) is None
        decisions.append(
            await reserve(store, req(10, 10, rid=rid, request_slot_taken=True), policy)
        )
    assert all(d.admitted for d in decisions)
    assert decisions[0].violations == ()
    # The second request took from an empty bucket: the shadowed limit reports it.
    assert [(v.reason, v.shadow) for v in decisions[1].violations] == [(Reason.RPM_EXCEEDED, True)]
    assert remaining_requests(decisions[1]) == 0


# ---------------------------------------------------------------- settlement and leases


async def test_settlement_is_idempotent(make_store: StoreFactory) -> None:
    store = make_store()
    reservation = await admitted(store, req(95, 100))
    assert await settle(store, reservation, 95, 7, cost=10)
    assert not await settle(store, reservation, 95, 7, cost=10, cause=SettleCause.DISCONNECTED)
    totals = await store.usage_totals()
    assert totals == {("t", "m"): UsageTotals(1, 95, 7, 0, 10)}
    assert await in_flight(store) == (0, 0)


async def test_usage_is_booked_per_ledger_once(make_store: StoreFactory) -> None:
    """What kvgate booked for each backend (or pool endpoint) it sent requests to: the side
    reconciliation compares with the engines' own counters."""
    store = make_store()
    first = await admitted(store, req(95, 100, rid="a"))
    second = await admitted(store, req(10, 10, rid="b", model="other"))
    huge = await admitted(store, req(7, 7, rid="c", backend=HUGE))
    assert await settle(store, first, 95, 7, cost=10)
    assert await settle(store, second, 10, 3, cost=1, cause=SettleCause.DISCONNECTED)
    assert await settle(store, huge, 7, 2)
    assert not await settle(store, first, 95, 7, cost=10)  # a duplicate books nothing
    assert await store.backend_totals() == {
        B.name: UsageTotals(2, 105, 10, 0, 11),
        HUGE.name: UsageTotals(1, 7, 2, 0, 0),
    }


async def test_an_expired_lease_frees_capacity_and_is_still_billed_once(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """Lease expiry frees the capacity, the bill survives."""
    expired: list[Reservation] = []
    store = make_store(lease_ttl_s=30, on_lease_expired=expired.append)
    policy = tenant(
        limits=ScopeLimits(tpm=tpm(1000, refill=1e-9), concurrency=ConcurrencyRule(1)),
        budgets=(BudgetRule(Period.MONTH, 2000),),
    )
    lost = await admitted(store, req(400, 400, cost=600), policy)
    assert not (await reserve(store, req(10, 10, cost=1), policy)).admitted
    clock.advance(31)
    assert not await store.renew(lost)  # lost, even before a sweep noticed
    back = await reserve(store, req(400, 400, cost=600), policy)
    assert back.admitted  # slot, tokens, money and KV all came back
    assert back.rate_limits is not None and back.rate_limits.remaining_tokens == 200
    assert [r.reservation_id for r in expired] == [lost.reservation_id]
    assert expired[0].request.tenant == "t" and expired[0].kv_tokens == 800
    assert not await store.renew(lost)
    # The request ran on: its settlement is booked, once, and frees nothing twice.
    settlement = await store.settle(
        lost, SettleCause.COMPLETED, ActualUsage(400, 100), cost_pico=500, tenant=policy
    )
    assert settlement.applied and settlement.lease_expired
    again = await store.settle(
        lost, SettleCause.COMPLETED, ActualUsage(400, 100), cost_pico=500, tenant=policy
    )
    assert not again.applied and not again.lease_expired
    assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 400, 100, 0, 500)}
    assert await in_flight(store) == (800, 1)
    month = lost.hold.period_keys[1][1] if lost.hold else ""
    usage = await store.tenant_usage("t", [month])
    assert usage.spent_pico == {month: 500} and usage.reserved_pico == {month: 600}
    # Its 500 tokens were taken from the bucket too: 200 - 500 leaves a debt.
    debt = await reserve(store, req(0, 1, cost=0), policy)
    assert debt.reason is Reason.TPM_EXCEEDED
    assert debt.rate_limits is not None and debt.rate_limits.remaining_tokens == 0
    assert back.reservation is not None
    live = await store.settle(
        back.reservation, SettleCause.COMPLETED, ActualUsage(400, 400), cost_pico=600, tenant=policy
    )
    assert live.applied and not live.lease_expired


async def test_renewing_keeps_the_bill_and_an_abandoned_bill_lapses(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """A bill lives as long as its request is renewed, then lapses after its retention; a
    settlement after that (or a duplicate) books nothing."""
    store = make_store(lease_ttl_s=30, bill_retention_s=100)
    renewed = await admitted(store, req(10, 10, rid="renewed"))
    forgotten = await admitted(store, req(10, 10, rid="forgotten"))
    for _ in range(6):  # 300 s: the lease is lost after 30, the bill kept by each renewal
        clock.advance(50)
        assert not await store.renew(renewed)
    assert await in_flight(store) == (0, 0)
    assert not await settle(store, forgotten, 10, 1)  # lapsed 100 s after its reservation
    settlement = await store.settle(
        renewed, SettleCause.COMPLETED, ActualUsage(10, 2), cost_pico=3, tenant=FREE
    )
    assert settlement.applied and settlement.lease_expired
    assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 10, 2, 0, 3)}


async def test_a_late_duplicate_settlement_books_nothing(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    """Settling is idempotent without depending on a retention window."""
    store = make_store(lease_ttl_s=30)
    first = await admitted(store, req(10, 10, rid="a"))
    assert await settle(store, first, 10, 5, cost=7)
    for hours in (0.5, 2, 30, 24 * 40):
        clock.advance(hours * 3600)
        other = await admitted(store, req(1, 1, rid=f"o{hours}"))  # sweeps and trims
        assert await settle(store, other, 1, 1)
        assert not await settle(store, first, 10, 5, cost=7)
    assert (await store.usage_totals())[("t", "m")] == UsageTotals(5, 14, 9, 0, 7)


# ---------------------------------------------------------------- abandon (interrupted reserve)


async def test_abandon_releases_everything_a_reserve_took(make_store: StoreFactory) -> None:
    """The compensating release of a reserve whose outcome was lost."""
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(2), tpm=tpm(1000, refill=1e-9), concurrency=ConcurrencyRule(1)),
        budgets=(BudgetRule(Period.DAY, 1000),),
    )
    lost = req(400, 400, cost=600, rid="x")
    assert (await reserve(store, lost, policy)).admitted
    await store.abandon(lost)
    assert await in_flight(store) == (0, 0)
    await store.abandon(lost)  # idempotent
    assert await in_flight(store) == (0, 0)
    # The whole of every limit is back: the RPM request, the tokens, the money, the slot.
    full = await reserve(store, req(500, 500, cost=1000, rid="y"), policy)
    assert full.admitted and full.budget_left_pico == 1000
    assert full.rate_limits is not None
    assert full.rate_limits.remaining_requests == 1 and full.rate_limits.remaining_tokens == 0
    # A reserve for the abandoned request that lands late commits nothing.
    assert full.reservation is not None
    assert await settle(store, full.reservation, 0, 0, policy=policy)
    late = await reserve(store, lost, policy)
    assert not late.admitted and late.reservation is None
    assert await in_flight(store) == (0, 0)
    assert (await reserve(store, req(1, 1, rid="z"), policy)).admitted  # the slot is free
    assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 0, 0, 0, 0)}


async def test_abandon_is_harmless_when_nothing_was_committed(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store(lease_ttl_s=30)
    policy = tenant(limits=ScopeLimits(concurrency=ConcurrencyRule(2)))
    await store.abandon(req(1, 1, rid="never"))  # nothing reserved: nothing to release
    assert not (await reserve(store, req(1, 1, rid="never"), policy)).admitted
    kept = await admitted(store, req(95, 100, rid="kept"), policy)
    expired = await admitted(store, req(10, 10, rid="expired"), policy)
    clock.advance(20)
    assert await store.renew(kept)
    clock.advance(20)
    assert await in_flight(store) == (200, 1)  # `expired` was swept
    await store.abandon(expired.request)  # frees nothing twice
    assert await in_flight(store) == (200, 1)
    assert (await reserve(store, req(1, 1, rid="second"), policy)).admitted
    assert not await settle(store, expired, 10, 10)  # abandoned: nothing to bill
    assert await settle(store, kept, 95, 1)
    assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 95, 1, 0, 0)}
    # A request without an id cannot be told apart: abandon leaves it (and others) alone.
    anonymous = await admitted(store, req(1, 1, rid=""), policy)
    await store.abandon(req(1, 1, rid=""))
    assert await in_flight(store) == (20, 2)  # "second" and the anonymous one
    assert await settle(store, anonymous, 1, 1)
    assert (await reserve(store, req(1, 1, rid=""), policy)).admitted


async def test_renew_extends_a_lease(make_store: StoreFactory, clock: ManualClock) -> None:
    expired: list[Reservation] = []
    store = make_store(lease_ttl_s=30, on_lease_expired=expired.append)
    kept = await admitted(store, req(10, 10))
    clock.advance(20)
    assert await store.renew(kept)
    clock.advance(20)  # past the first expiry, not the renewed one
    assert await in_flight(store) == (20, 1)
    clock.advance(11)
    assert await in_flight(store) == (0, 0)
    assert [r.reservation_id for r in expired] == [kept.reservation_id]
    assert not await store.renew(kept)


# ---------------------------------------------------------------- ledger and reads


async def test_ledger_by_period_and_model(make_store: StoreFactory, clock: ManualClock) -> None:
    store = make_store()
    clock.advance(datetime(2027, 1, 31, 23, 59, 0, tzinfo=UTC).timestamp() - clock.wall())
    a = await admitted(store, req(10, 10, model="m1", cost=5))
    b = await admitted(store, req(20, 20, model="m2", cost=7))
    late = await admitted(store, req(30, 30, model="m1", cost=11))
    assert await settle(store, a, 10, 4, cost=3, cached=2)
    assert await settle(store, b, 20, 8, cost=6)
    clock.advance(120)  # 2027-02-01: a new day and a new month
    assert await settle(store, late, 30, 9, cost=10)  # booked to its admission's periods
    c = await admitted(store, req(5, 5, model="m1", cost=2))
    assert await settle(store, c, 5, 1, cost=1)

    keys = ["2027-01-31", "2027-01", "2027-02-01", "2027-02"]
    usage = await store.tenant_usage("t", keys)
    assert usage.by_period_model == {
        ("2027-01-31", "m1"): UsageTotals(2, 40, 13, 2, 13),
        ("2027-01-31", "m2"): UsageTotals(1, 20, 8, 0, 6),
        ("2027-01", "m1"): UsageTotals(2, 40, 13, 2, 13),
        ("2027-01", "m2"): UsageTotals(1, 20, 8, 0, 6),
        ("2027-02-01", "m1"): UsageTotals(1, 5, 1, 0, 1),
        ("2027-02", "m1"): UsageTotals(1, 5, 1, 0, 1),
    }
    assert usage.spent_pico == {"2027-01-31": 19, "2027-01": 19, "2027-02-01": 1, "2027-02": 1}
    assert usage.reserved_pico == dict.fromkeys(keys, 0)
    assert await store.usage_totals() == {
        ("t", "m1"): UsageTotals(3, 45, 14, 2, 14),
        ("t", "m2"): UsageTotals(1, 20, 8, 0, 6),
    }
    other = await store.tenant_usage("nobody", keys)
    assert other.by_period_model == {} and other.spent_pico == dict.fromkeys(keys, 0)


async def test_usage_shows_reserved_money_until_settlement(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(budgets=(BudgetRule(Period.DAY, 10**15),))
    held = await admitted(store, req(10, 10, cost=250), policy)
    day = held.hold.period_keys[0][1] if held.hold else ""
    usage = await store.tenant_usage("t", [day])
    assert usage.reserved_pico == {day: 250} and usage.spent_pico == {day: 0}
    assert await settle(store, held, 10, 10, cost=200, policy=policy)
    usage = await store.tenant_usage("t", [day])
    assert usage.reserved_pico == {day: 0} and usage.spent_pico == {day: 200}


async def test_backend_status(make_store: StoreFactory) -> None:
    store = make_store()
    await admitted(store, req(95, 100))
    await admitted(store, req(10, 10, backend=HUGE))
    await admitted(store, req(10, 10, backend=HUGE))
    statuses = sorted(await store.backend_status(), key=lambda s: s.name)
    assert [(s.name, s.kv_tokens_in_flight, s.requests_in_flight) for s in statuses] == [
        ("b", 200, 1),
        ("huge", 64, 2),
    ]
    assert statuses[0].kv_budget_tokens == 1000 and statuses[0].max_concurrent_requests == 8


async def test_limit_changes_keep_debt_and_grant_no_burst(make_store: StoreFactory) -> None:
    store = make_store()
    before = tenant(limits=ScopeLimits(tpm=tpm(1000, refill=1e-9)))
    await admitted(store, req(400, 400), before)
    smaller = tenant(limits=ScopeLimits(tpm=tpm(500, refill=1e-9)))
    assert (await reserve(store, req(100, 100), smaller)).admitted  # 200 left, 200 taken
    bigger = tenant(limits=ScopeLimits(tpm=tpm(5000, refill=1e-9)))
    decision = await reserve(store, req(0, 1), bigger)
    assert decision.reason is Reason.TPM_EXCEEDED  # no fresh burst on a raised limit


async def test_settlement_after_a_model_scope_is_removed(make_store: StoreFactory) -> None:
    store = make_store()
    scoped = tenant(
        limits=ScopeLimits(concurrency=ConcurrencyRule(1)),
        model_limits=MappingProxyType({"m": ScopeLimits(tpm=tpm(500))}),
    )
    held = await admitted(store, req(100, 100), scoped)
    reloaded = tenant(limits=ScopeLimits(concurrency=ConcurrencyRule(1)))
    assert await settle(store, held, 100, 100, policy=reloaded)
    assert (await reserve(store, req(100, 100), reloaded)).admitted  # the slot came back


async def test_retry_after_follows_the_learnt_throughput(
    make_store: StoreFactory, clock: ManualClock
) -> None:
    store = make_store()
    # One completed request teaches the backend: 0.1 s per token, 100 tokens per request.
    lesson = await admitted(store, req(10, 100))
    clock.advance(10)
    assert await settle(store, lesson, 10, 100)
    # A request that generated nothing (an embedding) teaches nothing about generating.
    pooled = await admitted(store, req(50, 0, rid="pooled"))
    clock.advance(30)
    assert await settle(store, pooled, 50, 0)
    first = await admitted(store, req(100, 400))  # KV 500, expected to finish in 10 s
    clock.advance(10)
    await admitted(store, req(100, 400, tenant="u"))  # KV 500, finishes 10 s after that
    clock.advance(2)
    rejected = await reserve(store, req(100, 500))  # needs 600: both must finish
    assert rejected.reason is Reason.KV_BUDGET_EXHAUSTED
    assert rejected.retry_after_s == 8.0
    # A tenant's concurrency waits only for that tenant's own work (on HUGE, which has learnt
    # nothing: 0.02 s per token, 256 tokens per request).
    narrow = tenant("n", limits=ScopeLimits(concurrency=ConcurrencyRule(1)))
    await admitted(store, req(1, 400, tenant="n", backend=HUGE), narrow, HUGE)  # expected in 5.12 s
    await admitted(store, req(1, 20, tenant="u", backend=HUGE), FREE, HUGE)  # expected in 0.4 s
    busy = await reserve(store, req(1, 1, tenant="n", backend=HUGE), narrow, HUGE)
    assert busy.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
    assert busy.retry_after_s == 6.0
    assert first.expires_at == first.started_at + 60


# ---------------------------------------------------------------- concurrency


@pytest.mark.parametrize(
    ("policy", "backend", "request_", "expected"),
    [
        (tenant(limits=ScopeLimits(tpm=tpm(1000, refill=1e-9))), HUGE, req(50, 50), 10),
        (tenant(limits=ScopeLimits(rpm=rpm(13))), HUGE, req(1, 1), 13),
        (tenant(limits=ScopeLimits(concurrency=ConcurrencyRule(7))), HUGE, req(1, 1), 7),
        (tenant(budgets=(BudgetRule(Period.DAY, 10**19),)), HUGE, req(1, 1, cost=3 * 10**17), 33),
        (FREE, B, req(95, 100), 5),
        (
            FREE,
            BackendLimits("b", kv_budget_tokens=10**6, kv_block_size=16, max_concurrent_requests=9),
            req(1, 1),
            9,
        ),
    ],
    ids=["tpm", "rpm", "tenant-concurrency", "budget", "kv", "backend-concurrency"],
)
async def test_concurrent_reserves_never_over_admit(
    make_store: StoreFactory,
    policy: TenantPolicy,
    backend: BackendLimits,
    request_: AdmissionRequest,
    expected: int,
) -> None:
    store = make_store()
    request_ = replace(request_, backend=backend.name)
    decisions = await asyncio.gather(
        *(store.reserve(request_, backend, policy) for _ in range(200))
    )
    assert sum(d.admitted for d in decisions) == expected
    assert len({d.reservation.reservation_id for d in decisions if d.reservation}) == expected


async def test_cache_hits_are_booked_in_the_ledger_beside_settled_requests(
    make_store: StoreFactory,
) -> None:
    """A hit adds to the hit count and the saved tokens, all-time and per period; it is
    neither a request nor tokens served."""
    store = make_store()
    reservation = await admitted(store, req(95, 100))
    assert await settle(store, reservation, 95, 7, cost=10)
    await store.record_cache_hit("t", "m", 102, ["2026-12-01", "2026-12"])
    await store.record_cache_hit("t", "m", 50, ["2026-12-01", "2026-12"])
    totals = (await store.usage_totals())[("t", "m")]
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens) == (1, 95, 7)
    assert (totals.cache_hits, totals.cache_saved_tokens) == (2, 152)
    usage = await store.tenant_usage("t", ["2026-12-01", "2026-12", "2026-11"])
    for period in ("2026-12-01", "2026-12"):
        booked = usage.by_period_model[(period, "m")]
        assert (booked.cache_hits, booked.cache_saved_tokens) == (2, 152)
    assert ("2026-11", "m") not in usage.by_period_model
