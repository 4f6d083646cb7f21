"""Per-tenant limits: RPM and TPM token buckets, concurrency, daily and monthly budgets.

Admission is two-phase so that a request reserves on every limit or on none: `evaluate`
looks without touching anything, `apply` reserves on all of them. Callers run both inside one
atomic section (one event-loop step in memory, one Lua script in Redis).

Limits apply tenant-wide and, optionally, per tenant x model. A shadowed limit is evaluated
and consumed like any other, but its violations are only reported, never enforced.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvgate.policy.buckets import BucketSpec, TokenBucket
from kvgate.policy.periods import Period, period_key, seconds_until_reset
from kvgate.policy.types import Reason

TENANT_SCOPE = ""  # the scope key of tenant-wide limits; model scopes use the model name


class BudgetAction(enum.StrEnum):
    BLOCK = "block"
    FALLBACK = "fallback"
    CLAMP = "clamp"


@dataclass(frozen=True, slots=True)
class RateRule:
    spec: BucketSpec
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class ConcurrencyRule:
    limit: int
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    rpm: RateRule | None = None
    tpm: RateRule | None = None
    concurrency: ConcurrencyRule | None = None


@dataclass(frozen=True, slots=True)
class BudgetRule:
    period: Period
    cap_pico: int
    shadow: bool = False


class LevelKind(enum.StrEnum):
    """A level under the tenant whose limits a request also takes from."""

    TEAM = "team"
    USER = "user"
    KEY = "key"


@dataclass(frozen=True, slots=True)
class Level:
    """One level of the caller under its tenant (its team, its user, its API key) with the
    limits and budgets of its own; reserved in the same atomic step as the tenant's."""

    kind: LevelKind
    name: str
    limits: ScopeLimits = ScopeLimits()
    budgets: tuple[BudgetRule, ...] = ()
    # The models this level may use; None: any the tenant may.
    models: frozenset[str] | None = None

    @property
    def scope_key(self) -> str:
        """Its scope in the tenant's state ("@team:research"): a model's scope is its name,
        and no model name starts with "@"."""
        return f"@{self.kind.value}:{self.name}"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    name: str
    limits: ScopeLimits = ScopeLimits()
    model_limits: Mapping[str, ScopeLimits] = field(default_factory=lambda: MappingProxyType({}))
    budgets: tuple[BudgetRule, ...] = ()
    budget_action: BudgetAction = BudgetAction.BLOCK
    fallback_model: str | None = None
    # The caller's levels under the tenant (team, user, key), outermost first: set per
    # request (`with_levels`), never in the snapshot's tenant policy.
    levels: tuple[Level, ...] = ()

    def with_levels(self, levels: tuple[Level, ...]) -> TenantPolicy:
        return replace(self, levels=levels) if levels else self

    def scopes(self, model: str) -> list[tuple[str, ScopeLimits]]:
        scopes = [(TENANT_SCOPE, self.limits)]
        if model in self.model_limits:
            scopes.append((model, self.model_limits[model]))
        return scopes


@dataclass(frozen=True, slots=True)
class Violation:
    reason: Reason
    limit: str  # a metric label: "rpm", "tpm", "concurrency", "budget_day", "model:tpm", ...
    detail: str
    retry_after_s: float | None  # None: waiting cannot help (unless frees_with_work)
    shadow: bool = False
    # True when the wait depends on in-flight work finishing (concurrency): the caller,
    # who sees that work, estimates it.
    frees_with_work: bool = False


@dataclass(frozen=True, slots=True)
class TenantHold:
    """What one admitted request holds on its tenant's limits, to be undone at settlement."""

    model: str
    tokens: int
    cost_pico: int
    period_keys: tuple[tuple[Period, str], ...]
    concurrency_scopes: tuple[str, ...]
    # The pre-check took the RPM request, not this reservation (the request's
    # `request_slot_taken`): an abandon gives back only what the reserve took.
    request_slot_taken: bool = False


@dataclass(frozen=True, slots=True)
class RateLimitView:
    """The numbers behind OpenAI's x-ratelimit-* headers (the tenant-wide scope)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None


@dataclass(slots=True)
class ScopeState:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0


@dataclass(slots=True)
class TenantState:
    scopes: dict[str, ScopeState] = field(default_factory=dict)
    # Budget money per period key ("2026-11-29", "2026-11"), in pico-dollars.
    spent: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)

    def scope(self, key: str, limits: ScopeLimits, now: float) -> ScopeState:
        state = self.scopes.get(key)
        if state is None:
            state = self.scopes[key] = ScopeState()
        state.requests = _sync_bucket(state.requests, limits.rpm, now)
        state.tokens = _sync_bucket(state.tokens, limits.tpm, now)
        return state


def _sync_bucket(
    bucket: TokenBucket | None, rule: RateRule | None, now: float
) -> TokenBucket | None:
    if rule is None:
        return None
    if bucket is None:
        return TokenBucket.full(rule.spec, now)
    if bucket.spec != rule.spec:
        bucket.resize(rule.spec, now)
    return bucket


def _label(scope: str, name: str) -> str:
    return name if scope == TENANT_SCOPE else f"model:{name}"


def evaluate(
    policy: TenantPolicy,
    state: TenantState,
    *,
    model: str,
    tokens: int,
    cost_pico: int,
    now: float,
    wall: float,
    request_slot_taken: bool = False,
) -> list[Violation]:
    """Every limit this request would break, enforced and shadowed. Changes nothing.

    `request_slot_taken`: its RPM request was taken already (by the pre-check), so RPM is
    broken only by a debt: a shadowed rule that let the pre-check take from an empty bucket
    (still reported here; an enforced bucket never goes below zero)."""
    violations: list[Violation] = []
    for scope_key, limits in policy.scopes(model):
        scope = state.scope(scope_key, limits, now)
        where = "" if scope_key == TENANT_SCOPE else f" for model '{scope_key}'"
        if limits.rpm is not None and scope.requests is not None:
            wait = scope.requests.wait_for(0 if request_slot_taken else 1, now)
            if wait > 0:
                violations.append(
                    Violation(
                        Reason.RPM_EXCEEDED,
                        _label(scope_key, "rpm"),
                        f"Rate limit reached for requests per minute{where}: limit "
                        f"{limits.rpm.spec.capacity:g}.",
                        wait,
                        limits.rpm.shadow,
                    )
                )
        if limits.tpm is not None and scope.tokens is not None:
            capacity = limits.tpm.spec.capacity
            if tokens > capacity:
                violations.append(
                    Violation(
                        Reason.REQUEST_EXCEEDS_TPM,
                        _label(scope_key, "tpm"),
                        f"This request needs {tokens} tokens (prompt + max new tokens), more "
                        f"than the tokens-per-minute limit{where} allows at once "
                        f"({capacity:g}). Lower max_tokens or shorten the prompt.",
                        None,
                        limits.tpm.shadow,
                    )
                )
            else:
                wait = scope.tokens.wait_for(tokens, now)
                if wait > 0:
                    available = max(0, math.floor(scope.tokens.available(now)))
                    violations.append(
                        Violation(
                            Reason.TPM_EXCEEDED,
                            _label(scope_key, "tpm"),
                            f"Rate limit reached for tokens per minute{where}: limit "
                            f"{capacity:g}, available {available}, requested {tokens}.",
                            wait,
                            limits.tpm.shadow,
                        )
                    )
        if limits.concurrency is not None and scope.in_flight >= limits.concurrency.limit:
            violations.append(
                Violation(
                    Reason.TENANT_CONCURRENCY_EXCEEDED,
                    _label(scope_key, "concurrency"),
                    f"Too many concurrent requests{where}: limit {limits.concurrency.limit}.",
                    None,
                    limits.concurrency.shadow,
                    frees_with_work=True,
                )
            )
    for rule in policy.budgets:
        key = period_key(rule.period, wall)
        left = rule.cap_pico - state.spent.get(key, 0) - state.reserved.get(key, 0)
        if cost_pico > left:
            never = cost_pico > rule.cap_pico
            violations.append(
                Violation(
                    Reason.BUDGET_EXCEEDED,
                    f"budget_{rule.period.value}",
                    (
                        f"This request's worst-case cost exceeds the whole {rule.period.value}ly "
                        "budget."
                        if never
                        else f"The {rule.period.value}ly budget is exhausted."
                    ),
                    None if never else seconds_until_reset(rule.period, wall),
                    rule.shadow,
                )
            )
    return violations


def budget_left_pico(policy: TenantPolicy, state: TenantState, wall: float) -> int | None:
    """The smallest remaining (enforced) budget, or None when no budget is enforced."""
    lefts = [
        rule.cap_pico
        - state.spent.get(period_key(rule.period, wall), 0)
        - state.reserved.get(period_key(rule.period, wall), 0)
        for rule in policy.budgets
        if not rule.shadow
    ]
    return min(lefts) if lefts else None


def apply(
    policy: TenantPolicy,
    state: TenantState,
    *,
    model: str,
    tokens: int,
    cost_pico: int,
    now: float,
    wall: float,
    request_slot_taken: bool = False,
) -> TenantHold:
    """Reserve on every limit (call only after `evaluate` found nothing enforced); the RPM
    request only if the pre-check did not take it (`request_slot_taken`)."""
    concurrency_scopes: list[str] = []
    for scope_key, limits in policy.scopes(model):
        scope = state.scope(scope_key, limits, now)
        if scope.requests is not None and not request_slot_taken:
            scope.requests.take(1, now)
        if scope.tokens is not None:
            scope.tokens.take(tokens, now)
        scope.in_flight += 1
        concurrency_scopes.append(scope_key)
    # Both periods, budget or not: the ledger books usage per day and per month.
    keys = tuple((period, period_key(period, wall)) for period in (Period.DAY, Period.MONTH))
    for _, key in keys:
        state.reserved[key] = state.reserved.get(key, 0) + cost_pico
    return TenantHold(
        model=model,
        tokens=tokens,
        cost_pico=cost_pico,
        period_keys=keys,
        concurrency_scopes=tuple(concurrency_scopes),
        request_slot_taken=request_slot_taken,
    )


def take_request_slot(policy: TenantPolicy, state: TenantState, *, model: str, now: float) -> None:
    """Take one request from every RPM bucket of the request's scopes (tenant-wide and the
    model's), shadowed ones too: the pre-check's part of `apply`."""
    for scope_key, limits in policy.scopes(model):
        scope = state.scope(scope_key, limits, now)
        if scope.requests is not None:
            scope.requests.take(1, now)


def release(
    policy: TenantPolicy,
    state: TenantState,
    hold: TenantHold,
    *,
    used_tokens: int,
    cost_pico: int,
    now: float,
    refund_request: bool = False,
) -> None:
    """Settle: refund unused tokens (or charge the overshoot), free the slot, book the cost.

    `refund_request`: also give the RPM request back if this reservation took it (an
    abandoned reserve: nothing was served, so nothing the reserve took is kept). One taken
    by the pre-check stays taken: the request was made, before any expensive work."""
    limits_by_scope = dict(policy.scopes(hold.model))
    for scope_key in hold.concurrency_scopes:
        limits = limits_by_scope.get(scope_key, ScopeLimits())
        scope = state.scope(scope_key, limits, now)
        scope.in_flight = max(0, scope.in_flight - 1)
        if refund_request and not hold.request_slot_taken and scope.requests is not None:
            scope.requests.give_back(1, now)
        if scope.tokens is not None:
            scope.tokens.give_back(hold.tokens - used_tokens, now)
    for _, key in hold.period_keys:
        state.reserved[key] = max(0, state.reserved.get(key, 0) - hold.cost_pico)
        state.spent[key] = state.spent.get(key, 0) + cost_pico


def charge_expired(
    policy: TenantPolicy,
    state: TenantState,
    hold: TenantHold,
    *,
    used_tokens: int,
    cost_pico: int,
    now: float,
) -> None:
    """Bill a request whose lease expired before it settled. The expiry already gave the
    hold back (slot, tokens, reserved money) as if nothing was used; now take what was."""
    limits_by_scope = dict(policy.scopes(hold.model))
    for scope_key in hold.concurrency_scopes:
        limits = limits_by_scope.get(scope_key, ScopeLimits())
        scope = state.scope(scope_key, limits, now)
        if scope.tokens is not None:
            scope.tokens.take(used_tokens, now)
    for _, key in hold.period_keys:
        state.spent[key] = state.spent.get(key, 0) + cost_pico


def rate_limit_view(policy: TenantPolicy, state: TenantState, now: float) -> RateLimitView:
    limits = policy.limits
    scope = state.scope(TENANT_SCOPE, limits, now)
    view = RateLimitView()
    if limits.rpm is not None and scope.requests is not None:
        view = RateLimitView(
            limit_requests=int(limits.rpm.spec.capacity),
            remaining_requests=max(0, math.floor(scope.requests.available(now))),
            reset_requests_s=scope.requests.seconds_until_full(now),
        )
    if limits.tpm is not None and scope.tokens is not None:
        view = RateLimitView(
            limit_requests=view.limit_requests,
            remaining_requests=view.remaining_requests,
            reset_requests_s=view.reset_requests_s,
            limit_tokens=int(limits.tpm.spec.capacity),
            remaining_tokens=max(0, math.floor(scope.tokens.available(now))),
            reset_tokens_s=scope.tokens.seconds_until_full(now),
        )
    return view


def requests_only(policy: TenantPolicy) -> TenantPolicy:
    """The policy's request-rate limits alone: what a request answered without a backend
    (a cache hit, a replay, a duplicate's wait) takes before its answer."""
    return replace(
        policy,
        limits=ScopeLimits(rpm=policy.limits.rpm),
        model_limits=MappingProxyType(
            {model: ScopeLimits(rpm=scope.rpm) for model, scope in policy.model_limits.items()}
        ),
        budgets=(),
    )


def _shadow_scope(scope: ScopeLimits) -> ScopeLimits:
    return ScopeLimits(
        rpm=replace(scope.rpm, shadow=True) if scope.rpm else None,
        tpm=replace(scope.tpm, shadow=True) if scope.tpm else None,
        concurrency=replace(scope.concurrency, shadow=True) if scope.concurrency else None,
    )


def shadowed(policy: TenantPolicy) -> TenantPolicy:
    """The policy with every limit in shadow mode: decided and reported, never enforced."""
    return replace(
        policy,
        limits=_shadow_scope(policy.limits),
        model_limits=MappingProxyType(
            {model: _shadow_scope(scope) for model, scope in policy.model_limits.items()}
        ),
        budgets=tuple(replace(rule, shadow=True) for rule in policy.budgets),
    )
