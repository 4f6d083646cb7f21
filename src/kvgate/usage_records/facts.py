"""What the exchange knows of one request beyond its ticket, and the records built from a
settlement or a served stored answer."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.lifecycle.billing import ResponseReading
from kvgate.lifecycle.ticket import Ticket
from kvgate.policy import ActualUsage, Period, Pricing, SettleCause, period_key
from kvgate.usage_records.record import AnswerSource, UsageRecord, pricing_version


@dataclass(frozen=True, slots=True)
class Principal:
    """Who the caller is inside its tenant, where known: the team and user a key or a
    token names, and the key directory's key id."""

    team: str | None = None
    user: str | None = None
    key_id: str | None = None


NO_PRINCIPAL = Principal()


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """Timed by the exchange (milliseconds from the request body's arrival)."""

    api: str
    request_id: str = ""
    principal: Principal = NO_PRINCIPAL
    # The route's backend override, when one applied.
    route: str | None = None
    decision_ms: float | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None


def _periods(ticket: Ticket, wall: float) -> tuple[str, str]:
    """The ledger's day and month the settlement is booked in: the reservation's own."""
    hold = ticket.reservation.hold
    if hold is not None:
        keys = dict(hold.period_keys)
        day, month = keys.get(Period.DAY), keys.get(Period.MONTH)
        if day is not None and month is not None:
            return day, month
    return period_key(Period.DAY, wall), period_key(Period.MONTH, wall)


def settled_record(
    ticket: Ticket,
    cause: SettleCause,
    reading: ResponseReading,
    usage: ActualUsage,
    cost_pico: int,
    facts: RequestFacts | None,
    *,
    wall: float,
    duration_s: float,
) -> UsageRecord:
    """The record of a request the ledger booked (its settlement applied)."""
    day, month = _periods(ticket, wall)
    request = ticket.request
    facts = facts or RequestFacts(api=str(request.kind), request_id=ticket.request_id)
    return UsageRecord(
        record_id=ticket.reservation.reservation_id,
        request_id=ticket.request_id,
        occurred_at=wall,
        ledger_day=day,
        ledger_month=month,
        tenant=ticket.tenant,
        api=facts.api,
        path=request.path,
        requested_model=ticket.fallback_from or request.model,
        served_model=ticket.model,
        backend=ticket.cluster,
        endpoint=ticket.endpoint,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        output_tokens=usage.output_tokens,
        # No meter reads reasoning tokens apart from the output yet.
        reasoning_tokens=None,
        cost_pico=cost_pico,
        pricing_version=pricing_version(ticket.pricing),
        answer_source=AnswerSource.BACKEND,
        status=reading.status,
        settle_cause=cause.value,
        booked_request=True,
        route=facts.route,
        decision_ms=facts.decision_ms,
        ttft_ms=facts.ttft_ms,
        duration_ms=facts.duration_ms if facts.duration_ms is not None else duration_s * 1000,
        team_id=facts.principal.team,
        user_id=facts.principal.user,
        key_id=facts.principal.key_id,
    )


def served_record(
    *,
    record_id: str,
    facts: RequestFacts | None,
    tenant: str,
    path: str,
    model: str,
    source: AnswerSource,
    status: int,
    prompt_tokens: int,
    output_tokens: int,
    pricing: Pricing | None,
    booked_request: bool,
    cache_hit: bool,
    wall: float,
) -> UsageRecord:
    """The record of a request answered from a stored answer (a cache hit, an
    Idempotency-Key replay): charged only when its hit was (``booked_request``)."""
    facts = facts or RequestFacts(api="")
    cost = pricing.cost(prompt_tokens, output_tokens, 0) if booked_request and pricing else 0
    return UsageRecord(
        record_id=record_id,
        request_id=facts.request_id,
        occurred_at=wall,
        ledger_day=period_key(Period.DAY, wall),
        ledger_month=period_key(Period.MONTH, wall),
        tenant=tenant,
        api=facts.api,
        path=path,
        requested_model=model,
        served_model=model,
        backend=None,
        endpoint=None,
        prompt_tokens=prompt_tokens if booked_request else 0,
        cached_tokens=0,
        output_tokens=output_tokens if booked_request else 0,
        reasoning_tokens=None,
        cost_pico=cost,
        pricing_version=pricing_version(pricing) if pricing else None,
        answer_source=source,
        status=status,
        settle_cause=SettleCause.COMPLETED.value,
        booked_request=booked_request,
        cache_hit=cache_hit,
        saved_tokens=prompt_tokens + output_tokens if cache_hit else 0,
        route=facts.route,
        decision_ms=facts.duration_ms,
        duration_ms=facts.duration_ms,
        team_id=facts.principal.team,
        user_id=facts.principal.user,
        key_id=facts.principal.key_id,
    )
