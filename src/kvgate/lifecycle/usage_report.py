"""A tenant's usage report: tokens, cost, reserved and remaining budget for today and this
month, by model. The tenant reads it through Envoy (`GET /v1/kvgate/usage`, with its own
key); operators read every tenant's on kvgate's HTTP port and through the admin API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.policy import (
    Clock,
    Level,
    Period,
    UsageTotals,
    period_key,
    pico_to_usd,
    seconds_until_reset,
)
from kvgate.store import StateStore
from kvgate.store.base import TenantUsage


def _money(pico: int) -> str:
    return format(pico_to_usd(pico).normalize(), "f")


def _totals(totals: UsageTotals) -> dict[str, Any]:
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "cached_prompt_tokens": totals.cached_tokens,
        "output_tokens": totals.output_tokens,
        "cost_usd": _money(totals.cost_pico),
        "cache_hits": totals.cache_hits,
        "cache_saved_tokens": totals.cache_saved_tokens,
    }


def ledger_periods(clock: Clock) -> list[str]:
    """The ledger's period keys for now: today and this month."""
    wall = clock.wall()
    return [period_key(period, wall) for period in (Period.DAY, Period.MONTH)]


async def record_cache_hit(
    store: StateStore, clock: Clock, tenant: str, model: str, saved_tokens: int
) -> None:
    """Book a cache hit in the tenant's ledger (all-time, today, this month)."""
    await store.record_cache_hit(tenant, model, saved_tokens, ledger_periods(clock))


def _level_report(
    level: Level, usage: TenantUsage, keys: dict[Period, str], wall: float
) -> dict[str, Any]:
    """One level's own spend (and budget) today and this month."""
    entry: dict[str, Any] = {"level": level.kind.value, "name": level.name}
    for period, key in keys.items():
        spent = usage.level_spent_pico.get((level.scope_key, key), 0)
        money: dict[str, Any] = {"period": key, "cost_usd": _money(spent)}
        rule = next((b for b in level.budgets if b.period is period), None)
        if rule is not None:
            money["budget_usd"] = _money(rule.cap_pico)
            money["remaining_usd"] = _money(max(0, rule.cap_pico - spent))
            money["resets_in_s"] = round(seconds_until_reset(period, wall))
        entry["today" if period is Period.DAY else "this_month"] = money
    return entry


async def tenant_usage_report(
    store: StateStore,
    clock: Clock,
    snapshot: RuntimeSnapshot,
    tenant: str,
    levels: Sequence[Level] = (),
) -> dict[str, Any]:
    """The tenant's ledger today and this month; with ``levels`` (the caller's team, user,
    key), each level's own spend and budget too."""
    wall = clock.wall()
    policy = snapshot.tenants.get(tenant)
    keys = {period: period_key(period, wall) for period in (Period.DAY, Period.MONTH)}
    usage = await store.tenant_usage(
        tenant, keys.values(), levels=[level.scope_key for level in levels]
    )
    report: dict[str, Any] = {"object": "kvgate.usage", "tenant": tenant}
    for period, key in keys.items():
        by_model = {
            model: _totals(totals)
            for (period_key_, model), totals in sorted(usage.by_period_model.items())
            if period_key_ == key
        }
        total = UsageTotals()
        for (period_key_, _), totals in usage.by_period_model.items():
            if period_key_ == key:
                total.requests += totals.requests
                total.prompt_tokens += totals.prompt_tokens
                total.cached_tokens += totals.cached_tokens
                total.output_tokens += totals.output_tokens
                total.cost_pico += totals.cost_pico
                total.cache_hits += totals.cache_hits
                total.cache_saved_tokens += totals.cache_saved_tokens
        entry: dict[str, Any] = {
            "period": key,
            "resets_in_s": round(seconds_until_reset(period, wall)),
            **_totals(total),
            "by_model": by_model,
            "reserved_usd": _money(usage.reserved_pico.get(key, 0)),
        }
        rule = next((b for b in policy.budgets if b.period is period), None) if policy else None
        if rule is not None:
            spent = usage.spent_pico.get(key, 0)
            entry["budget_usd"] = _money(rule.cap_pico)
            entry["remaining_usd"] = _money(
                max(0, rule.cap_pico - spent - usage.reserved_pico.get(key, 0))
            )
        report["today" if period is Period.DAY else "this_month"] = entry
    if levels:
        report["levels"] = [_level_report(level, usage, keys, wall) for level in levels]
    return report
