"""The protocol seam: what an API kvgate meters offers the exchange.

An API (OpenAI chat completions, OpenAI completions, ...) is an ``ApiProtocol`` in
``kvgate.protocols``: it turns its wire request into the one canonical request admission
reads (``ParsedRequest``: messages or prompt, tools, max_new per choice, n, sampling,
stream, the fields kvgate refuses), writes what admission decided into the forwarded body,
meters its answer's grammar, and names its ``ErrorVocabulary``: every refusal in the API's
own shape. It also says what the answer layer may do for it: which answer sources apply
(``answer_sources``), the body they key and compare (``client_body``), and when an answer
is complete enough to keep (``answer_defect``, its own grammar's rule).
An endpoint that generates nothing is an ``UnmeteredApi``: forwarded after the tenant's key
and RPM slot. ``rejection_answer`` is the one mapping from a refusal's reason to a status
and an error body; the exchange and the Envoy adapter never name an API.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from kvgate.lifecycle.admission import Rejection
from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.billing import ResponseReading
from kvgate.lifecycle.meter import OutputCounter
from kvgate.lifecycle.ticket import Ticket, served_otherwise_headers
from kvgate.openai import ParsedRequest
from kvgate.openai.completeness import AnswerDefect
from kvgate.policy import RateLimitView, Reason


class ErrorAnswer(Protocol):
    """A refusal in an API's own shape."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> dict[str, str]: ...

    def to_body(self) -> bytes: ...


class ErrorVocabulary(Protocol):
    """Every refusal kvgate answers, in one API's shape (``kvgate.openai.errors`` is
    OpenAI's). Messages never hold credentials or internal addresses."""

    def invalid_request(
        self, message: str, param: str | None = None, code: str | None = None
    ) -> ErrorAnswer: ...

    def missing_api_key(self, header: str | None = None) -> ErrorAnswer: ...

    def invalid_api_key(self) -> ErrorAnswer: ...

    def refused_api_key(self, why: str) -> ErrorAnswer:
        """401 for a key that was valid and no longer is; ``why`` is "revoked" or
        "expired" (said, since the holder knows the key; never which other keys exist)."""
        ...

    def unknown_identity(self) -> ErrorAnswer: ...

    def model_not_found(self, model: str) -> ErrorAnswer: ...

    def context_length_exceeded(
        self,
        prompt_tokens: int,
        max_new: int | None,
        max_context: int,
        param: str = "messages",
        *,
        at_least: bool = False,
    ) -> ErrorAnswer: ...

    def unsupported_path(self, path: str, method: str = "POST") -> ErrorAnswer: ...

    def method_not_allowed(
        self, method: str, path: str | None = None, allowed: tuple[str, ...] | None = None
    ) -> ErrorAnswer: ...

    def rate_limited(
        self,
        message: str,
        code: str = "rate_limit_exceeded",
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        error_type: str = "rate_limit_exceeded",
    ) -> ErrorAnswer: ...

    def service_unavailable(
        self, message: str = ..., retry_after_s: float | None = None
    ) -> ErrorAnswer: ...

    def route_misconfigured(self, key: str) -> ErrorAnswer: ...

    def tenant_not_allowed_on_route(self) -> ErrorAnswer: ...

    def internal_error(self, message: str = ...) -> ErrorAnswer: ...

    def idempotency_key_reused(self) -> ErrorAnswer: ...

    def idempotency_key_in_progress(self, retry_after_s: float) -> ErrorAnswer: ...

    def idempotency_answer_not_kept(self, reason: str) -> ErrorAnswer: ...

    def idempotency_keys_exhausted(self, retry_after_s: float) -> ErrorAnswer: ...

    def idempotency_waiters_exceeded(self, retry_after_s: float) -> ErrorAnswer: ...

    def rate_limit_headers(self, view: RateLimitView | None) -> dict[str, str]: ...


class Outcome(enum.Enum):
    """What kvgate answered that is not a policy decision: metric labels beside the
    policy's ``Reason``s."""

    PASSTHROUGH = "passthrough"
    USAGE_REPORT = "usage_report"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    # A token or client certificate the mesh verified names no tenant.
    UNKNOWN_IDENTITY = "unknown_identity"
    # A key from the key directory that was revoked, or has expired.
    REVOKED_API_KEY = "revoked_api_key"
    EXPIRED_API_KEY = "expired_api_key"
    # The key directory could not be asked (its store is down): 503, never let through.
    KEY_DIRECTORY_UNAVAILABLE = "key_directory_unavailable"
    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_PATH = "unsupported_path"
    # kvgate could not decide within server.decision_timeout_s (before Envoy's deadline).
    DECISION_TIMEOUT = "decision_timeout"
    INTERNAL_ERROR = "internal_error"
    # Envoy's per-route settings (route_settings.py): unusable, or not for this request.
    ROUTE_MISCONFIGURED = "route_misconfigured"
    TENANT_NOT_ALLOWED_ON_ROUTE = "tenant_not_allowed_on_route"
    MODEL_NOT_ALLOWED_ON_ROUTE = "model_not_allowed_on_route"


class Refused(Exception):
    """The one refusal that leaves an exchange: its answer in the API's shape and its
    metric label (a policy ``Reason`` or an ``Outcome``)."""

    def __init__(self, answer: ErrorAnswer, label: Reason | Outcome) -> None:
        super().__init__(label.value)
        self.answer = answer
        self.label = label


class ClientError(Exception):
    """A request the API cannot accept, raised while parsing it: answered as an invalid
    request. ``answer`` is already in the API's shape."""

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer)
        self.answer = answer


class AnswerMeter(Protocol):
    """Reads one answer as it passes, in bounded memory, for the bill."""

    @property
    def accepted(self) -> bool:
        """The backend answered 2xx."""
        ...

    def on_headers(self, status: int, content_type: str) -> None: ...

    def on_chunk(self, chunk: bytes, *, end_of_stream: bool) -> bytes | None:
        """Read one chunk; its replacement when the client must see other bytes."""
        ...

    async def reading(self, count_output: OutputCounter) -> ResponseReading: ...


class ApiProtocol(abc.ABC):
    """One API kvgate meters, served on one path."""

    # The answer sources (Idempotency-Key replays, the exact and semantic caches) that may
    # answer this API's requests and keep its answers: each only where its rules can be
    # stated for the API's grammar. A source left out never sees the API's requests (an
    # Idempotency-Key sent to an API without it is not honoured). None unless named.
    answer_sources: ClassVar[frozenset[SourceName]] = frozenset()

    def __init__(self, name: str, path: str, errors: ErrorVocabulary) -> None:
        # The metric and log name of the API.
        self.name = name
        self.path = path
        self.errors = errors

    @abc.abstractmethod
    def parse(self, body: bytes) -> ParsedRequest:
        """The canonical request; ``ClientError`` for a body the API cannot accept. Pure:
        a large body is parsed on a worker thread."""

    @abc.abstractmethod
    def wants_usage_report(self, request: ParsedRequest) -> bool:
        """Whether the forwarded request must ask the engine for the usage report the
        client did not ask for (the meter strips it again)."""

    @abc.abstractmethod
    def forward_body(self, ticket: Ticket) -> bytes | None:
        """The body to forward when admission changed what the client sent (the served
        model, the reserved cap, the usage report kvgate needs), else None."""

    @abc.abstractmethod
    def meter(self, ticket: Ticket) -> AnswerMeter:
        """A reader of the answer's grammar (JSON, SSE events), for the bill."""

    @abc.abstractmethod
    def answer_defect(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None:
        """Why an answer may not be kept by the answer layer (a replay, a cache entry), or
        None when it is complete by the API's own grammar: a 200 in the content type the
        request asked for, whole, ended as the API ends a finished answer, no error."""

    def client_body(self, request: ParsedRequest) -> dict[str, Any]:
        """The client's own body, as the answer layer keys, fingerprints and compares it:
        the parsed body itself for an API whose canonical request is the wire request."""
        return request.body

    def answer_headers(self, ticket: Ticket) -> dict[str, str]:
        """Headers on an admitted request's answer: its rate limits, a fallback or a clamp."""
        return self.errors.rate_limit_headers(ticket.rate_limits) | served_otherwise_headers(ticket)


class PromptCountApi(abc.ABC):
    """An endpoint kvgate answers itself with the exact count of the prompt a request would
    render (Anthropic's count_tokens): nothing reaches a backend, and the request takes the
    tenant's RPM slot like any other."""

    def __init__(self, name: str, path: str, errors: ErrorVocabulary) -> None:
        self.name = name
        self.path = path
        self.errors = errors

    @abc.abstractmethod
    def parse(self, body: bytes) -> ParsedRequest:
        """The canonical request whose prompt is counted; ``ClientError`` for a body the API
        cannot accept."""

    @abc.abstractmethod
    def answer(self, prompt_tokens: int) -> bytes:
        """The JSON body that answers with the count."""


class UnmeteredApi(abc.ABC):
    """An endpoint that generates nothing and holds no KV (vLLM's ``/tokenize`` and
    ``/detokenize``): forwarded to the model's backend after the tenant's key and the
    tenant's RPM slot, with no reservation and no charge. Its body is checked first, so
    nothing the engine would do beyond tokenizing (a tenant's own chat template, media to
    fetch) gets through unmetered."""

    def __init__(self, name: str, path: str, errors: ErrorVocabulary) -> None:
        self.name = name
        self.path = path
        self.errors = errors

    @abc.abstractmethod
    def model(self, body: bytes) -> str:
        """The model a valid body names (its backend serves it); ``ClientError`` for a body
        the endpoint cannot accept. Pure: a large body is read on a worker thread."""


# Waiting cannot help these: a 400 naming the field, with no Retry-After.
_TOO_LARGE = frozenset(
    {Reason.REQUEST_EXCEEDS_KV_BUDGET, Reason.REQUEST_EXCEEDS_TPM, Reason.TOO_MANY_INPUTS}
)
# kvgate or what it depends on cannot decide now: 503 with Retry-After.
_UNAVAILABLE = frozenset(
    {
        Reason.STORE_UNAVAILABLE,
        Reason.CAPACITY_UNKNOWN,
        Reason.NO_HEALTHY_ENDPOINT,
        Reason.COUNTING_UNAVAILABLE,
    }
)


def rejection_answer(rejection: Rejection, errors: ErrorVocabulary) -> ErrorAnswer:
    """The one mapping from a refusal's reason to a status and an error body."""
    reason = rejection.reason
    if reason is Reason.MODEL_NOT_FOUND:
        return errors.model_not_found(rejection.message)
    if reason is Reason.CONTEXT_LENGTH_EXCEEDED and rejection.context is not None:
        numbers = rejection.context
        return errors.context_length_exceeded(
            numbers.prompt_tokens,
            numbers.max_new_tokens,
            numbers.max_context,
            param=rejection.param or "messages",
            at_least=numbers.at_least,
        )
    if reason is Reason.MIN_TOKENS_OVER_CAP:
        return errors.invalid_request(rejection.message, rejection.param, "invalid_value")
    if reason is Reason.UNRENDERABLE_PROMPT:
        return errors.invalid_request(rejection.message, rejection.param)
    if reason in _TOO_LARGE:
        return errors.invalid_request(rejection.message, rejection.param, reason.value)
    if reason in _UNAVAILABLE:
        return errors.service_unavailable(rejection.message, rejection.retry_after_s)
    headers = errors.rate_limit_headers(rejection.rate_limits)
    if reason is Reason.BUDGET_EXCEEDED:
        return errors.rate_limited(
            rejection.message,
            reason.value,
            rejection.retry_after_s,
            headers,
            error_type="insufficient_quota",
        )
    # Every other limit: RPM, TPM, concurrency, KV, back-pressure, counting queue.
    return errors.rate_limited(rejection.message, reason.value, rejection.retry_after_s, headers)
