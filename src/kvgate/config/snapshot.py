"""The compiled, immutable view of a configuration that request handling reads.

A reload builds a whole new snapshot and swaps one reference, so a request never sees half
of an old config and half of a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvgate.config.model import (
    KvgateConfig,
    LevelConfig,
    LimitsConfig,
    ModelConfig,
    TenantConfig,
)
from kvgate.policy import (
    BackendLimits,
    BucketSpec,
    BudgetAction,
    BudgetRule,
    ConcurrencyRule,
    Level,
    LevelKind,
    Period,
    Pricing,
    RateRule,
    ScopeLimits,
    TenantPolicy,
    usd_to_pico,
)


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str
    backend: str
    max_context: int
    default_max_new_tokens: int
    pricing: Pricing


@dataclass(frozen=True, slots=True)
class TenantLevels:
    """A tenant's teams and users with limits of their own, compiled."""

    teams: Mapping[str, Level] = field(default_factory=lambda: MappingProxyType({}))
    users: Mapping[str, Level] = field(default_factory=lambda: MappingProxyType({}))
    # Every other user's own limits (its name filled in per request); None: users of this
    # tenant have no limits of their own unless listed.
    user_template: Level | None = None

    def levels(self, team: str | None, user: str | None) -> tuple[Level, ...]:
        """The levels a caller of this team and user takes from, outermost first."""
        levels: list[Level] = []
        if team is not None and (team_level := self.teams.get(team)) is not None:
            levels.append(team_level)
        if user is not None:
            user_level = self.users.get(user)
            if user_level is None and self.user_template is not None:
                user_level = replace(self.user_template, name=user)
            if user_level is not None:
                levels.append(user_level)
        return tuple(levels)


NO_LEVELS = TenantLevels()


def compile_level(kind: LevelKind, name: str, level: LevelConfig) -> Level:
    budgets: list[BudgetRule] = []
    if level.budget is not None:
        budget = level.budget
        for period, amount in ((Period.DAY, budget.daily_usd), (Period.MONTH, budget.monthly_usd)):
            if amount is not None:
                budgets.append(BudgetRule(period, usd_to_pico(amount), budget.shadow))
    return Level(
        kind=kind,
        name=name,
        limits=_scope(level.limits),
        budgets=tuple(budgets),
        models=frozenset(level.models) if level.models is not None else None,
    )


def _tenant_levels(tenant: TenantConfig) -> TenantLevels:
    if not (tenant.teams or tenant.users or tenant.user_limits):
        return NO_LEVELS
    return TenantLevels(
        teams=MappingProxyType(
            {name: compile_level(LevelKind.TEAM, name, c) for name, c in tenant.teams.items()}
        ),
        users=MappingProxyType(
            {name: compile_level(LevelKind.USER, name, c) for name, c in tenant.users.items()}
        ),
        user_template=compile_level(LevelKind.USER, "", tenant.user_limits)
        if tenant.user_limits is not None
        else None,
    )


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    tenants_by_key_hash: Mapping[str, str]
    tenants: Mapping[str, TenantPolicy]
    models: Mapping[str, ModelRoute]
    backends: Mapping[str, BackendLimits]
    config: KvgateConfig
    # Backends whose KV budget is discovered from vLLM (their kv_budget_tokens here is 0).
    auto_budget: frozenset[str] = frozenset()
    # backend -> its own API key, for backends that need one (never a tenant's key).
    upstream_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # tenant -> (its priority class, the other classes it may ask for).
    priorities: Mapping[str, tuple[int, frozenset[int]]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # Pools with a queue: their requests may wait for room (at most this long).
    queued_pools: frozenset[str] = frozenset()
    queue_waits: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # The tenants' own settings beyond their limits (response cache opt-in, ...).
    tenant_configs: Mapping[str, TenantConfig] = field(default_factory=lambda: MappingProxyType({}))
    # The models' own settings beyond their route (semantic cache opt-in, ...).
    model_configs: Mapping[str, ModelConfig] = field(default_factory=lambda: MappingProxyType({}))
    # Tenants with teams or users of their own limits (others have none).
    tenant_levels: Mapping[str, TenantLevels] = field(default_factory=lambda: MappingProxyType({}))

    def levels(self, tenant: str, team: str | None, user: str | None) -> tuple[Level, ...]:
        return self.tenant_levels.get(tenant, NO_LEVELS).levels(team, user)


def _route(model: ModelConfig) -> ModelRoute:
    prices = model.pricing
    cached = prices.cached_input_per_million
    return ModelRoute(
        name=model.name,
        backend=model.backend,
        max_context=model.max_context,
        default_max_new_tokens=model.default_max_new_tokens,
        pricing=Pricing.per_million(
            prices.input_per_million,
            prices.input_per_million if cached is None else cached,
            prices.output_per_million,
        ),
    )


def _scope(limits: LimitsConfig) -> ScopeLimits:
    return ScopeLimits(
        rpm=RateRule(BucketSpec(limits.rpm.limit, limits.rpm.limit / 60), limits.rpm.shadow)
        if limits.rpm
        else None,
        tpm=RateRule(BucketSpec(limits.tpm.capacity, limits.tpm.refill), limits.tpm.shadow)
        if limits.tpm
        else None,
        concurrency=ConcurrencyRule(limits.concurrency.limit, limits.concurrency.shadow)
        if limits.concurrency
        else None,
    )


def _tenant_policy(tenant: TenantConfig) -> TenantPolicy:
    budgets: list[BudgetRule] = []
    action = BudgetAction.BLOCK
    fallback = None
    if tenant.budget is not None:
        budget = tenant.budget
        for period, amount in ((Period.DAY, budget.daily_usd), (Period.MONTH, budget.monthly_usd)):
            if amount is not None:
                budgets.append(BudgetRule(period, usd_to_pico(amount), budget.shadow))
        action = BudgetAction(budget.action)
        fallback = budget.fallback_model
    return TenantPolicy(
        name=tenant.name,
        limits=_scope(tenant.limits),
        model_limits=MappingProxyType(
            {model: _scope(limits) for model, limits in tenant.model_limits.items()}
        ),
        budgets=tuple(budgets),
        budget_action=action,
        fallback_model=fallback,
    )


def compile_snapshot(config: KvgateConfig) -> RuntimeSnapshot:
    by_hash = {digest: t.name for t in config.tenants for digest in t.key_hashes}
    return RuntimeSnapshot(
        tenants_by_key_hash=MappingProxyType(by_hash),
        tenants=MappingProxyType({t.name: _tenant_policy(t) for t in config.tenants}),
        models=MappingProxyType({m.name: _route(m) for m in config.models}),
        backends=MappingProxyType(
            {
                b.name: BackendLimits(
                    name=b.name,
                    kv_budget_tokens=0 if b.kv_budget_tokens == "auto" else b.kv_budget_tokens,
                    kv_block_size=b.kv_block_size,
                    max_concurrent_requests=b.max_concurrent_requests,
                )
                for b in config.backends
            }
        ),
        config=config,
        auto_budget=frozenset(b.name for b in config.backends if b.kv_budget_tokens == "auto"),
        upstream_keys=MappingProxyType(
            {b.name: key for b in config.backends if (key := b.upstream_api_key)}
        ),
        priorities=MappingProxyType(
            {t.name: (t.priority, frozenset(t.allowed_priorities)) for t in config.tenants}
        ),
        queued_pools=frozenset(b.name for b in config.backends if b.queue is not None),
        queue_waits=MappingProxyType(
            {b.name: b.queue.max_wait_s for b in config.backends if b.queue is not None}
        ),
        tenant_configs=MappingProxyType({t.name: t for t in config.tenants}),
        model_configs=MappingProxyType({m.name: m for m in config.models}),
        tenant_levels=MappingProxyType(
            {
                t.name: levels
                for t in config.tenants
                if (levels := _tenant_levels(t)) is not NO_LEVELS
            }
        ),
    )


class SnapshotHolder:
    """Holds the current snapshot; readers take `.current` once per request."""

    def __init__(self, snapshot: RuntimeSnapshot) -> None:
        self._current = snapshot

    @property
    def current(self) -> RuntimeSnapshot:
        return self._current

    def swap(self, snapshot: RuntimeSnapshot) -> RuntimeSnapshot:
        previous, self._current = self._current, snapshot
        return previous
