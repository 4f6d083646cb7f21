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
LEVEL_SCOPE_PREFIX = "@"  # a level's scope key ("@team:research"); no model name starts so
# A level's money per period is forgotten once nothing touched it for this long (longer than
# any month, so a period's spend outlives the period): level scopes can be many.
LEVEL_LEDGER_KEEP_S = 40 * 86400.0


def is_level_scope(scope_key: str) -> bool:
    return scope_key.startswith(LEVEL_SCOPE_PREFIX)


def _level_of(scope_key: str) -> tuple[str, str]:
    """(kind, name) of a level scope key ("@team:research" -> ("team", "research"))."""
    kind, _, name = scope_key[1:].partition(":")
    return kind, name


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
        scopes += [(level.scope_key, level.limits) for level in self.levels]
        return scopes

    def allows_model(self, model: str) -> bool:
        """Every level of the caller may use `model` (a level without a list allows any)."""
        return all(level.models is None or model in level.models for level in self.levels)

    def level_scope_keys(self) -> tuple[str, ...]:
        return tuple(level.scope_key for level in self.levels)


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
    # The level whose limit this is (None: the tenant's own or its model's).
    level: LevelKind | None = None


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
    # The caller's level scopes ("@team:research"), each holding `cost_pico` reserved for
    # both periods until settlement (spent per level, budget or not: the level's ledger).
    level_scopes: tuple[str, ...] = ()


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
    # Each level's money, keyed (level scope key, period key), and when it last changed
    # (wall seconds) so that an idle level's ledger can be forgotten.
    level_spent: dict[tuple[str, str], int] = field(default_factory=dict)
    level_reserved: dict[tuple[str, str], int] = field(default_factory=dict)
    level_touched: dict[tuple[str, str], float] = field(default_factory=dict)

    def scope(self, key: str, limits: ScopeLimits, now: float) -> ScopeState:
        state = self.scopes.get(key)
        if state is None:
            state = self.scopes[key] = ScopeState()
        state.requests = _sync_bucket(state.requests, limits.rpm, now)
        state.tokens = _sync_bucket(state.tokens, limits.tpm, now)
        return state

    def held_scope(
        self, key: str, limits_by_scope: Mapping[str, ScopeLimits], now: float
    ) -> ScopeState:
        """The scope a hold took from, to give back to. A level scope the current policy
        does not name (a sweep or an abandon settles against the tenant's last request,
        whose caller may be another) keeps its buckets as they are: syncing to "no rule"
        would drop them, forgetting the tokens they lent."""
        limits = limits_by_scope.get(key)
        if limits is None and is_level_scope(key):
            state = self.scopes.get(key)
            if state is None:
                state = self.scopes[key] = ScopeState()
            return state
        return self.scope(key, limits or ScopeLimits(), now)

    def add_level_money(
        self,
        book: dict[tuple[str, str], int],
        key: tuple[str, str],
        amount: int,
        wall: float | None,
    ) -> None:
        """`wall` None: the time is unknown to the caller; the entry keeps its last one."""
        book[key] = max(0, book.get(key, 0) + amount)
        if wall is not None or key not in self.level_touched:
            self.level_touched[key] = wall if wall is not None else 0.0

    def prune_idle_levels(self, now: float, wall: float) -> int:
        """Forget level state that says nothing a fresh one would not: a level scope with
        full buckets and nothing in flight, and a level's money untouched for
        LEVEL_LEDGER_KEEP_S with nothing reserved. Returns how many entries went."""
        idle_scopes = [
            key
            for key, scope in self.scopes.items()
            if is_level_scope(key)
            and scope.in_flight == 0
            and all(
                bucket is None or bucket.available(now) >= bucket.spec.capacity
                for bucket in (scope.requests, scope.tokens)
            )
        ]
        for key in idle_scopes:
            del self.scopes[key]
        stale_money = [
            money
            for money, touched in self.level_touched.items()
            if wall - touched >= LEVEL_LEDGER_KEEP_S and self.level_reserved.get(money, 0) == 0
        ]
        for money in stale_money:
            del self.level_touched[money]
            self.level_spent.pop(money, 0)
            self.level_reserved.pop(money, 0)
        return len(idle_scopes) + len(stale_money)


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
    """A metric label: low cardinality, so a level is named by its kind, never its name."""
    if scope == TENANT_SCOPE:
        return name
    if is_level_scope(scope):
        return f"{_level_of(scope)[0]}:{name}"
    return f"model:{name}"


def _where(scope: str) -> str:
    """The scope in a refusal's text (the client reads it)."""
    if scope == TENANT_SCOPE:
        return ""
    if is_level_scope(scope):
        kind, name = _level_of(scope)
        return f" for {kind} '{name}'"
    return f" for model '{scope}'"


def _level_kind(scope: str) -> LevelKind | None:
    return LevelKind(_level_of(scope)[0]) if is_level_scope(scope) else None


_PERIOD_ADJECTIVE = {Period.DAY: "daily", Period.MONTH: "monthly"}


def _level_budget_violations(
    policy: TenantPolicy, state: TenantState, cost_pico: int, wall: float
) -> list[Violation]:
    """Each level's budgets: always "block" (the tenant's budget action is the tenant's)."""
    violations: list[Violation] = []
    for level in policy.levels:
        for rule in level.budgets:
            key = (level.scope_key, period_key(rule.period, wall))
            left = rule.cap_pico - state.level_spent.get(key, 0) - state.level_reserved.get(key, 0)
            if cost_pico <= left:
                continue
            never = cost_pico > rule.cap_pico
            budget = f"{_PERIOD_ADJECTIVE[rule.period]} budget of {level.kind.value} '{level.name}'"
            violations.append(
                Violation(
                    Reason.BUDGET_EXCEEDED,
                    f"{level.kind.value}:budget_{rule.period.value}",
                    (
                        f"This request's worst-case cost exceeds the whole {budget}."
                        if never
                        else f"The {budget} is exhausted."
                    ),
                    None if never else seconds_until_reset(rule.period, wall),
                    rule.shadow,
                    level=level.kind,
                )
            )
    return violations


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
        where = _where(scope_key)
        level = _level_kind(scope_key)
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
                        level=level,
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
                        level=level,
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
                            level=level,
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
                    level=level,
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
                        f"This request's worst-case cost exceeds the whole "
                        f"{_PERIOD_ADJECTIVE[rule.period]} budget."
                        if never
                        else f"The {_PERIOD_ADJECTIVE[rule.period]} budget is exhausted."
                    ),
                    None if never else seconds_until_reset(rule.period, wall),
                    rule.shadow,
                )
            )
    violations += _level_budget_violations(policy, state, cost_pico, wall)
    return violations


def budget_left_pico(policy: TenantPolicy, state: TenantState, wall: float) -> int | None:
    """The smallest remaining (enforced) budget of the tenant, or None when none is enforced.
    Levels' budgets are not in it: the clamp and fallback actions are the tenant's."""
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
    level_scopes = policy.level_scope_keys()
    for scope_key in level_scopes:
        for _, key in keys:
            state.add_level_money(state.level_reserved, (scope_key, key), cost_pico, wall)
    return TenantHold(
        model=model,
        tokens=tokens,
        cost_pico=cost_pico,
        period_keys=keys,
        concurrency_scopes=tuple(concurrency_scopes),
        request_slot_taken=request_slot_taken,
        level_scopes=level_scopes,
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
    wall: float | None = None,
) -> None:
    """Settle: refund unused tokens (or charge the overshoot), free the slot, book the cost.

    `refund_request`: also give the RPM request back if this reservation took it (an
    abandoned reserve: nothing was served, so nothing the reserve took is kept). One taken
    by the pre-check stays taken: the request was made, before any expensive work."""
    limits_by_scope = dict(policy.scopes(hold.model))
    for scope_key in hold.concurrency_scopes:
        scope = state.held_scope(scope_key, limits_by_scope, now)
        scope.in_flight = max(0, scope.in_flight - 1)
        if refund_request and not hold.request_slot_taken and scope.requests is not None:
            scope.requests.give_back(1, now)
        if scope.tokens is not None:
            scope.tokens.give_back(hold.tokens - used_tokens, now)
    for _, key in hold.period_keys:
        state.reserved[key] = max(0, state.reserved.get(key, 0) - hold.cost_pico)
        state.spent[key] = state.spent.get(key, 0) + cost_pico
        for scope_key in hold.level_scopes:
            money = (scope_key, key)
            state.add_level_money(state.level_reserved, money, -hold.cost_pico, wall)
            state.add_level_money(state.level_spent, money, cost_pico, wall)


def charge_expired(
    policy: TenantPolicy,
    state: TenantState,
    hold: TenantHold,
    *,
    used_tokens: int,
    cost_pico: int,
    now: float,
    wall: float | None = None,
) -> None:
    """Bill a request whose lease expired before it settled. The expiry already gave the
    hold back (slot, tokens, reserved money) as if nothing was used; now take what was."""
    limits_by_scope = dict(policy.scopes(hold.model))
    for scope_key in hold.concurrency_scopes:
        scope = state.held_scope(scope_key, limits_by_scope, now)
        if scope.tokens is not None:
            scope.tokens.take(used_tokens, now)
    for _, key in hold.period_keys:
        state.spent[key] = state.spent.get(key, 0) + cost_pico
        for scope_key in hold.level_scopes:
            state.add_level_money(state.level_spent, (scope_key, key), cost_pico, wall)


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
        levels=tuple(
            replace(level, limits=ScopeLimits(rpm=level.limits.rpm), budgets=())
            for level in policy.levels
        ),
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
        levels=tuple(
            replace(
                level,
                limits=_shadow_scope(level.limits),
                budgets=tuple(replace(rule, shadow=True) for rule in level.budgets),
            )
            for level in policy.levels
        ),
    )
