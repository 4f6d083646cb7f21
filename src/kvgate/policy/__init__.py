"""Pure admission policy: no asyncio, no gRPC, no storage. Time comes from an injected Clock."""

from kvgate.policy.admission import admit, precheck, settle_tenant
from kvgate.policy.buckets import BucketSpec, TokenBucket
from kvgate.policy.clock import Clock, ManualClock, MonotonicClock
from kvgate.policy.kv import BackendLedger, BackendView, ThroughputEstimate
from kvgate.policy.periods import Period, period_key, seconds_until_reset
from kvgate.policy.picking import (
    EndpointLoad,
    PickWeights,
    PrefixIndex,
    rank_endpoints,
    rendezvous_order,
)
from kvgate.policy.pricing import Pricing, pico_to_usd, usd_to_pico
from kvgate.policy.sizing import plan_new_tokens
from kvgate.policy.tenant import (
    BudgetAction,
    BudgetRule,
    ConcurrencyRule,
    Level,
    LevelKind,
    RateLimitView,
    RateRule,
    ScopeLimits,
    TenantHold,
    TenantPolicy,
    TenantState,
    Violation,
    requests_only,
    shadowed,
)
from kvgate.policy.types import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Decision,
    Reason,
    Reservation,
    SettleCause,
    Settlement,
    UsageTotals,
)

__all__ = [
    "ActualUsage",
    "AdmissionRequest",
    "BackendLedger",
    "BackendLimits",
    "BackendStatus",
    "BackendView",
    "BucketSpec",
    "BudgetAction",
    "BudgetRule",
    "Clock",
    "ConcurrencyRule",
    "Decision",
    "EndpointLoad",
    "Level",
    "LevelKind",
    "ManualClock",
    "MonotonicClock",
    "Period",
    "PickWeights",
    "PrefixIndex",
    "Pricing",
    "RateLimitView",
    "RateRule",
    "Reason",
    "Reservation",
    "ScopeLimits",
    "SettleCause",
    "Settlement",
    "TenantHold",
    "TenantPolicy",
    "TenantState",
    "ThroughputEstimate",
    "TokenBucket",
    "UsageTotals",
    "Violation",
    "admit",
    "period_key",
    "pico_to_usd",
    "plan_new_tokens",
    "precheck",
    "rank_endpoints",
    "rendezvous_order",
    "requests_only",
    "seconds_until_reset",
    "settle_tenant",
    "shadowed",
    "usd_to_pico",
]
