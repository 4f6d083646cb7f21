"""The ticket: one admitted request, carried unchanged from admission to settlement."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgate.config.snapshot import ModelRoute
from kvgate.openai import ParsedRequest
from kvgate.policy import Pricing, RateLimitView, Reservation

# On an answer served by another model than asked (a budget fallback): "asked -> served".
FALLBACK_HEADER = "x-kvgate-fallback"
# On an answer generated under a lower cap than asked (a budget clamp): "asked -> cap".
CLAMP_HEADER = "x-kvgate-max-tokens-clamped"


@dataclass(frozen=True, slots=True)
class BodyRewrite:
    """What admission decided that the forwarded body must say instead of the client's."""

    # The served model (a budget fallback's); None: the body's own.
    model: str | None
    # The reserved cap per sequence; None: the body already says exactly it.
    max_new_tokens: int | None

    @property
    def needed(self) -> bool:
        return self.model is not None or self.max_new_tokens is not None


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission decided for one request. Immutable: every later step reads it, none
    copies its fields. After a budget fallback `route` is the model that serves it."""

    reservation: Reservation
    route: ModelRoute
    request: ParsedRequest
    # The client's x-request-id (logs, access log); the store keys on the reservation.
    request_id: str
    # Prompt tokens by kvgate's count (all prompts of a completions batch).
    prompt_tokens: int
    # The cap per sequence the engine may generate: what was reserved.
    max_new_tokens: int
    # Written into the forwarded body: the served model after a budget fallback.
    new_model: str | None = None
    # The tenant's rate limits after this admission (for x-ratelimit-* headers).
    rate_limits: RateLimitView | None = None
    # The model asked for, when a budget fallback serves another one.
    fallback_from: str | None = None
    # The cap asked for, when a budget clamp lowered it to max_new_tokens.
    clamped_from: int | None = None
    # kvgate asked the engine for the usage event the client did not ask for, so the
    # response meter strips it again.
    usage_injected: bool = False
    # A pool's endpoint (IP:PORT) the request was placed on: Envoy's destination. None for
    # a backend that is one Envoy cluster.
    endpoint: str | None = None

    @property
    def tenant(self) -> str:
        return self.reservation.request.tenant

    @property
    def model(self) -> str:
        """The model that serves the request (after a fallback, not the one asked)."""
        return self.reservation.request.model

    @property
    def backend(self) -> str:
        """The KV ledger the reservation holds: the backend, or a pool's endpoint
        (`pool/IP:PORT`)."""
        return self.reservation.request.backend

    @property
    def cluster(self) -> str:
        """The Envoy cluster the request is routed to (the configured backend's name)."""
        return self.route.backend

    @property
    def pricing(self) -> Pricing:
        return self.route.pricing

    def with_usage_injected(self) -> Ticket:
        """This ticket, for a request whose forwarded body asks for the usage event."""
        return replace(self, usage_injected=True)

    @property
    def body_needs_cap(self) -> bool:
        """Whether the reserved cap must be written into the forwarded body: whenever the
        body does not already carry exactly it (no max_tokens, null, a clamp, both names
        with different values)."""
        request = self.request
        exact = request.max_tokens_param is not None and request.max_new_tokens == (
            self.max_new_tokens
        )
        return not exact or request.conflicting_caps

    @property
    def body_rewrite(self) -> BodyRewrite:
        """The model and cap each API writes into its forwarded body (the cap only where
        the body does not already carry exactly it)."""
        return BodyRewrite(
            model=self.new_model,
            max_new_tokens=self.max_new_tokens if self.body_needs_cap else None,
        )


def served_otherwise_headers(ticket: Ticket) -> dict[str, str]:
    """The headers that say an answer is not exactly what was asked: served by a budget
    fallback's model, or under a budget clamp's lower cap (empty when it is)."""
    headers: dict[str, str] = {}
    if ticket.fallback_from is not None:
        headers[FALLBACK_HEADER] = f"{ticket.fallback_from} -> {ticket.route.name}"
    if ticket.clamped_from is not None:
        headers[CLAMP_HEADER] = f"{ticket.clamped_from} -> {ticket.max_new_tokens}"
    return headers
