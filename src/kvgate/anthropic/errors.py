"""Anthropic-shaped error answers: kvgate's ``ErrorVocabulary`` for the Messages API.

Every refusal on ``/v1/messages`` carries the body Anthropic's API (and vLLM's Anthropic
front end) answers with, so that the official SDKs raise the class that goes with the
status and clients that branch on ``error.type`` find Anthropic's vocabulary::

    {"type": "error", "error": {"type": "rate_limit_error", "message": "..."}}

The types by status, as Anthropic documents them and vLLM's ``translate_error_type``
maps them: 400 ``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 429 ``rate_limit_error``, 500
``api_error``, 503 ``overloaded_error`` (vLLM reports overload as 503, and so does
kvgate; Anthropic's own 529 is the engine's to send, never kvgate's).

Rate limits ride on Anthropic's headers: ``anthropic-ratelimit-requests-limit``,
``-remaining``, ``-reset`` and the same for ``tokens``, the reset as the RFC 3339 time at
which the limit is fully replenished; a refusal that waiting can cure has ``retry-after``
(whole seconds) and ``retry-after-ms``. Messages are safe to show: no credentials, client
values clipped, no internal addresses (``kvgate.openai.errors.without_addresses``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from kvgate.openai.errors import clip, without_addresses
from kvgate.policy import RateLimitView

__all__ = [
    "API_ERROR",
    "AUTHENTICATION_ERROR",
    "ERRORS",
    "INVALID_REQUEST_ERROR",
    "NOT_FOUND_ERROR",
    "OVERLOADED_ERROR",
    "PERMISSION_ERROR",
    "RATE_LIMIT_ERROR",
    "AnthropicError",
    "AnthropicErrors",
    "error_type_for_status",
    "format_reset",
    "invalid_request",
]

INVALID_REQUEST_ERROR = "invalid_request_error"
AUTHENTICATION_ERROR = "authentication_error"
PERMISSION_ERROR = "permission_error"
NOT_FOUND_ERROR = "not_found_error"
REQUEST_TOO_LARGE = "request_too_large"
RATE_LIMIT_ERROR = "rate_limit_error"
API_ERROR = "api_error"
OVERLOADED_ERROR = "overloaded_error"

_TYPE_BY_STATUS = {
    400: INVALID_REQUEST_ERROR,
    401: AUTHENTICATION_ERROR,
    403: PERMISSION_ERROR,
    404: NOT_FOUND_ERROR,
    413: REQUEST_TOO_LARGE,
    429: RATE_LIMIT_ERROR,
    503: OVERLOADED_ERROR,
    529: OVERLOADED_ERROR,
}

IDEMPOTENCY_HEADER = "Idempotency-Key"


def error_type_for_status(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (as vLLM's ``translate_error_type``)."""
    known = _TYPE_BY_STATUS.get(status)
    if known is not None:
        return known
    return API_ERROR if status >= 500 else INVALID_REQUEST_ERROR


class AnthropicError(Exception):
    """An answer in Anthropic's error shape: ``status``, ``headers``, ``to_body()``."""

    __slots__ = ("headers", "message", "status", "type")

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,  # Anthropic's field name
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = without_addresses(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for_status(status)
        # Lower-case names: Envoy (HTTP/2 semantics) wants them that way.
        self.headers: dict[str, str] = {k.lower(): v for k, v in headers.items()} if headers else {}

    def to_dict(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def to_body(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"AnthropicError(status={self.status}, type={self.type!r}, message={self.message!r})"


def invalid_request(message: str) -> AnthropicError:
    """400 ``invalid_request_error``."""
    return AnthropicError(400, message, INVALID_REQUEST_ERROR)


def _retry_headers(retry_after_s: float | None) -> dict[str, str]:
    # Whole seconds, rounded up and never 0 (RFC 9110); the SDKs prefer retry-after-ms.
    if retry_after_s is None or not math.isfinite(retry_after_s):
        return {}
    seconds = max(1, math.ceil(retry_after_s))
    millis = max(1, math.ceil(retry_after_s * 1000.0))
    return {"retry-after": str(seconds), "retry-after-ms": str(millis)}


def format_reset(now_s: float, reset_in_s: float | None) -> str:
    """The RFC 3339 UTC time ``reset_in_s`` seconds after ``now_s``, in whole seconds
    rounded up (as Anthropic writes it: ``2026-01-02T03:04:05Z``)."""
    at = math.ceil(now_s + max(0.0, reset_in_s or 0.0))
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class AnthropicErrors:
    """kvgate's refusals in Anthropic's shape (``kvgate.lifecycle.protocol.ErrorVocabulary``).

    ``clock`` gives the wall-clock time (seconds since the epoch) the rate-limit resets
    are written from."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock

    # ------------------------------------------------------------------ 4xx

    def invalid_request(
        self, message: str, param: str | None = None, code: str | None = None
    ) -> AnthropicError:
        """400. Anthropic's body has no ``param`` or ``code``: the message names the field."""
        del code
        if param and not message.startswith(param):
            # kvgate's own checks name a header or a field apart from their message.
            message = f"{param}: {message}"
        return invalid_request(message)

    def missing_api_key(self, header: str | None = None) -> AnthropicError:
        where = clip(header) if header else "x-api-key"
        return AnthropicError(401, f"{where} header is required", AUTHENTICATION_ERROR)

    def invalid_api_key(self) -> AnthropicError:
        # Anthropic's wording; no part of the key is ever echoed.
        return AnthropicError(401, "invalid x-api-key", AUTHENTICATION_ERROR)

    def refused_api_key(self, why: str) -> AnthropicError:
        message = f"API key has been {why}" if why == "revoked" else f"API key has {why}"
        return AnthropicError(401, message, AUTHENTICATION_ERROR)

    def unknown_identity(self) -> AnthropicError:
        return AnthropicError(
            401,
            "The verified identity of this request (its token or client certificate) is not "
            "allowed to use this gateway.",
            AUTHENTICATION_ERROR,
        )

    def model_not_found(self, model: str) -> AnthropicError:
        # Also the answer when the key may not use the model (as Anthropic: not found).
        return AnthropicError(404, f"model: {clip(model)}", NOT_FOUND_ERROR)

    def context_length_exceeded(
        self,
        prompt_tokens: int,
        max_new: int | None,
        max_context: int,
        param: str = "messages",
        *,
        at_least: bool = False,
    ) -> AnthropicError:
        """400 with Anthropic's wording for a prompt (plus ``max_tokens``) over the context."""
        del param
        some = "at least " if at_least else ""
        if max_new:
            message = (
                f"input length and `max_tokens` exceed context limit: {some}{prompt_tokens} + "
                f"{max_new} > {max_context}, decrease input length or `max_tokens` and try again"
            )
        else:
            message = f"prompt is too long: {some}{prompt_tokens} tokens > {max_context} maximum"
        return invalid_request(message)

    def unsupported_path(self, path: str, method: str = "POST") -> AnthropicError:
        route = path.split("?", 1)[0]  # a query string may hold secrets
        return AnthropicError(404, f"Not Found: {clip(method, 16)} {clip(route)}", NOT_FOUND_ERROR)

    def method_not_allowed(
        self, method: str, path: str | None = None, allowed: tuple[str, ...] | None = None
    ) -> AnthropicError:
        allow = ", ".join(allowed or ("POST",))
        where = f"on {clip(path.partition('?')[0])}" if path else "on this endpoint"
        return AnthropicError(
            405,
            f"Method {clip(method, 16)} is not allowed {where}; use {allow}.",
            INVALID_REQUEST_ERROR,
            {"allow": allow},
        )

    def rate_limited(
        self,
        message: str,
        code: str = "rate_limit_exceeded",
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        error_type: str = "rate_limit_exceeded",
    ) -> AnthropicError:
        """429 ``rate_limit_error`` whatever the limit (RPM, tokens, budget, KV, queue):
        Anthropic has one type for them; the message says which."""
        del code, error_type
        merged: dict[str, str] = dict(headers) if headers else {}
        merged.update(_retry_headers(retry_after_s))
        return AnthropicError(429, message, RATE_LIMIT_ERROR, merged)

    # ------------------------------------------------------------------ the answer layer

    def idempotency_key_reused(self) -> AnthropicError:
        return AnthropicError(
            422,
            f"{IDEMPOTENCY_HEADER}: already used with a different request body. Use a new key "
            "for a new request.",
            INVALID_REQUEST_ERROR,
        )

    def idempotency_key_in_progress(self, retry_after_s: float) -> AnthropicError:
        return AnthropicError(
            409,
            f"{IDEMPOTENCY_HEADER}: a request with this key is still being processed. Retry "
            "later to receive its answer.",
            INVALID_REQUEST_ERROR,
            _retry_headers(retry_after_s),
        )

    def idempotency_answer_not_kept(self, reason: str) -> AnthropicError:
        why = (
            "was larger than kvgate keeps"
            if reason == "too_large"
            else "did not fit your idempotency storage quota"
        )
        return AnthropicError(
            409,
            f"{IDEMPOTENCY_HEADER}: a request with this key already completed, but its answer "
            f"{why}, so it cannot be replayed. Use a new key to run the request again.",
            INVALID_REQUEST_ERROR,
        )

    def idempotency_keys_exhausted(self, retry_after_s: float) -> AnthropicError:
        return AnthropicError(
            429,
            "Too many of your Idempotency-Keys and their answers are stored right now. Retry "
            "later, or send the request without an Idempotency-Key.",
            RATE_LIMIT_ERROR,
            _retry_headers(retry_after_s),
        )

    def idempotency_waiters_exceeded(self, retry_after_s: float) -> AnthropicError:
        return AnthropicError(
            429,
            "Too many of your requests are already waiting for the answer of an earlier "
            "request with the same Idempotency-Key. Retry later.",
            RATE_LIMIT_ERROR,
            _retry_headers(retry_after_s),
        )

    # ------------------------------------------------------------------ 5xx and routes

    def service_unavailable(
        self,
        message: str = "The server is temporarily unable to handle the request. Please retry.",
        retry_after_s: float | None = None,
    ) -> AnthropicError:
        """503 ``overloaded_error``: kvgate (or what it depends on) cannot decide now."""
        return AnthropicError(503, message, OVERLOADED_ERROR, _retry_headers(retry_after_s))

    def route_misconfigured(self, key: str) -> AnthropicError:
        return AnthropicError(
            500,
            f"The gateway's route settings for kvgate are invalid ({clip(key)}); the request "
            "was not forwarded. Operators: see kvgate's log.",
            API_ERROR,
        )

    def tenant_not_allowed_on_route(self) -> AnthropicError:
        return AnthropicError(403, "Your API key may not be used on this route.", PERMISSION_ERROR)

    def internal_error(
        self, message: str = "kvgate could not process this request."
    ) -> AnthropicError:
        return AnthropicError(500, message, API_ERROR)

    # ------------------------------------------------------------------ rate-limit headers

    def rate_limit_headers(self, view: RateLimitView | None) -> dict[str, str]:
        """Anthropic's ``anthropic-ratelimit-*`` headers for the tenant's limits."""
        if view is None:
            return {}
        now = self._clock()
        headers: dict[str, str] = {}
        if view.limit_requests is not None:
            headers["anthropic-ratelimit-requests-limit"] = str(view.limit_requests)
            headers["anthropic-ratelimit-requests-remaining"] = str(view.remaining_requests)
            headers["anthropic-ratelimit-requests-reset"] = format_reset(now, view.reset_requests_s)
        if view.limit_tokens is not None:
            headers["anthropic-ratelimit-tokens-limit"] = str(view.limit_tokens)
            headers["anthropic-ratelimit-tokens-remaining"] = str(view.remaining_tokens)
            headers["anthropic-ratelimit-tokens-reset"] = format_reset(now, view.reset_tokens_s)
        return headers


#: The vocabulary the Messages API answers with (wall-clock resets).
ERRORS = AnthropicErrors()
