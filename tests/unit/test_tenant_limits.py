"""Tenant limits, budgets and pricing: table-driven, injected clock, no sleeps."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvgate.openai.errors import format_reset, rate_limit_headers
from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLedger,
    BackendLimits,
    BucketSpec,
    BudgetRule,
    ConcurrencyRule,
    Level,
    LevelKind,
    ManualClock,
    Period,
    Pricing,
    RateRule,
    Reason,
    ScopeLimits,
    TenantPolicy,
    TenantState,
    TokenBucket,
    admit,
    settle_tenant,
    usd_to_pico,
)
from kvgate.policy.periods import period_key, seconds_until_reset
from kvgate.policy.tenant import BudgetAction, requests_only, shadowed

BIG_BACKEND = BackendLimits(
    "b", kv_budget_tokens=10**9, kv_block_size=1, max_concurrent_requests=10**6
)


def req(prompt: int, max_new: int, *, model: str = "m", cost: int = 0) -> AdmissionRequest:
    return AdmissionRequest(
        request_id="r",
        tenant="t",
        model=model,
        backend="b",
        prompt_tokens=prompt,
        max_new_tokens=max_new,
        cost_pico=cost,
    )


class Rig:
    def __init__(self, policy: TenantPolicy) -> None:
        self.clock = ManualClock()
        self.policy = policy
        self.state = TenantState()
        self.backend = BackendLedger(limits=BIG_BACKEND)
        self.n = 0

    def admit(self, request: AdmissionRequest):
        self.n += 1
        return admit(
            request,
            backend=self.backend,
            policy=self.policy,
            state=self.state,
            reservation_id=f"r{self.n}",
            now=self.clock.now(),
            wall=self.clock.wall(),
            lease_ttl_s=600,
        )

    def settle(self, decision, prompt: int, output: int, cost: int = 0) -> None:
        assert decision.reservation is not None
        self.backend.release(decision.reservation.reservation_id)
        settle_tenant(
            self.policy,
            self.state,
            decision.reservation,
            ActualUsage(prompt, output),
            cost,
            self.clock.now(),
        )


def tpm(capacity: float, refill: float, shadow: bool = False) -> TenantPolicy:
    return TenantPolicy(
        name="t", limits=ScopeLimits(tpm=RateRule(BucketSpec(capacity, refill), shadow))
    )


# ---------------------------------------------------------------- token bucket


@pytest.mark.parametrize(
    ("level", "amount", "wait"),
    [
        (1000, 1000, 0.0),  # exact fit
        (999, 1000, 0.1),  # one token short, at 10/s
        (0, 500, 50.0),
        (-200, 100, 30.0),  # debt from an overshoot delays the next request
        (1000, 1500, float("inf")),  # more than capacity: never
    ],
)
def test_bucket_wait(level: float, amount: float, wait: float) -> None:
    bucket = TokenBucket(BucketSpec(1000, 10), level=level, updated_at=0.0)
    assert bucket.wait_for(amount, 0.0) == pytest.approx(wait)


def test_bucket_refills_and_caps() -> None:
    bucket = TokenBucket(BucketSpec(100, 10), level=0, updated_at=0.0)
    assert bucket.available(5.0) == 50
    assert bucket.available(500.0) == 100
    bucket.take(30, 500.0)
    bucket.give_back(1000, 500.0)  # a refund never overfills
    assert bucket.available(500.0) == 100
    assert bucket.seconds_until_full(500.0) == 0


# ---------------------------------------------------------------- TPM


@pytest.mark.parametrize(
    ("prompt", "max_new", "admitted", "reason"),
    [
        (600, 400, True, Reason.ADMITTED),  # exact fit of the 1,000 bucket
        (600, 401, False, Reason.REQUEST_EXCEEDS_TPM),  # never fits: 400, not 429
        (1, 999, True, Reason.ADMITTED),
    ],
)
def test_tpm_boundaries(prompt: int, max_new: int, admitted: bool, reason: Reason) -> None:
    rig = Rig(tpm(1000, 1000 / 60))
    decision = rig.admit(req(prompt, max_new))
    assert decision.admitted is admitted and decision.reason is reason
    if reason is Reason.REQUEST_EXCEEDS_TPM:
        assert decision.retry_after_s is None


def test_tpm_refill_mid_wait_and_retry_after_from_the_deficit() -> None:
    rig = Rig(tpm(1000, 10))
    assert rig.admit(req(800, 100)).admitted  # 900 taken, 100 left
    rejected = rig.admit(req(200, 100))  # needs 300, has 100 -> 200 missing at 10/s = 20 s
    assert rejected.reason is Reason.TPM_EXCEEDED
    assert rejected.retry_after_s == pytest.approx(20.0)
    rig.clock.advance(19.9)
    assert not rig.admit(req(200, 100)).admitted
    rig.clock.advance(0.1)
    assert rig.admit(req(200, 100)).admitted


def test_refund_after_a_short_answer_and_overshoot_when_max_tokens_is_ignored() -> None:
    rig = Rig(tpm(1000, 1))
    first = rig.admit(req(100, 800))  # reserves 900
    assert first.admitted
    rig.settle(first, prompt=100, output=20)  # used 120: 780 come back
    assert rig.state.scopes[""].tokens.available(rig.clock.now()) == pytest.approx(880)
    second = rig.admit(req(100, 50))  # reserves 150 -> 730 left
    rig.settle(second, prompt=100, output=900)  # backend ignored max_tokens: 1,000 used
    assert rig.state.scopes[""].tokens.available(rig.clock.now()) == pytest.approx(-120)
    blocked = rig.admit(req(10, 10))
    assert blocked.reason is Reason.TPM_EXCEEDED
    assert blocked.retry_after_s == pytest.approx(140.0)  # 120 debt + 20 needed, at 1/s


def test_tiny_max_tokens_cannot_sneak_a_big_prompt_past_tpm() -> None:
    rig = Rig(tpm(10_000, 10))
    assert rig.admit(req(9_000, 1)).admitted
    decision = rig.admit(req(9_000, 1))
    assert decision.reason is Reason.TPM_EXCEEDED  # the prompt itself is charged up front


def test_shadowed_limit_reports_but_admits() -> None:
    rig = Rig(tpm(100, 1, shadow=True))
    assert rig.admit(req(90, 10)).admitted
    decision = rig.admit(req(90, 10))
    assert decision.admitted
    assert [(v.reason, v.shadow) for v in decision.violations] == [(Reason.TPM_EXCEEDED, True)]


# ---------------------------------------------------------------- RPM, concurrency, per model


def test_rpm_bucket() -> None:
    policy = TenantPolicy(name="t", limits=ScopeLimits(rpm=RateRule(BucketSpec(2, 2 / 60))))
    rig = Rig(policy)
    assert rig.admit(req(1, 1)).admitted and rig.admit(req(1, 1)).admitted
    rejected = rig.admit(req(1, 1))
    assert rejected.reason is Reason.RPM_EXCEEDED
    assert rejected.retry_after_s == pytest.approx(30.0)


def test_concurrency_frees_on_settle_and_all_or_nothing() -> None:
    policy = TenantPolicy(
        name="t",
        limits=ScopeLimits(concurrency=ConcurrencyRule(1), tpm=RateRule(BucketSpec(1000, 1))),
    )
    rig = Rig(policy)
    held = rig.admit(req(10, 10))
    assert held.admitted
    rejected = rig.admit(req(10, 10))
    assert rejected.reason is Reason.TENANT_CONCURRENCY_EXCEEDED
    assert rejected.retry_after_s is not None and rejected.retry_after_s >= 1
    # The rejected request took nothing from the TPM bucket: all or nothing.
    assert rig.state.scopes[""].tokens.available(rig.clock.now()) == pytest.approx(980)
    rig.settle(held, 10, 10)
    assert rig.admit(req(10, 10)).admitted


def test_backend_rejection_leaves_tenant_limits_untouched() -> None:
    rig = Rig(tpm(1000, 1))
    rig.backend = BackendLedger(limits=BackendLimits("b", 100, 1, 10))
    decision = rig.admit(req(90, 20))
    assert decision.reason is Reason.REQUEST_EXCEEDS_KV_BUDGET
    assert rig.state.scopes[""].tokens.available(rig.clock.now()) == 1000
    assert rig.state.scopes[""].in_flight == 0


def test_model_scope_is_checked_beside_the_tenant_scope() -> None:
    policy = TenantPolicy(
        name="t",
        limits=ScopeLimits(tpm=RateRule(BucketSpec(10_000, 1))),
        model_limits={"big": ScopeLimits(tpm=RateRule(BucketSpec(500, 1)))},
    )
    rig = Rig(policy)
    assert rig.admit(req(300, 100, model="big")).admitted
    rejected = rig.admit(req(300, 100, model="big"))
    assert rejected.reason is Reason.TPM_EXCEEDED
    assert rejected.violations[0].limit == "model:tpm"
    assert rig.admit(req(300, 100, model="small")).admitted


def test_the_longest_wait_is_reported() -> None:
    policy = TenantPolicy(
        name="t",
        limits=ScopeLimits(rpm=RateRule(BucketSpec(1, 1 / 60)), tpm=RateRule(BucketSpec(1000, 1))),
    )
    rig = Rig(policy)
    assert rig.admit(req(500, 400)).admitted
    decision = rig.admit(req(500, 400))  # RPM waits 60 s, TPM waits 800 s
    assert decision.reason is Reason.TPM_EXCEEDED
    assert decision.retry_after_s == pytest.approx(800)
    assert {v.reason for v in decision.violations} == {Reason.RPM_EXCEEDED, Reason.TPM_EXCEEDED}


# ---------------------------------------------------------------- pricing and budgets


PRICES = Pricing.per_million(Decimal("0.50"), Decimal("0.25"), Decimal("1.50"))


@pytest.mark.parametrize(
    ("prompt", "output", "cached", "usd"),
    [
        (1_000_000, 0, 0, Decimal("0.50")),
        (0, 1_000_000, 0, Decimal("1.50")),
        (1_000_000, 1_000_000, 400_000, Decimal("1.90")),  # 0.30 + 0.10 + 1.50
        (1, 1, 0, Decimal("0.000002")),
        (7, 3, 5, Decimal("0.00000675")),  # 2x0.5 + 5x0.25 + 3x1.5 micro-dollars
    ],
)
def test_cost_is_exact(prompt: int, output: int, cached: int, usd: Decimal) -> None:
    assert PRICES.cost(prompt, output, cached) == usd_to_pico(usd)


def test_cost_has_no_float_drift_over_many_requests() -> None:
    total = sum(PRICES.cost(3, 7, 1) for _ in range(1_000_000))
    assert total == 1_000_000 * PRICES.cost(3, 7, 1)
    assert total == usd_to_pico(Decimal("11.75"))  # (2x0.5 + 0.25 + 7x1.5) micro x 1e6


def test_prices_with_too_many_decimals_are_refused() -> None:
    with pytest.raises(ValueError, match="decimal places"):
        Pricing.per_million(Decimal("0.0000001"), Decimal(0), Decimal(0))


def budget_policy(daily_usd: str) -> TenantPolicy:
    return TenantPolicy(
        name="t", budgets=(BudgetRule(Period.DAY, usd_to_pico(Decimal(daily_usd))),)
    )


def test_budget_reserves_worst_case_and_settles_actual() -> None:
    rig = Rig(budget_policy("0.001"))  # 1,000 micro-dollars
    worst = PRICES.worst_case(100, 500)  # 50 + 750 = 800 micro
    first = rig.admit(req(100, 500, cost=worst))
    assert first.admitted
    second = rig.admit(req(100, 500, cost=worst))
    assert second.reason is Reason.BUDGET_EXCEEDED
    wait = seconds_until_reset(Period.DAY, rig.clock.wall())
    assert second.retry_after_s == pytest.approx(wait)
    assert second.budget_left_pico == usd_to_pico(Decimal("0.001")) - worst
    rig.settle(first, 100, 20, cost=PRICES.cost(100, 20))  # 50 + 30 = 80 micro
    key = period_key(Period.DAY, rig.clock.wall())
    assert rig.state.spent[key] == usd_to_pico(Decimal("0.00008"))
    assert rig.state.reserved[key] == 0
    assert rig.admit(req(100, 500, cost=worst)).admitted


def test_budget_that_can_never_fit_says_waiting_does_not_help() -> None:
    rig = Rig(budget_policy("0.0001"))
    decision = rig.admit(req(100, 500, cost=PRICES.worst_case(100, 500)))
    assert decision.reason is Reason.BUDGET_EXCEEDED and decision.retry_after_s is None


def test_output_tokens_affordable() -> None:
    left = usd_to_pico(Decimal("0.0002"))  # 200 micro
    # prompt 100 costs 50 micro, 150 micro left at 1.5 micro per output token -> 100 tokens
    assert PRICES.output_tokens_affordable(100, left) == 100
    assert PRICES.output_tokens_affordable(1000, left) == 0


@pytest.mark.parametrize(
    ("wall", "period", "key", "reset"),
    [
        (1_780_000_000.0, Period.DAY, "2026-05-28", 1_780_012_800.0 - 1_780_000_000.0),
        (1_780_000_000.0, Period.MONTH, "2026-05", 1_780_272_000.0 - 1_780_000_000.0),
        (1_798_761_599.0, Period.MONTH, "2026-12", 1.0),  # Dec 31 23:59:59 -> January
    ],
)
def test_periods_are_utc(wall: float, period: Period, key: str, reset: float) -> None:
    assert period_key(period, wall) == key
    assert seconds_until_reset(period, wall) == pytest.approx(reset)


# ---------------------------------------------------------------- headers and charging


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.02, "20ms"), (1, "1s"), (7.66, "7.66s"), (360, "6m0s"), (3723, "1h2m3s")],
)
def test_reset_duration_format(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_rate_limit_headers_from_a_decision() -> None:
    policy = TenantPolicy(
        name="t",
        limits=ScopeLimits(
            rpm=RateRule(BucketSpec(60, 1)), tpm=RateRule(BucketSpec(1000, 1000 / 60))
        ),
    )
    decision = Rig(policy).admit(req(100, 200))
    assert rate_limit_headers(decision.rate_limits) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "18s",
    }


# ---------------------------------------------------------------- early rejection


def test_precheck_rejects_only_what_the_full_check_would() -> None:
    """Checks are monotonic in tokens and cost, so a lower bound's violation is real."""
    from kvgate.policy import precheck

    rig = Rig(tpm(1000, 10))
    assert rig.admit(req(800, 150)).admitted  # 50 left
    early = precheck(
        req(1, 100),
        backend=rig.backend,
        policy=rig.policy,
        state=rig.state,
        now=rig.clock.now(),
        wall=rig.clock.wall(),
    )
    assert early is not None and early.reason is Reason.TPM_EXCEEDED
    full = rig.admit(req(300, 100))
    assert full.reason is Reason.TPM_EXCEEDED
    # The early answer's wait is for the lower bound, never longer than the full one.
    assert early.retry_after_s is not None and full.retry_after_s is not None
    assert early.retry_after_s <= full.retry_after_s
    # Room for the lower bound: no early answer (the full check decides after tokenizing).
    assert (
        precheck(
            req(1, 10),
            backend=rig.backend,
            policy=rig.policy,
            state=rig.state,
            now=rig.clock.now(),
            wall=rig.clock.wall(),
        )
        is None
    )


def test_a_passing_precheck_can_take_the_request_slot() -> None:
    """The RPM request is taken by the pre-check, in every scope, and the reserve that says so
    takes no other; an abandon gives back only what it took."""
    from dataclasses import replace
    from types import MappingProxyType

    from kvgate.policy import precheck
    from kvgate.policy import tenant as tenant_limits

    rig = Rig(
        TenantPolicy(
            name="t",
            limits=ScopeLimits(rpm=RateRule(BucketSpec(3, 3 / 60))),
            model_limits=MappingProxyType({"m": ScopeLimits(rpm=RateRule(BucketSpec(2, 2 / 60)))}),
        )
    )

    def check(request: AdmissionRequest, take: bool):
        return precheck(
            request,
            backend=rig.backend,
            policy=rig.policy,
            state=rig.state,
            now=rig.clock.now(),
            wall=rig.clock.wall(),
            take_request_slot=take,
        )

    def level(scope: str) -> float:
        bucket = rig.state.scopes[scope].requests
        assert bucket is not None
        return bucket.available(rig.clock.now())

    assert check(req(1, 10), take=False) is None  # changes nothing
    assert (level(""), level("m")) == (3, 2)
    assert check(req(1, 10), take=True) is None
    assert (level(""), level("m")) == (2, 1)
    taken = replace(req(50, 10), request_slot_taken=True)
    decision = rig.admit(taken)
    assert decision.admitted and decision.rate_limits is not None
    assert decision.rate_limits.remaining_requests == 2
    assert (level(""), level("m")) == (2, 1)
    assert decision.reservation is not None and decision.reservation.hold is not None
    assert decision.reservation.hold.request_slot_taken
    tenant_limits.release(
        rig.policy,
        rig.state,
        decision.reservation.hold,
        used_tokens=0,
        cost_pico=0,
        now=rig.clock.now(),
        refund_request=True,
    )
    assert (level(""), level("m")) == (2, 1)  # the pre-check's request stays taken
    assert check(req(1, 10), take=True) is None
    refused = check(req(1, 10), take=True)  # the model's bucket is empty
    assert refused is not None and refused.reason is Reason.RPM_EXCEEDED
    assert (level(""), level("m")) == (1, 0)


# ---------------------------------------------------------------- levels (team, user, key)


def _levels_policy() -> TenantPolicy:
    return TenantPolicy(
        name="t",
        limits=ScopeLimits(rpm=RateRule(BucketSpec(100, 100 / 60))),
        budgets=(BudgetRule(Period.DAY, 10**9),),
        budget_action=BudgetAction.FALLBACK,
        fallback_model="small",
    ).with_levels(
        (
            Level(LevelKind.TEAM, "research", ScopeLimits(rpm=RateRule(BucketSpec(1, 1 / 60)))),
            Level(
                LevelKind.KEY,
                "key_0123abcd",
                budgets=(BudgetRule(Period.MONTH, 50),),
                models=frozenset({"m", "small"}),
            ),
        )
    )


def test_level_scopes_follow_the_tenant_and_its_model() -> None:
    policy = _levels_policy()
    assert [key for key, _ in policy.scopes("m")] == ["", "@team:research", "@key:key_0123abcd"]
    assert policy.allows_model("small") and not policy.allows_model("large")
    assert TenantPolicy(name="t").allows_model("anything")


def test_level_violations_are_labelled_by_kind_and_named_in_the_text() -> None:
    from kvgate.policy import tenant as tenant_limits

    policy = _levels_policy()
    state = TenantState()
    tenant_limits.apply(policy, state, model="m", tokens=10, cost_pico=40, now=0.0, wall=0.0)
    violations = tenant_limits.evaluate(
        policy, state, model="m", tokens=10, cost_pico=40, now=0.0, wall=0.0
    )
    by_label = {v.limit: v for v in violations}
    assert set(by_label) == {"team:rpm", "key:budget_month"}
    assert by_label["team:rpm"].detail == (
        "Rate limit reached for requests per minute for team 'research': limit 1."
    )
    assert by_label["key:budget_month"].detail == (
        "The monthly budget of key 'key_0123abcd' is exhausted."
    )
    # The tenant's budget action is the tenant's: a level's budget is not in its room.
    assert tenant_limits.budget_left_pico(policy, state, 0.0) == 10**9 - 40


def test_requests_only_and_shadowed_carry_the_levels() -> None:
    policy = _levels_policy()
    only = requests_only(policy)
    assert [level.limits for level in only.levels] == [
        policy.levels[0].limits,
        ScopeLimits(),
    ]
    assert all(level.budgets == () for level in only.levels)
    shadow = shadowed(policy)
    assert shadow.levels[0].limits.rpm is not None and shadow.levels[0].limits.rpm.shadow
    assert all(rule.shadow for rule in shadow.levels[1].budgets)
    assert shadow.levels[1].models == policy.levels[1].models
