"""The compiled, immutable view of a configuration that request handling reads.

A reload builds a whole new snapshot and swaps one reference, so a request never sees half
of an old config and half of a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvgate.config.model import (
    BudgetConfig,
    KvgateConfig,
    LevelBudgetConfig,
    LevelConfig,
    LimitsConfig,
    ModelConfig,
    TenantConfig,
    gc_paused,
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
_NO_MODEL_LIMITS: Mapping[str, ScopeLimits] = MappingProxyType({})


class _Compiler:
    """Compiles sections once per distinct object: parse_config shares equal limits and
    budgets between tenants (kvgate.config.model), so a fleet of tenants on a few tiers
    compiles a few ScopeLimits and budget rules, each shared by every tenant of its tier."""

    __slots__ = ("_budgets", "_priorities", "_scopes")

    def __init__(self) -> None:
        # By id(): the config holding the sections outlives the compile.
        self._scopes: dict[int, ScopeLimits] = {}
        self._budgets: dict[int, tuple[BudgetRule, ...]] = {}
        # By value: almost every tenant has the default class, one tuple for all of them
        # (a tuple and a frozenset each would be a quarter of a large snapshot's memory).
        self._priorities: dict[tuple[int, tuple[int, ...]], tuple[int, frozenset[int]]] = {}

    def priority(self, tenant: TenantConfig) -> tuple[int, frozenset[int]]:
        key = (tenant.priority, tuple(tenant.allowed_priorities))
        priority = self._priorities.get(key)
        if priority is None:
            priority = self._priorities[key] = (tenant.priority, frozenset(key[1]))
        return priority

    def scope(self, limits: LimitsConfig) -> ScopeLimits:
        scope = self._scopes.get(id(limits))
        if scope is None:
            scope = self._scopes[id(limits)] = _scope(limits)
        return scope

    def budget_rules(self, budget: BudgetConfig | LevelBudgetConfig) -> tuple[BudgetRule, ...]:
        rules = self._budgets.get(id(budget))
        if rules is None:
            rules = self._budgets[id(budget)] = _budget_rules(budget)
        return rules

    def level(self, kind: LevelKind, name: str, level: LevelConfig) -> Level:
        return Level(
            kind=kind,
            name=name,
            limits=self.scope(level.limits),
            budgets=self.budget_rules(level.budget) if level.budget is not None else (),
            models=frozenset(level.models) if level.models is not None else None,
        )

    def tenant_levels(self, tenant: TenantConfig) -> TenantLevels:
        if not (tenant.teams or tenant.users or tenant.user_limits):
            return NO_LEVELS
        return TenantLevels(
            teams=MappingProxyType(
                {name: self.level(LevelKind.TEAM, name, c) for name, c in tenant.teams.items()}
            ),
            users=MappingProxyType(
                {name: self.level(LevelKind.USER, name, c) for name, c in tenant.users.items()}
            ),
            user_template=self.level(LevelKind.USER, "", tenant.user_limits)
            if tenant.user_limits is not None
            else None,
        )

    def tenant_policy(self, tenant: TenantConfig) -> TenantPolicy:
        budget = tenant.budget
        return TenantPolicy(
            name=tenant.name,
            limits=self.scope(tenant.limits),
            model_limits=MappingProxyType(
                {model: self.scope(limits) for model, limits in tenant.model_limits.items()}
            )
            if tenant.model_limits
            else _NO_MODEL_LIMITS,
            budgets=self.budget_rules(budget) if budget is not None else (),
            budget_action=BudgetAction(budget.action) if budget is not None else BudgetAction.BLOCK,
            fallback_model=budget.fallback_model if budget is not None else None,
        )


def _budget_rules(budget: BudgetConfig | LevelBudgetConfig) -> tuple[BudgetRule, ...]:
    return tuple(
        BudgetRule(period, usd_to_pico(amount), budget.shadow)
        for period, amount in ((Period.DAY, budget.daily_usd), (Period.MONTH, budget.monthly_usd))
        if amount is not None
    )


def compile_level(kind: LevelKind, name: str, level: LevelConfig) -> Level:
    return _Compiler().level(kind, name, level)


def _tenant_levels(tenant: TenantConfig) -> TenantLevels:
    return _Compiler().tenant_levels(tenant)


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
    return _Compiler().tenant_policy(tenant)


@dataclass(slots=True)
class _TenantParts:
    """Everything the snapshot holds of the tenants, built tenant by tenant."""

    configs: list[TenantConfig] = field(default_factory=list)
    by_key_hash: dict[str, str] = field(default_factory=dict)
    policies: dict[str, TenantPolicy] = field(default_factory=dict)
    priorities: dict[str, tuple[int, frozenset[int]]] = field(default_factory=dict)
    tenant_configs: dict[str, TenantConfig] = field(default_factory=dict)
    levels: dict[str, TenantLevels] = field(default_factory=dict)
    reused: int = 0


def _compile_tenants(tenants: list[TenantConfig], previous: RuntimeSnapshot | None) -> _TenantParts:
    """The tenants' compiled parts; a tenant equal to one of `previous` (same name, equal
    settings) keeps that snapshot's parts, its config object included, compiled once."""
    parts = _TenantParts()
    compiler = _Compiler()
    old_configs = previous.tenant_configs if previous is not None else {}
    for tenant in tenants:
        name = tenant.name
        old = old_configs.get(name)
        if old is not None and previous is not None and (old is tenant or old == tenant):
            tenant = old
            policy = previous.tenants[name]
            priority = previous.priorities[name]
            levels = previous.tenant_levels.get(name, NO_LEVELS)
            parts.reused += 1
        else:
            policy = compiler.tenant_policy(tenant)
            priority = compiler.priority(tenant)
            levels = compiler.tenant_levels(tenant)
        parts.configs.append(tenant)
        value = tenant.api_key_sha256
        for digest in (value,) if isinstance(value, str) else value:
            parts.by_key_hash[digest] = name
        parts.policies[name] = policy
        parts.priorities[name] = priority
        parts.tenant_configs[name] = tenant
        if levels is not NO_LEVELS:
            parts.levels[name] = levels
    return parts


def compile_snapshot(
    config: KvgateConfig, previous: RuntimeSnapshot | None = None
) -> RuntimeSnapshot:
    """The snapshot of `config`. With `previous` (the one serving), the tenants that did not
    change keep their compiled parts, and the new snapshot's config holds their previous
    config objects (equal to the new ones), so a reload that changes one tenant of many
    compiles one."""
    with gc_paused():
        return _compile(config, previous)


def _compile(config: KvgateConfig, previous: RuntimeSnapshot | None) -> RuntimeSnapshot:
    tenants = _compile_tenants(config.tenants, previous)
    if tenants.reused:
        # Keep one object per tenant alive, not an old and an equal new one.
        config = config.model_copy(update={"tenants": tenants.configs})
    return RuntimeSnapshot(
        tenants_by_key_hash=MappingProxyType(tenants.by_key_hash),
        tenants=MappingProxyType(tenants.policies),
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
        priorities=MappingProxyType(tenants.priorities),
        queued_pools=frozenset(b.name for b in config.backends if b.queue is not None),
        queue_waits=MappingProxyType(
            {b.name: b.queue.max_wait_s for b in config.backends if b.queue is not None}
        ),
        tenant_configs=MappingProxyType(tenants.tenant_configs),
        model_configs=MappingProxyType({m.name: m for m in config.models}),
        tenant_levels=MappingProxyType(tenants.levels),
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
