"""The one mapping from lifecycle outcomes to HTTP: a rejection's status, OpenAI error body
and headers, and the headers an admitted request's answer carries."""

from __future__ import annotations

import enum

from kvgate.extproc.ratelimit_headers import rate_limit_headers
from kvgate.lifecycle.admission import Rejection
from kvgate.lifecycle.ticket import Ticket, served_otherwise_headers
from kvgate.openai import ApiError
from kvgate.openai import errors as api_errors
from kvgate.policy import Reason

# Waiting cannot help these: a 400 naming the field, with no Retry-After.
_TOO_LARGE = frozenset({Reason.REQUEST_EXCEEDS_KV_BUDGET, Reason.REQUEST_EXCEEDS_TPM})
# kvgate or what it depends on cannot decide now: 503 with Retry-After.
_UNAVAILABLE = frozenset(
    {
        Reason.STORE_UNAVAILABLE,
        Reason.CAPACITY_UNKNOWN,
        Reason.NO_HEALTHY_ENDPOINT,
        Reason.COUNTING_UNAVAILABLE,
    }
)


class Answer(enum.StrEnum):
    """How the adapter answered a request without admission deciding it: protocol outcomes,
    metric labels beside the policy's `Reason`s."""

    PASSTHROUGH = "passthrough"
    USAGE_REPORT = "usage_report"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_PATH = "unsupported_path"
    # kvgate could not decide within server.decision_timeout_s (before Envoy's deadline).
    DECISION_TIMEOUT = "decision_timeout"
    INTERNAL_ERROR = "internal_error"
    # Envoy's per-route settings (route_settings.py): unusable, or not for this request.
    ROUTE_MISCONFIGURED = "route_misconfigured"
    TENANT_NOT_ALLOWED_ON_ROUTE = "tenant_not_allowed_on_route"
    MODEL_NOT_ALLOWED_ON_ROUTE = "model_not_allowed_on_route"


def api_error(rejection: Rejection) -> ApiError:
    reason = rejection.reason
    if reason is Reason.MODEL_NOT_FOUND:
        return api_errors.model_not_found(rejection.message)
    if reason is Reason.CONTEXT_LENGTH_EXCEEDED and rejection.context is not None:
        numbers = rejection.context
        return api_errors.context_length_exceeded(
            numbers.prompt_tokens,
            numbers.max_new_tokens,
            numbers.max_context,
            param=rejection.param or "messages",
            at_least=numbers.at_least,
        )
    if reason is Reason.MIN_TOKENS_OVER_CAP:
        return api_errors.invalid_request(rejection.message, rejection.param, "invalid_value")
    if reason is Reason.UNRENDERABLE_PROMPT:
        return api_errors.invalid_request(rejection.message, rejection.param)
    if reason in _TOO_LARGE:
        return api_errors.invalid_request(rejection.message, rejection.param, reason.value)
    if reason in _UNAVAILABLE:
        return api_errors.service_unavailable(rejection.message, rejection.retry_after_s)
    headers = rate_limit_headers(rejection.rate_limits)
    if reason is Reason.BUDGET_EXCEEDED:
        return api_errors.rate_limited(
            rejection.message,
            reason.value,
            rejection.retry_after_s,
            headers,
            error_type="insufficient_quota",
        )
    # Every other limit: RPM, TPM, concurrency, KV, back-pressure, counting queue.
    return api_errors.rate_limited(
        rejection.message, reason.value, rejection.retry_after_s, headers
    )


def answer_headers(ticket: Ticket) -> dict[str, str]:
    """Headers for an admitted request's answer: x-ratelimit-*, fallback and clamp notices."""
    return rate_limit_headers(ticket.rate_limits) | served_otherwise_headers(ticket)
