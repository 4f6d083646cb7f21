"""OpenAI-shaped error responses.

Every rejection kvgate emits (as an Envoy ImmediateResponse) carries the body
OpenAI's API uses, so that official SDKs raise the right exception class and
surface the message unchanged::

    {"error": {"message": "...", "type": "...", "param": null, "code": null}}

All four keys are always present (null when unknown), as in OpenAI's answers.

Messages must be safe to show to the client: they never contain credentials,
and any value echoed from the request is clipped (see :func:`clip`). They never
name an internal address either: pool endpoints (pod IP:PORT) belong in logs and
metrics, and as a last guard :class:`ApiError` replaces any IP address left in a
message with ``<endpoint>``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from kvgate.policy import RateLimitView

__all__ = [
    "ApiError",
    "clip",
    "context_length_exceeded",
    "format_reset",
    "idempotency_answer_not_kept",
    "idempotency_key_in_progress",
    "idempotency_key_reused",
    "idempotency_keys_exhausted",
    "idempotency_waiters_exceeded",
    "internal_error",
    "invalid_api_key",
    "invalid_request",
    "method_not_allowed",
    "missing_api_key",
    "model_not_found",
    "rate_limit_headers",
    "rate_limited",
    "refused_api_key",
    "route_misconfigured",
    "service_unavailable",
    "tenant_not_allowed_on_route",
    "unknown_identity",
    "unsupported_path",
    "without_addresses",
]

#: Content type of every error body (the ImmediateResponse must set it, or Envoy
#: labels the body text/plain).
CONTENT_TYPE = "application/json"

INVALID_REQUEST_ERROR = "invalid_request_error"

# Longest echo of a client-supplied value inside an error message. Long enough
# to recognise a model name, short enough that a hostile value cannot bloat
# logs or the response.
_ECHO_LIMIT = 64

# An IPv4 address, or a bracketed IPv6 one, with an optional port: how pool endpoints are
# written (10.0.3.7:8000, [fd00::7]:8000).
_ADDRESS = re.compile(
    r"(?<![\w.])"
    r"(?:(?:\d{1,3}\.){3}\d{1,3}|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\])"
    r"(?::\d{1,5})?"
    r"(?!\w|\.\d)",
    re.ASCII,
)
ADDRESS_PLACEHOLDER = "<endpoint>"


def without_addresses(message: str) -> str:
    """``message`` with every IP address (and its port) replaced by a placeholder."""
    return _ADDRESS.sub(ADDRESS_PLACEHOLDER, message)


def clip(value: object, limit: int = _ECHO_LIMIT) -> str:
    """Render a client-supplied value for an error message, truncated to ``limit`` chars."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return text[:limit] + "..."


class ApiError(Exception):
    """An error to answer with, carrying the HTTP status and OpenAI's error fields.

    Raised by the parsers in this package and built by the helpers below; the
    extproc layer turns it into an ImmediateResponse with ``status``,
    ``headers`` (plus content-type) and ``to_body()``.
    """

    __slots__ = ("code", "headers", "message", "param", "status", "type")

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST_ERROR,  # OpenAI's field name
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = without_addresses(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        # Lower-case names: Envoy (HTTP/2 semantics) wants them that way.
        self.headers: dict[str, str] = {k.lower(): v for k, v in headers.items()} if headers else {}

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_body(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"ApiError(status={self.status}, type={self.type!r}, code={self.code!r}, "
            f"param={self.param!r}, message={self.message!r})"
        )


# --------------------------------------------------------------------------- 4xx


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request body or a parameter is invalid."""
    return ApiError(400, message, INVALID_REQUEST_ERROR, code, param)


def missing_api_key(header: str | None = None) -> ApiError:
    """401: no credential at all (in `header`, when the route names where the key goes).

    OpenAI answers this case with ``code: null``; so do we.
    """
    where = (
        f"Provide it in the {clip(header)} header."
        if header
        else "Provide it in the Authorization header using Bearer auth "
        "(Authorization: Bearer YOUR_KEY)."
    )
    return ApiError(
        401,
        f"You didn't provide an API key. {where}",
        INVALID_REQUEST_ERROR,
        None,
        None,
        {"www-authenticate": "Bearer"},
    )


def unknown_identity() -> ApiError:
    """401: the caller's identity, verified by the mesh (a token, a client certificate),
    names no tenant of this gateway. Which tenants exist is never said."""
    return ApiError(
        401,
        "The verified identity of this request (its token or client certificate) is not "
        "allowed to use this gateway.",
        INVALID_REQUEST_ERROR,
        "unknown_identity",
        None,
    )


def refused_api_key(why: str) -> ApiError:
    """401: a key kvgate issued that was revoked or has expired. The code stays
    ``invalid_api_key`` (what OpenAI clients branch on); the message says why."""
    return ApiError(
        401,
        f"This API key has been {why}." if why == "revoked" else f"This API key has {why}.",
        INVALID_REQUEST_ERROR,
        "invalid_api_key",
        None,
        {"www-authenticate": "Bearer"},
    )


def invalid_api_key() -> ApiError:
    """401: a credential was sent but is not valid.

    OpenAI's body is ``type: invalid_request_error, code: invalid_api_key``. OpenAI
    echoes a masked key; kvgate never echoes any part of it.
    """
    return ApiError(
        401,
        "Incorrect API key provided.",
        INVALID_REQUEST_ERROR,
        "invalid_api_key",
        None,
        {"www-authenticate": "Bearer"},
    )


def model_not_found(model: str) -> ApiError:
    """404 with OpenAI's wording (also used when the key may not use the model)."""
    return ApiError(
        404,
        f"The model `{clip(model)}` does not exist or you do not have access to it.",
        INVALID_REQUEST_ERROR,
        "model_not_found",
        None,
    )


def context_length_exceeded(
    prompt_tokens: int,
    max_new: int | None,
    max_context: int,
    param: str = "messages",
    *,
    at_least: bool = False,
) -> ApiError:
    """400: prompt (+ requested completion) does not fit the model's context.

    Wording follows OpenAI's; ``param`` is "messages" for chat and should be
    "prompt" for the completions endpoint. ``at_least``: ``prompt_tokens`` is a lower
    bound found without tokenizing (the prompt is too long whatever its exact count).
    """
    what = "messages" if param == "messages" else "prompt"
    some = "at least " if at_least else ""
    if max_new:
        message = (
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {some}{prompt_tokens + max_new} tokens ({some}{prompt_tokens} in the "
            f"{what}, {max_new} in the completion). Please reduce the length of the {what} or "
            f"completion."
        )
    else:
        message = (
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"{what} resulted in {some}{prompt_tokens} tokens. Please reduce the length of "
            f"the {what}."
        )
    return ApiError(400, message, INVALID_REQUEST_ERROR, "context_length_exceeded", param)


def unsupported_path(path: str, method: str = "POST") -> ApiError:
    """404 for an endpoint kvgate does not serve (OpenAI: "Invalid URL (POST /v1/x)")."""
    # Drop the query string: it is not part of the route and may hold secrets.
    route = path.split("?", 1)[0]
    return ApiError(
        404,
        f"Invalid URL ({clip(method, 16)} {clip(route)})",
        INVALID_REQUEST_ERROR,
        "unsupported_path",
        None,
    )


def method_not_allowed(
    method: str, path: str | None = None, allowed: tuple[str, ...] | None = None
) -> ApiError:
    """405 with the ``Allow`` header RFC 9110 requires.

    ``allowed`` defaults from ``path``: GET/HEAD for the read-only ``/v1/models``
    routes, POST for everything else (the generation endpoints).
    """
    route = path.partition("?")[0] if path is not None else None
    if allowed is None:
        read_only = route is not None and (route == "/v1/models" or route.startswith("/v1/models/"))
        allowed = ("GET", "HEAD") if read_only else ("POST",)
    allow = ", ".join(allowed)
    where = f"on {clip(route)}" if route else "on this endpoint"
    return ApiError(
        405,
        f"Method {clip(method, 16)} is not allowed {where}; use {allow}.",
        INVALID_REQUEST_ERROR,
        "method_not_allowed",
        None,
        {"allow": allow},
    )


def _retry_headers(retry_after_s: float | None) -> dict[str, str]:
    # Retry-After only takes whole seconds (RFC 9110), so round up and never say
    # 0 (clients would hammer). OpenAI's SDKs prefer the finer `retry-after-ms`.
    if retry_after_s is None or not math.isfinite(retry_after_s):
        return {}
    seconds = max(1, math.ceil(retry_after_s))
    millis = max(1, math.ceil(retry_after_s * 1000.0))
    return {"retry-after": str(seconds), "retry-after-ms": str(millis)}


def rate_limited(
    message: str,
    code: str = "rate_limit_exceeded",
    retry_after_s: float | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    error_type: str = "rate_limit_exceeded",
) -> ApiError:
    """429: a rate, concurrency or budget limit refused the request.

    ``code`` carries kvgate's reason (e.g. "tokens_per_minute"). OpenAI itself
    sends ``type: "tokens" | "requests"`` with ``code: "rate_limit_exceeded"``;
    pass ``error_type``/``code`` accordingly for byte-level mimicry. SDKs key off
    the status, not these strings. ``headers`` (e.g. ``x-ratelimit-*``) are
    merged; Retry-After derived from ``retry_after_s`` wins over a passed one.
    """
    merged: dict[str, str] = dict(headers) if headers else {}
    merged.update(_retry_headers(retry_after_s))
    return ApiError(429, message, error_type, code, None, merged)


# --------------------------------------------------------------------------- 5xx


IDEMPOTENCY_HEADER = "Idempotency-Key"


def idempotency_key_reused() -> ApiError:
    """422: the key was used before with another request body
    (draft-ietf-httpapi-idempotency-key-header)."""
    return ApiError(
        422,
        "This Idempotency-Key was already used with a different request body. Use a new "
        "key for a new request.",
        INVALID_REQUEST_ERROR,
        "idempotency_key_reused",
        IDEMPOTENCY_HEADER,
    )


def idempotency_key_in_progress(retry_after_s: float) -> ApiError:
    """409: the first request with this key is still running after the wait bound."""
    return ApiError(
        409,
        "A request with this Idempotency-Key is still being processed. Retry later to "
        "receive its answer.",
        INVALID_REQUEST_ERROR,
        "idempotency_key_in_progress",
        IDEMPOTENCY_HEADER,
        _retry_headers(retry_after_s),
    )


def idempotency_answer_not_kept(reason: str) -> ApiError:
    """409: the first request with this key completed, but its answer was not kept (too
    large, or over the tenant's storage quota): a duplicate is never generated again."""
    why = (
        "was larger than kvgate keeps"
        if reason == "too_large"
        else "did not fit your idempotency storage quota"
    )
    return ApiError(
        409,
        f"A request with this Idempotency-Key already completed, but its answer {why}, so it "
        "cannot be replayed. Use a new key to run the request again.",
        INVALID_REQUEST_ERROR,
        "idempotency_answer_not_kept",
        IDEMPOTENCY_HEADER,
    )


def idempotency_keys_exhausted(retry_after_s: float) -> ApiError:
    """429: the tenant's idempotency storage quota has no room for another key."""
    return ApiError(
        429,
        "Too many of your Idempotency-Keys and their answers are stored right now. Retry "
        "later, or send the request without an Idempotency-Key.",
        "rate_limit_exceeded",
        "idempotency_keys_exhausted",
        IDEMPOTENCY_HEADER,
        _retry_headers(retry_after_s),
    )


def idempotency_waiters_exceeded(retry_after_s: float) -> ApiError:
    """429: too many of the tenant's duplicates already wait for running requests."""
    return ApiError(
        429,
        "Too many of your requests are already waiting for the answer of an earlier request "
        "with the same Idempotency-Key. Retry later.",
        "rate_limit_exceeded",
        "idempotency_waiters_exceeded",
        IDEMPOTENCY_HEADER,
        _retry_headers(retry_after_s),
    )


def service_unavailable(
    message: str = "The server is temporarily unable to handle the request. Please retry.",
    retry_after_s: float | None = None,
) -> ApiError:
    """503: kvgate (or what it depends on) cannot decide right now."""
    return ApiError(
        503, message, "server_error", "service_unavailable", None, _retry_headers(retry_after_s)
    )


def route_misconfigured(key: str) -> ApiError:
    """500: the gateway's route configuration gives kvgate a setting it cannot use."""
    return ApiError(
        500,
        f"The gateway's route settings for kvgate are invalid ({clip(key)}); "
        "the request was not forwarded. Operators: see kvgate's log.",
        "server_error",
        "route_misconfigured",
        None,
    )


def tenant_not_allowed_on_route() -> ApiError:
    """403: a valid key, on a route whose settings do not admit its tenant."""
    return ApiError(
        403,
        "Your API key may not be used on this route.",
        INVALID_REQUEST_ERROR,
        "tenant_not_allowed_on_route",
        None,
    )


def internal_error(message: str = "kvgate could not process this request.") -> ApiError:
    """500: a fault in kvgate or its deployment, not in the request."""
    return ApiError(500, message, "server_error", "internal_error", None)


# --------------------------------------------------------------------------- x-ratelimit-*


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: "20ms", "1s", "7.66s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    secs_text = f"{secs:.2f}".rstrip("0").rstrip(".")
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{secs_text}s"
    if minutes >= 1:
        return f"{int(minutes)}m{secs_text}s"
    return f"{secs_text}s"


def rate_limit_headers(view: RateLimitView | None) -> dict[str, str]:
    if view is None:
        return {}
    headers: dict[str, str] = {}
    if view.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(view.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(view.remaining_requests)
        headers["x-ratelimit-reset-requests"] = format_reset(view.reset_requests_s or 0.0)
    if view.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(view.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(view.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = format_reset(view.reset_tokens_s or 0.0)
    return headers
