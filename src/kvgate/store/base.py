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
    Reason,
    Reservation,
    SettleCause,
    Settlement,
    TenantPolicy,
    UsageTotals,
)

ExpiredLeaseHook = Callable[[Reservation], None]

# A reservation's billing record outlives its lease by this much after the last reserve or
# renew: longer than any request runs, so its settlement is booked, once, however late.
BILL_RETENTION_S = 86_400.0
# After abandon(), a reserve for the same request that lands late (its reply was lost)
# commits nothing for this long.
ABANDON_RETENTION_S = 3_600.0


def abandoned_decision(request: AdmissionRequest) -> Decision:
    """What a reserve for an abandoned request answers: nothing was committed."""
    return Decision(
        admitted=False,
        reason=Reason.ABANDONED,
        detail=f"Request {request.request_id!r} was abandoned; it cannot be admitted again.",
    )


@dataclass(slots=True)
class TenantUsage:
    """One tenant's ledger for some budget periods ("2026-11-29", "2026-11")."""

    by_period_model: dict[tuple[str, str], UsageTotals] = field(default_factory=dict)
    spent_pico: dict[str, int] = field(default_factory=dict)
    reserved_pico: dict[str, int] = field(default_factory=dict)
    # (level scope key "@team:research", period key) -> what that level spent in the period.
    level_spent_pico: dict[tuple[str, str], int] = field(default_factory=dict)


class StateStore(Protocol):
    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        """Check every limit and reserve capacity, atomically: all or nothing."""
        ...

    async def precheck(
        self,
        lower_bound: AdmissionRequest,
        backend: BackendLimits,
        tenant: TenantPolicy,
        *,
        take_request_slot: bool = False,
    ) -> Decision | None:
        """A rejection that holds for any request at least as large as `lower_bound`, found
        without tokenizing; None when nothing is sure (or the store cannot tell cheaply).

        Without `take_request_slot` it changes nothing. With it, a pre-check that answers None
        has taken one request from the tenant's RPM buckets (tenant-wide and the model's
        scope), in the same atomic step as the check: the caller's reserve then says
        `request_slot_taken=True` and takes no RPM again. A rejection takes nothing. The slot
        is kept whatever follows (a refusal, a cancel, an abandon): the request was made."""
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
        """Release the reservation and book usage, exactly once: the billing record is consumed
        by the first call, so a second (or late duplicate) applies nothing. A reservation
        whose lease expired is still booked (`lease_expired=True`)."""
        ...

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live request's lease; False if the lease is lost (settled, abandoned or
        expired). Also keeps the billing record alive: an expired request is still billable,
        and settle() books it once (`Settlement.lease_expired`)."""
        ...

    async def abandon(self, request: AdmissionRequest) -> None:
        """Compensate a reserve() whose outcome the caller does not know (cancelled, timed
        out): release whatever it committed for `request.request_id` (KV, slots, the RPM and
        TPM tokens and the budget hold it took; nothing is billed; an RPM request taken by the
        pre-check is not the reserve's and stays taken), and make a reserve() for
        that request that lands later commit nothing. Idempotent; harmless when nothing was
        committed. The (tenant, request id) pair must identify one admission."""
        ...

    async def record_cache_hit(
        self, tenant: str, model: str, saved_tokens: int, period_keys: Iterable[str]
    ) -> None:
        """Book a request answered from a cache in the ledger: all-time and for the given
        periods (the day and the month)."""
        ...

    async def backend_status(self) -> list[BackendStatus]: ...

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        """All-time ledger totals keyed by (tenant, model)."""
        ...

    async def backend_totals(self) -> dict[str, UsageTotals]:
        """All-time ledger totals keyed by the ledger a request held (a backend, or a pool's
        endpoint ``pool/IP:PORT``): what kvgate booked for what it sent each engine."""
        ...

    async def tenant_usage(
        self, tenant: str, period_keys: Iterable[str], levels: Iterable[str] = ()
    ) -> TenantUsage:
        """The tenant's ledger for the periods; for each level scope key in `levels` ("@team:
        research", `Level.scope_key`) also its spend per period (`level_spent_pico`)."""
        ...

    async def close(self) -> None: ...
