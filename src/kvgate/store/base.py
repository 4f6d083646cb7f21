"""The StateStore protocol: where admission state lives.

The in-memory store is the embedded default; a shared store (Redis) implements the same
protocol so several kvgate replicas enforce one set of limits.
"""

from __future__ import annotations

from collections.abc import Callable
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
    UsageTotals,
)

ExpiredLeaseHook = Callable[[Reservation], None]


class StateStore(Protocol):
    async def reserve(self, request: AdmissionRequest, limits: BackendLimits) -> Decision:
        """Check every limit and reserve capacity, atomically: all or nothing."""
        ...

    async def settle(
        self, reservation: Reservation, cause: SettleCause, usage: ActualUsage
    ) -> Settlement:
        """Release the reservation and record usage. Idempotent: a second call applies nothing."""
        ...

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live stream's lease; False if it is gone (settled or expired)."""
        ...

    async def backend_status(self) -> list[BackendStatus]: ...

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        """Ledger totals keyed by (tenant, model)."""
        ...

    async def close(self) -> None: ...
