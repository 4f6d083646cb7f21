"""KV in-flight budget and concurrency: pure policy, injected clock, no sleeps."""

from __future__ import annotations

import pytest

from kvgate.policy import (
    AdmissionRequest,
    BackendLedger,
    BackendLimits,
    ManualClock,
    Pricing,
    Reason,
    ThroughputEstimate,
    plan_new_tokens,
)

LIMITS = BackendLimits(
    name="b", kv_budget_tokens=48_000, kv_block_size=16, max_concurrent_requests=4
)


def req(prompt: int, max_new: int, choices: int = 1, rid: str = "r") -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid,
        tenant="t",
        model="m",
        backend="b",
        prompt_tokens=prompt,
        max_new_tokens=max_new,
        choices=choices,
    )


@pytest.mark.parametrize(
    ("tokens", "rounded"),
    [(1, 16), (16, 16), (17, 32), (6512, 6512), (6513, 6528), (0, 0)],
)
def test_reservations_round_up_to_whole_blocks(tokens: int, rounded: int) -> None:
    assert LIMITS.round_to_blocks(tokens) == rounded


def test_cost_counts_every_choice() -> None:
    assert req(100, 50, choices=3).reserved_output_tokens == 150
    assert req(100, 50, choices=3).cost_tokens == 250


def test_the_worst_case_price_counts_every_reserved_output_token() -> None:
    priced = req(100, 50, choices=3).priced(Pricing(input=2, cached_input=1, output=7))
    assert priced.cost_pico == 100 * 2 + 150 * 7


@pytest.mark.parametrize(
    ("in_flight", "prompt", "max_new", "admitted", "reason"),
    [
        (0, 47_000, 1_000, True, Reason.ADMITTED),  # exact fit
        (0, 47_000, 1_001, False, Reason.REQUEST_EXCEEDS_KV_BUDGET),  # one over, never fits
        (40_000, 7_000, 1_000, True, Reason.ADMITTED),  # exactly the free rest
        (40_000, 7_000, 1_001, False, Reason.KV_BUDGET_EXHAUSTED),  # one token over the rest
    ],
)
def test_budget_boundaries(
    in_flight: int, prompt: int, max_new: int, admitted: bool, reason: Reason
) -> None:
    ledger = BackendLedger(limits=LIMITS)
    if in_flight:
        assert ledger.try_reserve(req(in_flight, 0, rid="x"), "x", 0.0, 60).admitted
    decision = ledger.try_reserve(req(prompt, max_new), "y", 0.0, 60)
    assert decision.admitted is admitted
    assert decision.reason is reason
    if reason is Reason.REQUEST_EXCEEDS_KV_BUDGET:
        assert decision.retry_after_s is None  # waiting cannot help
    if reason is Reason.KV_BUDGET_EXHAUSTED:
        assert decision.retry_after_s is not None and decision.retry_after_s >= 1


def test_seed_scenario_eight_documents_into_48k() -> None:
    """Eight ~6,000-token documents with max_tokens 512 against 48,000 KV tokens."""
    ledger = BackendLedger(limits=BackendLimits("b", 48_000, 16, 256))
    decisions = [ledger.try_reserve(req(6_000, 512), f"r{i}", 0.0, 60) for i in range(8)]
    admitted = [d for d in decisions if d.admitted]
    # 6,512 rounds to 6,528 per request: 7 fit (45,696), the 8th would need 52,224.
    assert len(admitted) == 7
    assert ledger.kv_tokens_in_flight == 7 * 6_512 <= 48_000
    assert decisions[-1].reason is Reason.KV_BUDGET_EXHAUSTED


def test_release_is_idempotent_and_frees_capacity() -> None:
    ledger = BackendLedger(limits=LIMITS)
    decision = ledger.try_reserve(req(1_000, 24), "a", 0.0, 60)
    assert decision.admitted and ledger.kv_tokens_in_flight == 1_024
    assert ledger.release("a") is not None
    assert ledger.release("a") is None
    assert ledger.kv_tokens_in_flight == 0 and not ledger.in_flight


def test_concurrency_cap() -> None:
    ledger = BackendLedger(limits=LIMITS)
    for i in range(4):
        assert ledger.try_reserve(req(10, 6), f"r{i}", 0.0, 60).admitted
    decision = ledger.try_reserve(req(10, 6), "r4", 0.0, 60)
    assert decision.reason is Reason.BACKEND_CONCURRENCY_LIMIT
    assert decision.retry_after_s is not None and decision.retry_after_s >= 1


def test_leases_expire_unless_renewed() -> None:
    clock = ManualClock()
    ledger = BackendLedger(limits=LIMITS)
    ledger.try_reserve(req(100, 28), "kept", clock.now(), 30)
    ledger.try_reserve(req(100, 28), "lost", clock.now(), 30)
    clock.advance(20)
    assert ledger.renew("kept", clock.now(), 30)
    clock.advance(15)
    expired = ledger.expire(clock.now())
    assert [r.reservation_id for r in expired] == ["lost"]
    assert set(ledger.in_flight) == {"kept"}
    assert ledger.kv_tokens_in_flight == 128
    assert not ledger.renew("lost", clock.now(), 30)


def test_retry_after_follows_the_work_in_flight() -> None:
    """The estimate walks in-flight work in finishing order until the deficit is covered."""
    throughput = ThroughputEstimate()
    throughput.observe(duration_s=10.0, output_tokens=500)  # 0.02 s/token, 500 tokens/request
    ledger = BackendLedger(limits=BackendLimits("b", 3_200, 16, 100), throughput=throughput)
    # Three requests of 1,000 KV tokens each, started at t=0, 10 and 20 s; each expected to
    # run 500 tokens x 0.02 s = 10 s.
    for i, start in enumerate((0.0, 10.0, 20.0)):
        assert ledger.try_reserve(req(488, 512), f"r{i}", start, 600).admitted
    # At t=21 there are 3,200 - 3,072 = 128 free; 1,500 more need two requests to finish:
    # r0 was due at t=10 (overdue), r1 at t=20 (overdue) -> clamp to the 1 s minimum.
    assert ledger.try_reserve(req(1_000, 500), "x", 21.0, 600).retry_after_s == 1.0
    # At t=21, needing all three to finish: r2 is due at t=30 -> 9 s.
    assert ledger.try_reserve(req(2_600, 500), "y", 21.0, 600).retry_after_s == 9.0


def test_throughput_estimate_is_a_moving_average() -> None:
    est = ThroughputEstimate(alpha=0.5)
    est.observe(10.0, 100)  # 0.1 s/token
    est.observe(10.0, 1000)  # 0.01 s/token
    assert est.seconds_per_output_token == pytest.approx(0.055)
    assert est.output_tokens_per_request == pytest.approx(550)
    est.observe(0.0, 10)  # no duration: ignored
    assert est.samples == 2


@pytest.mark.parametrize(
    ("prompt", "asked", "default", "context", "ok", "max_new"),
    [
        (100, None, 1_024, 32_768, True, 1_024),  # default
        (32_000, None, 1_024, 32_768, True, 768),  # default clamped to what is left
        (32_767, None, 1_024, 32_768, True, 1),
        (32_768, None, 1_024, 32_768, False, 0),  # nothing left
        (100, 1, 1_024, 32_768, True, 1),  # tiny
        (100, 32_668, 1_024, 32_768, True, 32_668),  # exact fit
        (100, 32_669, 1_024, 32_768, False, 32_669),  # one over
        (100, 10**9, 1_024, 32_768, False, 10**9),  # huge
    ],
)
def test_plan_new_tokens(
    prompt: int, asked: int | None, default: int, context: int, ok: bool, max_new: int
) -> None:
    plan = plan_new_tokens(prompt, asked, default, context)
    assert plan.ok is ok
    assert plan.max_new_tokens == max_new
    if not ok:
        assert str(context) in plan.detail and str(prompt) in plan.detail
