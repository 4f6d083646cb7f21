"""The StateStore protocol: where admission state lives.

The in-memory store is the embedded default; a shared store (Redis) implements the same
protocol so several kvgate replicas enforce one set of limits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Decision,
    Reservation,
    SettleCause,
    Settlement,
    TenantPolicy,
    UsageTotals,
)

ExpiredLeaseHook = Callable[[Reservation], None]


@dataclass(slots=True)
class TenantUsage:
    """One tenant's ledger for some budget periods ("2026-11-29", "2026-11")."""

    by_period_model: dict[tuple[str, str], UsageTotals] = field(default_factory=dict)
    spent_pico: dict[str, int] = field(default_factory=dict)
    reserved_pico: dict[str, int] = field(default_factory=dict)


class StateStore(Protocol):
    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        """Check every limit and reserve capacity, atomically: all or nothing."""
        ...

    async def precheck(
        self, lower_bound: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision | None:
        """A rejection that holds for any request at least as large as `lower_bound`, found
        without tokenizing; None when nothing is sure (or the store cannot tell cheaply).
        Changes nothing."""
        ...

    async def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
    ) -> Settlement:
        """Release the reservation and book usage. Idempotent: a second call applies nothing."""
        ...

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live stream's lease; False if it is gone (settled or expired)."""
        ...

    async def backend_status(self) -> list[BackendStatus]: ...

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        """All-time ledger totals keyed by (tenant, model)."""
        ...

    async def tenant_usage(self, tenant: str, period_keys: Iterable[str]) -> TenantUsage: ...

    async def close(self) -> None: ...
