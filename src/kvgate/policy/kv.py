"""Per-backend KV in-flight budget and concurrency: pure admission logic, no I/O.

A backend's capacity is a pool of KV tokens. Each admitted request reserves its worst case
(prompt + max_new per choice, rounded up to whole KV blocks) until it settles, so the admitted
load can never exceed what the GPU holds and vLLM never has to preempt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvgate.policy.tenant import TenantHold
from kvgate.policy.types import (
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Decision,
    Reason,
    Reservation,
)

MIN_RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class ThroughputEstimate:
    """Moving averages of how fast this backend finishes work, learnt from settlements.

    Used only to tell a rejected client when capacity is likely to free up.
    """

    seconds_per_output_token: float = 0.02
    output_tokens_per_request: float = 256.0
    alpha: float = 0.2
    samples: int = 0

    def observe(self, duration_s: float, output_tokens: int) -> None:
        if duration_s <= 0:
            return
        per_token = duration_s / max(1, output_tokens)
        if self.samples == 0:
            self.seconds_per_output_token = per_token
            self.output_tokens_per_request = float(output_tokens)
        else:
            a = self.alpha
            self.seconds_per_output_token += a * (per_token - self.seconds_per_output_token)
            self.output_tokens_per_request += a * (output_tokens - self.output_tokens_per_request)
        self.samples += 1

    def expected_finish(self, reservation: Reservation) -> float:
        req = reservation.request
        expected_tokens = min(req.max_new_tokens, max(1.0, self.output_tokens_per_request))
        return reservation.started_at + expected_tokens * self.seconds_per_output_token


@dataclass(slots=True)
class BackendLedger:
    """The in-flight work of one backend."""

    limits: BackendLimits
    in_flight: dict[str, Reservation] = field(default_factory=dict)
    kv_tokens_in_flight: int = 0
    throughput: ThroughputEstimate = field(default_factory=ThroughputEstimate)

    @property
    def requests_in_flight(self) -> int:
        return len(self.in_flight)

    def check(self, request: AdmissionRequest, now: float) -> Decision | None:
        """Why the request does not fit now, or None if it does. Changes nothing."""
        return check_backend(self, request, now)

    def commit(
        self,
        request: AdmissionRequest,
        reservation_id: str,
        now: float,
        lease_ttl_s: float,
        hold: TenantHold | None = None,
    ) -> Reservation:
        reservation = new_reservation(self.limits, request, reservation_id, now, lease_ttl_s, hold)
        self.in_flight[reservation_id] = reservation
        self.kv_tokens_in_flight += reservation.kv_tokens
        return reservation

    def try_reserve(
        self, request: AdmissionRequest, reservation_id: str, now: float, lease_ttl_s: float
    ) -> Decision:
        rejection = self.check(request, now)
        if rejection is not None:
            return rejection
        reservation = self.commit(request, reservation_id, now, lease_ttl_s)
        return Decision(admitted=True, reason=Reason.ADMITTED, reservation=reservation)

    def release(self, reservation_id: str) -> Reservation | None:
        """Free a reservation; None if it was already released (settling is idempotent)."""
        reservation = self.in_flight.pop(reservation_id, None)
        if reservation is not None:
            self.kv_tokens_in_flight -= reservation.kv_tokens
        return reservation

    def renew(self, reservation_id: str, now: float, lease_ttl_s: float) -> bool:
        """Extend a live lease. One already past its expiry is lost even before a sweep
        frees it: renewing it would resurrect capacity another replica may have counted."""
        reservation = self.in_flight.get(reservation_id)
        if reservation is None or reservation.expires_at <= now:
            return False
        self.in_flight[reservation_id] = replace(reservation, expires_at=now + lease_ttl_s)
        return True

    def expire(self, now: float) -> list[Reservation]:
        """Drop leases nobody renewed: a lost stream must not hold capacity forever."""
        expired = [r for r in self.in_flight.values() if r.expires_at <= now]
        for reservation in expired:
            self.release(reservation.reservation_id)
        return expired

    def status(self) -> BackendStatus:
        return BackendStatus(
            name=self.limits.name,
            kv_budget_tokens=self.limits.kv_budget_tokens,
            kv_tokens_in_flight=self.kv_tokens_in_flight,
            requests_in_flight=len(self.in_flight),
            max_concurrent_requests=self.limits.max_concurrent_requests,
        )

    def seconds_until_freed(
        self,
        now: float,
        kv_needed: int,
        slots_needed: int = 0,
        tenant: str | None = None,
    ) -> float:
        """Estimate when enough in-flight work finishes to free what is missing.

        Walks the in-flight requests in their expected finishing order (from the learnt
        decode speed) until the freed KV tokens and slots cover the deficit.
        """
        finishing = sorted(
            (self.throughput.expected_finish(r), r.kv_tokens)
            for r in self.in_flight.values()
            if tenant is None or r.request.tenant == tenant
        )
        freed_kv = 0
        wait = MIN_RETRY_AFTER_S
        for freed_slots, (finish_at, kv_tokens) in enumerate(finishing, start=1):
            freed_kv += kv_tokens
            wait = finish_at - now
            if freed_kv >= kv_needed and freed_slots >= slots_needed:
                break
        return float(max(MIN_RETRY_AFTER_S, math.ceil(wait)))


class BackendView(Protocol):
    """What admission reads of one backend: the in-memory ledger, or the state the Redis
    reserve script saw (which also made the reservation)."""

    limits: BackendLimits
    kv_tokens_in_flight: int

    @property
    def requests_in_flight(self) -> int: ...

    def seconds_until_freed(
        self, now: float, kv_needed: int, slots_needed: int = 0, tenant: str | None = None
    ) -> float: ...

    def commit(
        self,
        request: AdmissionRequest,
        reservation_id: str,
        now: float,
        lease_ttl_s: float,
        hold: TenantHold | None = None,
    ) -> Reservation:
        """Record the admitted request's reservation and return it."""
        ...


def new_reservation(
    limits: BackendLimits,
    request: AdmissionRequest,
    reservation_id: str,
    now: float,
    lease_ttl_s: float,
    hold: TenantHold | None = None,
) -> Reservation:
    return Reservation(
        reservation_id=reservation_id,
        request=request,
        kv_tokens=limits.round_to_blocks(request.cost_tokens),
        started_at=now,
        expires_at=now + lease_ttl_s,
        hold=hold,
    )


def check_backend(backend: BackendView, request: AdmissionRequest, now: float) -> Decision | None:
    """Why the request does not fit the backend now, or None if it does. Changes nothing."""
    kv_tokens = backend.limits.round_to_blocks(request.cost_tokens)
    if kv_tokens > backend.limits.kv_budget_tokens:
        # Waiting cannot help: even an idle backend could not hold this request.
        return Decision(
            admitted=False,
            reason=Reason.REQUEST_EXCEEDS_KV_BUDGET,
            detail=(
                f"This request needs {kv_tokens} KV tokens (prompt {request.prompt_tokens} "
                f"+ max new {request.reserved_output_tokens}), more than backend "
                f"'{backend.limits.name}' holds in total ({backend.limits.kv_budget_tokens})."
            ),
        )
    if backend.requests_in_flight >= backend.limits.max_concurrent_requests:
        return Decision(
            admitted=False,
            reason=Reason.BACKEND_CONCURRENCY_LIMIT,
            retry_after_s=backend.seconds_until_freed(now, kv_needed=0, slots_needed=1),
            detail=(
                f"Backend '{backend.limits.name}' is at its limit of "
                f"{backend.limits.max_concurrent_requests} concurrent requests."
            ),
        )
    free = backend.limits.kv_budget_tokens - backend.kv_tokens_in_flight
    if kv_tokens > free:
        return Decision(
            admitted=False,
            reason=Reason.KV_BUDGET_EXHAUSTED,
            retry_after_s=backend.seconds_until_freed(now, kv_needed=kv_tokens - free),
            detail=(
                f"Backend '{backend.limits.name}' has {free} of "
                f"{backend.limits.kv_budget_tokens} KV tokens free; this request needs "
                f"{kv_tokens}."
            ),
        )
    return None
