"""The memory store: atomic reserve, idempotent settle, leases, ledger."""

from __future__ import annotations

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    ManualClock,
    Reason,
    Reservation,
    SettleCause,
    TenantPolicy,
)
from kvgate.store import MemoryStore

TENANT = TenantPolicy(name="t")
LIMITS = BackendLimits(
    name="b", kv_budget_tokens=1_000, kv_block_size=10, max_concurrent_requests=8
)


def req(prompt: int, max_new: int, tenant: str = "t") -> AdmissionRequest:
    return AdmissionRequest(
        request_id="r",
        tenant=tenant,
        model="m",
        backend="b",
        prompt_tokens=prompt,
        max_new_tokens=max_new,
    )


async def test_settle_releases_and_records_exactly_once() -> None:
    store = MemoryStore(lease_ttl_s=60, clock=ManualClock())
    decision = await store.reserve(req(95, 100), LIMITS, TENANT)
    assert decision.admitted and decision.reservation is not None
    assert decision.reservation.kv_tokens == 200
    usage = ActualUsage(prompt_tokens=95, output_tokens=7)
    first = await store.settle(
        decision.reservation, SettleCause.COMPLETED, usage, cost_pico=0, tenant=TENANT
    )
    second = await store.settle(
        decision.reservation, SettleCause.DISCONNECTED, usage, cost_pico=0, tenant=TENANT
    )
    assert first.applied and not second.applied
    totals = await store.usage_totals()
    assert totals[("t", "m")].requests == 1
    assert totals[("t", "m")].prompt_tokens == 95
    assert totals[("t", "m")].output_tokens == 7
    [status] = await store.backend_status()
    assert status.kv_tokens_in_flight == 0 and status.requests_in_flight == 0


async def test_full_backend_rejects_until_capacity_returns() -> None:
    store = MemoryStore(lease_ttl_s=60, clock=ManualClock())
    held: list[Reservation] = []
    for _ in range(5):
        decision = await store.reserve(req(100, 100), LIMITS, TENANT)
        assert decision.admitted and decision.reservation
        held.append(decision.reservation)
    rejected = await store.reserve(req(100, 100), LIMITS, TENANT)
    assert rejected.reason is Reason.KV_BUDGET_EXHAUSTED
    await store.settle(
        held[0], SettleCause.COMPLETED, ActualUsage(100, 100), cost_pico=0, tenant=TENANT
    )
    assert (await store.reserve(req(100, 100), LIMITS, TENANT)).admitted


async def test_expired_leases_free_capacity_and_are_reported() -> None:
    clock = ManualClock()
    expired: list[Reservation] = []
    store = MemoryStore(lease_ttl_s=30, clock=clock, on_lease_expired=expired.append)
    lost = await store.reserve(req(500, 500), LIMITS, TENANT)
    assert lost.admitted and lost.reservation
    assert not (await store.reserve(req(10, 10), LIMITS, TENANT)).admitted
    clock.advance(31)
    assert (await store.reserve(req(10, 10), LIMITS, TENANT)).admitted
    assert [r.reservation_id for r in expired] == [lost.reservation.reservation_id]
    # A late settlement of an expired lease is billed once and frees nothing twice.
    late = await store.settle(
        lost.reservation, SettleCause.COMPLETED, ActualUsage(500, 1), cost_pico=0, tenant=TENANT
    )
    assert late.applied and late.lease_expired
    [status] = await store.backend_status()
    assert status.requests_in_flight == 1
    again = await store.settle(
        lost.reservation, SettleCause.COMPLETED, ActualUsage(500, 1), cost_pico=0, tenant=TENANT
    )
    assert not again.applied


async def test_renewed_lease_survives() -> None:
    clock = ManualClock()
    store = MemoryStore(lease_ttl_s=30, clock=clock)
    decision = await store.reserve(req(10, 10), LIMITS, TENANT)
    assert decision.reservation
    for _ in range(5):
        clock.advance(20)
        assert await store.renew(decision.reservation)
    [status] = await store.backend_status()
    assert status.requests_in_flight == 1


async def test_lapsed_bills_and_tombstones_are_forgotten() -> None:
    """Billing records and tombstones do not accumulate: a sweep drops the lapsed ones (in
    lapsing order, a renewal moving a record to the back)."""
    clock = ManualClock()
    store = MemoryStore(lease_ttl_s=10, clock=clock, bill_retention_s=100, abandon_retention_s=50)
    held = []
    for n in range(5):
        request = AdmissionRequest(f"r{n}", "t", "m", "b", prompt_tokens=1, max_new_tokens=1)
        decision = await store.reserve(request, LIMITS, TENANT)
        assert decision.reservation is not None
        held.append(decision.reservation)
    await store.abandon(held[4].request)
    clock.advance(60)
    assert not await store.renew(held[0])  # lease lost, bill kept: lapses at 160
    await store.backend_status()  # sweeps: the tombstone ended at 50
    assert (await store.reserve(held[4].request, LIMITS, TENANT)).admitted
    clock.advance(50)  # 110: the bills of r1..r3 lapsed at 100, not r0's, nor the new r4's
    await store.backend_status()
    settled = [
        (
            await store.settle(
                r, SettleCause.COMPLETED, ActualUsage(1, 1), cost_pico=0, tenant=TENANT
            )
        ).applied
        for r in held[:4]
    ]
    assert settled == [True, False, False, False]
    assert len(store._bills) == 1 and not store._abandoned  # only the new r4's record
