"""Pure admission policy: no asyncio, no gRPC, no storage. Time comes from an injected Clock."""

from kvgate.policy.clock import Clock, ManualClock, MonotonicClock
from kvgate.policy.kv import BackendLedger, ThroughputEstimate
from kvgate.policy.sizing import plan_new_tokens
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
    "Clock",
    "Decision",
    "ManualClock",
    "MonotonicClock",
    "Reason",
    "Reservation",
    "SettleCause",
    "Settlement",
    "ThroughputEstimate",
    "UsageTotals",
    "plan_new_tokens",
]
