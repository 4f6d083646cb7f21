"""A tenant's usage report: tokens, cost, reserved and remaining budget for today and this
month, by model. The tenant reads it through Envoy (`GET /v1/kvgate/usage`, with its own
key); operators read every tenant's on kvgate's HTTP port and through the admin API."""

from __future__ import annotations

from typing import Any

from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.policy import Clock, Period, UsageTotals, period_key, pico_to_usd, seconds_until_reset
from kvgate.store import StateStore


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


async def tenant_usage_report(
    store: StateStore, clock: Clock, snapshot: RuntimeSnapshot, tenant: str
) -> dict[str, Any]:
    wall = clock.wall()
    policy = snapshot.tenants.get(tenant)
    keys = {period: period_key(period, wall) for period in (Period.DAY, Period.MONTH)}
    usage = await store.tenant_usage(tenant, keys.values())
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
    return report
