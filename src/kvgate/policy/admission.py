"""The whole admission decision for one request: tenant limits + backend KV, all or nothing."""

from __future__ import annotations

from kvgate.policy import tenant as tenant_limits
from kvgate.policy.kv import MIN_RETRY_AFTER_S, BackendView, check_backend
from kvgate.policy.tenant import TenantPolicy, TenantState, Violation
from kvgate.policy.types import (
    ActualUsage,
    AdmissionRequest,
    Decision,
    Reason,
    Reservation,
)


def _retry_after(
    violation: Violation, backend: BackendView, tenant: str, now: float
) -> float | None:
    if violation.frees_with_work:
        return backend.seconds_until_freed(now, kv_needed=0, slots_needed=1, tenant=tenant)
    if violation.retry_after_s is None:
        return None
    return max(MIN_RETRY_AFTER_S, violation.retry_after_s)


def _rejection(
    candidates: list[tuple[Reason, float | None, str]],
    violations: list[Violation],
    policy: TenantPolicy,
    state: TenantState,
    now: float,
    budget_left: int | None,
) -> Decision:
    """Name the broken limit that keeps the request out the longest (None = for ever)."""
    reason, retry_after, detail = max(
        candidates, key=lambda c: float("inf") if c[1] is None else c[1]
    )
    return Decision(
        admitted=False,
        reason=reason,
        retry_after_s=retry_after,
        detail=detail,
        violations=tuple(violations),
        rate_limits=tenant_limits.rate_limit_view(policy, state, now),
        budget_left_pico=budget_left,
    )


def admit(
    request: AdmissionRequest,
    *,
    backend: BackendView,
    policy: TenantPolicy,
    state: TenantState,
    reservation_id: str,
    now: float,
    wall: float,
    lease_ttl_s: float,
) -> Decision:
    """Check every limit; reserve on all of them only if none enforced is broken.

    When several limits are broken, the answer names the one that keeps the request out the
    longest: a limit waiting cannot fix first, then the longest wait, so a client that
    honours Retry-After is not turned away again by a second limit.
    """
    tokens = request.cost_tokens
    violations = tenant_limits.evaluate(
        policy,
        state,
        model=request.model,
        tokens=tokens,
        cost_pico=request.cost_pico,
        now=now,
        wall=wall,
        request_slot_taken=request.request_slot_taken,
    )
    budget_left = tenant_limits.budget_left_pico(policy, state, wall)
    candidates: list[tuple[Reason, float | None, str]] = [
        (v.reason, _retry_after(v, backend, request.tenant, now), v.detail)
        for v in violations
        if not v.shadow
    ]
    backend_rejection = check_backend(backend, request, now)
    if backend_rejection is not None:
        candidates.append(
            (backend_rejection.reason, backend_rejection.retry_after_s, backend_rejection.detail)
        )
    if candidates:
        return _rejection(candidates, violations, policy, state, now, budget_left)
    hold = tenant_limits.apply(
        policy,
        state,
        model=request.model,
        tokens=tokens,
        cost_pico=request.cost_pico,
        now=now,
        wall=wall,
        request_slot_taken=request.request_slot_taken,
    )
    reservation = backend.commit(request, reservation_id, now, lease_ttl_s, hold)
    return Decision(
        admitted=True,
        reason=Reason.ADMITTED,
        reservation=reservation,
        violations=tuple(violations),
        rate_limits=tenant_limits.rate_limit_view(policy, state, now),
        budget_left_pico=budget_left,
    )


def precheck(
    lower_bound: AdmissionRequest,
    *,
    backend: BackendView,
    policy: TenantPolicy,
    state: TenantState,
    now: float,
    wall: float,
    take_request_slot: bool = False,
) -> Decision | None:
    """Reject early, before the prompt is tokenized, when a tenant limit fails even for the
    cheapest request this could be (`lower_bound`: one prompt token, the asked max_new).

    Every tenant check is monotonic in tokens and cost, so a violation found for the lower
    bound is a violation for the real request too: the answer is never wrong, only its
    Retry-After may be shorter than the full check's.

    With `take_request_slot`, a pre-check that finds nothing (None) takes the request from
    the tenant's RPM buckets (every scope), so RPM bites before the prompt is tokenized; the
    reserve then says `request_slot_taken`. A rejection takes nothing. Without it (or when
    `lower_bound.request_slot_taken`: RPM was taken already) nothing is changed.
    """
    violations = tenant_limits.evaluate(
        policy,
        state,
        model=lower_bound.model,
        tokens=lower_bound.cost_tokens,
        cost_pico=lower_bound.cost_pico,
        now=now,
        wall=wall,
        request_slot_taken=lower_bound.request_slot_taken,
    )
    candidates = [
        (v.reason, _retry_after(v, backend, lower_bound.tenant, now), v.detail)
        for v in violations
        if not v.shadow
    ]
    if not candidates:
        if take_request_slot and not lower_bound.request_slot_taken:
            tenant_limits.take_request_slot(policy, state, model=lower_bound.model, now=now)
        return None
    budget_left = tenant_limits.budget_left_pico(policy, state, wall)
    return _rejection(candidates, violations, policy, state, now, budget_left)


def settle_tenant(
    policy: TenantPolicy,
    state: TenantState,
    reservation: Reservation,
    usage: ActualUsage,
    cost_pico: int,
    now: float,
    wall: float | None = None,
) -> None:
    if reservation.hold is None:
        return
    tenant_limits.release(
        policy,
        state,
        reservation.hold,
        used_tokens=usage.total_tokens,
        cost_pico=cost_pico,
        now=now,
        wall=wall,
    )
