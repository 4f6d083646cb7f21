"""One ext_proc stream = one HTTP request: Envoy's messages in, lifecycle calls, replies out.

The phase decides what may happen next:

    REQUEST_HEADERS -> REQUEST_BODY -> FORWARDED -> RESPONSE -> SETTLED
                    \\-> REJECTED | PASSTHROUGH    \\-> HANDED_OFF (split layout)

Settlement happens exactly once, from FORWARDED or RESPONSE, whichever way the stream ends:
the response's end_of_stream, a client disconnect, an upstream reset, an Envoy timeout, or
shutdown. The request's decision, metering and settlement are its ``Exchange``
(`kvgate.lifecycle.exchange`), its API's grammar and error shape a protocol
(`kvgate.protocols`); this module only translates Envoy's messages, headers and layouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.config import hash_api_key
from kvgate.config.model import QUEUE_DEADLINE_MARGIN_S
from kvgate.extproc import messages
from kvgate.extproc.handoff import METADATA_KEY
from kvgate.extproc.priority_header import parse_priority_class
from kvgate.extproc.route_settings import (
    BACKEND_KEY,
    NO_ROUTE_SETTINGS,
    RouteSettings,
    RouteSettingsError,
)
from kvgate.extproc.services import GatewayServices
from kvgate.lifecycle import Ticket
from kvgate.lifecycle.answer_sources import Hit
from kvgate.lifecycle.exchange import Exchange, Forward, RouteScope
from kvgate.lifecycle.protocol import ErrorAnswer, ErrorVocabulary, Outcome, Refused
from kvgate.lifecycle.usage_report import tenant_usage_report
from kvgate.policy import ActualUsage, Reason, SettleCause, pico_to_usd, shadowed
from kvgate.protocols import DEFAULT_ERRORS, METERED_APIS
from kvgate.store import StoreUnavailable

if TYPE_CHECKING:
    from opentelemetry.context import Context

log = logging.getLogger("kvgate.session")

_Mode = processing_mode_pb2.ProcessingMode

# Requests that only need a valid key: they cost the GPU nothing.
PASSTHROUGH_PATHS = frozenset({"/v1/models"})
USAGE_PATH = "/v1/kvgate/usage"
HEADER_PREFIX = "x-kvgate-"
# Where a pool request goes: the endpoint kvgate reserved on (Envoy's ORIGINAL_DST
# cluster reads it with original_dst_lb_config.http_header_name).
DESTINATION_HEADER = "x-kvgate-destination"
# The priority class a request asks for in a pool's queue (allowed per tenant).
PRIORITY_HEADER = "kvgate-priority"
IDEMPOTENCY_HEADER = "idempotency-key"
# How a refusal names that header: its usual spelling.
IDEMPOTENCY_HEADER_NAME = "Idempotency-Key"
# A JSON answer up to this size (by its content-length) comes in one BUFFERED message
# instead of chunk by chunk. Well below the 8 MiB buffer limit of the shipped configs:
# Envoy fails a BUFFERED body over its limit, so larger or unsized answers stay STREAMED.
BUFFERED_ANSWER_MAX_BYTES = 1024 * 1024
# HTTP's optional whitespace (RFC 9110 5.6.3): the only padding trimmed from a credential.
# str.strip() would also drop U+00A0, U+3000, U+2028, U+0085 ..., so "key\u3000" would
# authenticate as "key".
_OWS = " \t"
# Tenant credentials: removed before a request goes upstream; a backend that needs a key
# gets its own from kvgate's config.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    FORWARDED = "forwarded"
    RESPONSE = "response_body"
    SETTLED = "settled"
    REJECTED = "rejected"
    PASSTHROUGH = "passthrough"
    # Split layout: the observing stream meters and settles this request.
    HANDED_OFF = "handed_off"

    @property
    def unsettled(self) -> bool:
        """An admitted request this stream still has to settle."""
        return self in (Phase.FORWARDED, Phase.RESPONSE)


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


def _api_key(headers: dict[str, str], key_header: str | None = None) -> str | None:
    if key_header is not None:
        # The route names the one header its clients put the key in (raw, or "Bearer KEY").
        value = headers.get(key_header, "").strip(_OWS)
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            value = token.strip(_OWS)
        return value or None
    auth = headers.get("authorization", "")
    scheme, _, token = auth.strip(_OWS).partition(" ")
    token = token.strip(_OWS)
    if scheme.lower() == "bearer" and token:
        return token
    key = headers.get("x-api-key", "").strip(_OWS)
    return key or None


def _json_content_type(value: str | None) -> bool:
    """A request content type the engine accepts: application/json (parameters such as
    charset aside). vLLM refuses every other one with a 400; one that is absent passes here
    (many clients omit it for JSON) and meets the engine's own 400, which is charged nothing."""
    if value is None or not value.strip(_OWS):
        return True
    return value.split(";", 1)[0].strip(_OWS).lower() == "application/json"


def _small_json_answer(content_type: str, content_length: str) -> bool:
    """A whole (non-streamed) answer whose declared size fits one buffered message."""
    if not content_type.startswith("application/json") or not (
        content_length.isascii() and content_length.isdigit()
    ):
        return False
    return int(content_length) <= BUFFERED_ANSWER_MAX_BYTES


def _admission_id(request_id: str) -> str:
    """The store's key for this admission: unique per stream. x-request-id alone is not:
    a client may send its own (Envoy keeps it), and reservations, billing records and
    abandon tombstones must never be shared between two requests."""
    return f"{request_id}/{secrets.token_hex(8)}"


class StreamSession:
    def __init__(
        self,
        services: GatewayServices,
        *,
        route: RouteSettings | RouteSettingsError = NO_ROUTE_SETTINGS,
    ) -> None:
        self._svc = services
        # What Envoy's route said for this request (gRPC metadata), or why it is unusable.
        self._route = route
        self._snapshot = services.snapshots.current
        self.phase = Phase.REQUEST_HEADERS
        self.request_id = ""
        self.tenant: str | None = None
        self._path = ""
        # The refusals' shape: the path's API's, OpenAI's until the path is known.
        self._errors: ErrorVocabulary = DEFAULT_ERRORS
        # The metered request, from its body to its settlement.
        self._exchange: Exchange | None = None
        # What Envoy says of its configuration on a stream's first message: in the split
        # layout (envoy-observability.yaml) this request-path stream never sees the answer;
        # admission needs the whole body in one message (BUFFERED).
        self._answer_seen_elsewhere = False
        self._request_body_mode: int = _Mode.BUFFERED
        # OpenTelemetry (kvgate.tracing): None when tracing is off, and then nothing else
        # here is touched.
        self._tracing = services.settler.tracing
        self._trace_parent: Context | None = None
        # Whether this request may wait (a pool's queue, an Idempotency-Key), and the
        # message-timeout extension for Envoy while it does (see handle_with_interim).
        self._may_wait = False
        self._interim: asyncio.Future[pb.ProcessingResponse] | None = None

    @property
    def ticket(self) -> Ticket | None:
        """What admission decided, once the request is admitted."""
        return self._exchange.ticket if self._exchange is not None else None

    # ------------------------------------------------------------------ dispatch

    async def handle(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if message.observability_mode:
            await self._observe(message, kind)
            return None
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self._answer_seen_elsewhere = config.response_body_mode == _Mode.NONE
            self._request_body_mode = config.request_body_mode
        try:
            if kind == "request_headers":
                return await self._on_request_headers(message.request_headers)
            if kind == "request_body":
                return await self._on_request_body(message.request_body)
            if kind == "response_headers":
                return await self._on_response_headers(message.response_headers)
            if kind == "response_body":
                return await self._on_response_body(message.response_body)
            if kind == "request_trailers":
                return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            if kind == "response_trailers":
                return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        except Exception:
            self._svc.metrics.internal_errors.labels(self.phase.value).inc()
            log.exception(
                "internal error", extra={"request_id": self.request_id, "phase": self.phase.value}
            )
            return self._internal_error_reply(kind)
        return None

    async def _observe(self, message: pb.ProcessingRequest, kind: str | None) -> None:
        """The observing stream of the split layout: Envoy ignores its replies. Its first
        message claims the ticket the request-path stream handed off."""
        if self.phase is Phase.REQUEST_HEADERS:
            fields = message.metadata_context.filter_metadata.get(messages.METADATA_NAMESPACE)
            key = fields.fields.get(METADATA_KEY) if fields is not None else None
            ticket = self._svc.handoffs.claim(key.string_value) if key is not None else None
            if ticket is None:
                self.phase = Phase.PASSTHROUGH  # rejected or passed through: nothing to meter
                return
            api = METERED_APIS[ticket.request.path]
            self._exchange = Exchange.observing(self._svc, self._snapshot, api, ticket)
            self.request_id = ticket.request_id
            self.phase = Phase.FORWARDED
        if not self.phase.unsettled:
            return
        try:
            if kind == "response_headers":
                await self._on_response_headers(message.response_headers)
            elif kind == "response_body":
                await self._on_response_body(message.response_body)
        except Exception:
            self._svc.metrics.internal_errors.labels("observe").inc()
            log.exception("internal error", extra={"request_id": self.request_id})

    def _internal_error_reply(self, kind: str | None) -> pb.ProcessingResponse:
        if kind in ("request_headers", "request_body") and self.ticket is None:
            return self._reject(self._errors.internal_error(), Outcome.INTERNAL_ERROR)
        # Once forwarded, never break the client's stream: pass the chunk through unchanged.
        if kind == "response_headers":
            return messages.continue_response_headers()
        if kind == "response_body":
            return messages.continue_response_body()
        if kind == "request_body":
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())

    # ------------------------------------------------------------------ request path

    async def _on_request_headers(self, http: pb.HttpHeaders) -> pb.ProcessingResponse:
        headers = messages.header_map_to_dict(http.headers)
        self.request_id = headers.get("x-request-id", "")
        if self._tracing is not None:
            self._trace_parent = self._tracing.extract(headers)
        self._path = _path_only(headers.get(":path", ""))
        api = METERED_APIS.get(self._path)
        errors = self._errors = api.errors if api is not None else DEFAULT_ERRORS
        # Methods are case-sensitive (RFC 9110 9.1): "post" is not POST, and vLLM says 405.
        method = headers.get(":method", "")
        # Clients must not be able to forge the headers Envoy routes and logs on.
        forged = [name for name in headers if name.startswith(HEADER_PREFIX)]
        route = self._route
        if isinstance(route, RouteSettingsError):
            # Fail closed: settings kvgate cannot read must not be silently ignored.
            log.error("unusable per-route settings from Envoy: %s", route)
            return self._reject(errors.route_misconfigured(route.key), Outcome.ROUTE_MISCONFIGURED)

        key = _api_key(headers, route.key_header)
        # The tenant's credentials never go upstream, wherever the route says they are.
        credentials = (
            (*CREDENTIAL_HEADERS, route.key_header) if route.key_header else CREDENTIAL_HEADERS
        )
        if key is None:
            return self._reject(errors.missing_api_key(route.key_header), Outcome.MISSING_API_KEY)
        tenant = self._snapshot.tenants_by_key_hash.get(hash_api_key(key))
        if tenant is None:
            return self._reject(errors.invalid_api_key(), Outcome.INVALID_API_KEY)
        self.tenant = tenant
        policy = self._snapshot.tenants[tenant]
        if route.shadow:
            # The operator's route trials the tenant's limits: decided and counted in
            # kvgate_shadow_rejections_total, never enforced (the KV budget still is).
            policy = shadowed(policy)
        if route.backend is not None and route.backend not in self._snapshot.backends:
            log.error("route names backend %r, which kvgate's config does not have", route.backend)
            return self._reject(
                errors.route_misconfigured(BACKEND_KEY), Outcome.ROUTE_MISCONFIGURED
            )
        if not route.allows_tenant(tenant):
            return self._reject(
                errors.tenant_not_allowed_on_route(), Outcome.TENANT_NOT_ALLOWED_ON_ROUTE
            )

        if self._path == USAGE_PATH:
            return await self._usage_report(method, tenant)
        if self._path in PASSTHROUGH_PATHS or self._path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                return self._reject(
                    errors.method_not_allowed(method, self._path), Outcome.INVALID_REQUEST
                )
            self.phase = Phase.PASSTHROUGH
            self._svc.metrics.requests.labels("passthrough", Outcome.PASSTHROUGH.value).inc()
            reply = messages.continue_request_headers(
                {"x-kvgate-tenant": tenant}, [*forged, *credentials], skip_rest=True
            )
            reply.dynamic_metadata.CopyFrom(messages.metadata(self._metadata("passthrough")))
            return reply
        if api is None:
            return self._reject(errors.unsupported_path(self._path), Outcome.UNSUPPORTED_PATH)
        if method != "POST":
            return self._reject(
                errors.method_not_allowed(method, self._path), Outcome.INVALID_REQUEST
            )
        if http.end_of_stream:
            return self._reject(
                errors.invalid_request("The request body is empty; expected JSON."),
                Outcome.INVALID_REQUEST,
            )
        if not _json_content_type(headers.get("content-type")):
            # The engine reads only JSON bodies (none given: JSON too); anything else it
            # refuses after kvgate would have reserved for it.
            return self._reject(
                errors.invalid_request(
                    "The request body must be JSON: send content-type: application/json.",
                    "content-type",
                ),
                Outcome.INVALID_REQUEST,
            )
        if self._request_body_mode != _Mode.BUFFERED:
            # With STREAMED or partial bodies the first body message is not the whole body:
            # admitting on it would let the rest through unmetered. A deployment error.
            log.error("ext_proc request_body_mode must be BUFFERED for metered paths")
            return self._reject(
                errors.internal_error("kvgate is misconfigured: it cannot meter this request."),
                Outcome.INTERNAL_ERROR,
            )
        priority = self._requested_priority(headers, tenant)
        if not isinstance(priority, int):
            return self._reject(priority, Outcome.INVALID_REQUEST)
        idempotency_key = headers.get(IDEMPOTENCY_HEADER)
        if idempotency_key is not None and self._snapshot.config.idempotency.enabled:
            idempotency_key = idempotency_key.strip(_OWS)
            if not (
                1 <= len(idempotency_key) <= 255
                and idempotency_key.isascii()
                and idempotency_key.isprintable()
            ):
                return self._reject(
                    errors.invalid_request(
                        "The Idempotency-Key header must be 1 to 255 printable ASCII characters.",
                        IDEMPOTENCY_HEADER_NAME,
                        "invalid_value",
                    ),
                    Outcome.INVALID_REQUEST,
                )
        else:
            idempotency_key = None
        self._may_wait = bool(self._snapshot.queued_pools) or idempotency_key is not None
        settings = route if isinstance(route, RouteSettings) else NO_ROUTE_SETTINGS
        self._exchange = Exchange(
            self._svc,
            self._snapshot,
            api,
            policy,
            request_id=self.request_id,
            admission_id=_admission_id(self.request_id),
            priority=priority,
            idempotency_key=idempotency_key,
            route=RouteScope(backend=settings.backend, models=settings.models),
            sees_answer=not self._answer_seen_elsewhere,
            on_wait=self._extend_message_timeout,
        )
        self.phase = Phase.REQUEST_BODY
        return messages.continue_request_headers(
            {"x-kvgate-tenant": tenant}, [*forged, *credentials]
        )

    def _requested_priority(self, headers: dict[str, str], tenant: str) -> int | ErrorAnswer:
        """The request's class in a pool's queue: the tenant's own, or one of the classes
        the operator allows it to ask for with the kvgate-priority header."""
        own, allowed = self._snapshot.priorities.get(tenant, (0, frozenset()))
        route = self._route
        if isinstance(route, RouteSettings) and route.priority is not None:
            # The operator's route says which class its requests are: the route's class
            # replaces the tenant's own (the header may still ask for an allowed one).
            own = route.priority
        asked = headers.get(PRIORITY_HEADER)
        if asked is None:
            return own
        choices = ", ".join(str(p) for p in sorted({own, *allowed}))
        asked_class = parse_priority_class(asked.strip(_OWS))
        if asked_class is None:
            return self._errors.invalid_request(
                f"The {PRIORITY_HEADER} header must be a whole number written with the "
                f"digits 0-9 and an optional leading '-' (allowed for this key: {choices}).",
                PRIORITY_HEADER,
                "invalid_value",
            )
        if asked_class in allowed or asked_class == own:
            return asked_class
        return self._errors.invalid_request(
            f"The {PRIORITY_HEADER} header asks for a priority class this key may not use "
            f"(allowed: {choices}).",
            PRIORITY_HEADER,
            "invalid_value",
        )

    async def _usage_report(self, method: str, tenant: str) -> pb.ProcessingResponse:
        if method not in ("GET", "HEAD"):
            return self._reject(
                self._errors.method_not_allowed(method, self._path, ("GET", "HEAD")),
                Outcome.INVALID_REQUEST,
            )
        self.phase = Phase.PASSTHROUGH
        self._svc.metrics.requests.labels("answered", Outcome.USAGE_REPORT.value).inc()
        try:
            report = await tenant_usage_report(
                self._svc.store, self._svc.clock, self._snapshot, tenant
            )
        except StoreUnavailable as exc:
            return self._reject(
                self._errors.service_unavailable(
                    "Usage is unavailable while kvgate cannot reach its state store.",
                    retry_after_s=exc.retry_after_s,
                ),
                Reason.STORE_UNAVAILABLE,
            )
        return messages.immediate_response(
            200, json.dumps(report, separators=(",", ":")).encode(), details="kvgate_usage"
        )

    async def _on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        exchange = self._exchange
        if self.phase is not Phase.REQUEST_BODY or exchange is None:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        # In BUFFERED mode this one message is the whole body, whatever end_of_stream says:
        # with HTTP/2 request trailers it arrives with end_of_stream=false (the trailers end
        # the stream). So this message is the admission point, always; nothing that follows
        # can carry more body.
        started = time.perf_counter()
        trace_start = time.time_ns() if self._tracing is not None else 0
        try:
            decided = await exchange.decide(http.body)
        except Refused as refused:
            reply = self._reject(refused.answer, refused.label)
        else:
            reply = self._answered(decided) if isinstance(decided, Hit) else self._forward(decided)
        outcome = "admitted" if self.ticket is not None else "rejected"
        self._svc.metrics.decision_seconds.labels(outcome).observe(time.perf_counter() - started)
        if self._tracing is not None:
            self._trace_decision(trace_start, outcome, reply)
        return reply

    def _trace_decision(self, start_ns: int, outcome: str, reply: pb.ProcessingResponse) -> None:
        assert self._tracing is not None
        details = reply.immediate_response.details if reply.HasField("immediate_response") else ""
        try:
            self._tracing.decision(
                self._trace_parent,
                start_ns,
                request_id=self.request_id,
                outcome=outcome,
                reason=details.removeprefix("kvgate_") or Reason.ADMITTED.value,
                tenant=self.tenant,
                request=self._exchange.request if self._exchange is not None else None,
                ticket=self.ticket,
            )
        except Exception:
            log.exception("recording the decision span failed")

    def _forward(self, forward: Forward) -> pb.ProcessingResponse:
        """Admitted: the request goes upstream to the endpoint holding its reservation."""
        ticket = forward.ticket
        self.request_id = ticket.request_id
        self.phase = Phase.FORWARDED
        self._svc.metrics.requests.labels("admitted", Reason.ADMITTED.value).inc()
        if self._answer_seen_elsewhere:
            # The observing stream meters and settles it (see handoff.py).
            assert self._exchange is not None
            self._exchange.hand_off()
            self.phase = Phase.HANDED_OFF
            self._svc.handoffs.register(ticket, self._svc.settle_unclaimed)
        route_headers = {"x-kvgate-model": ticket.route.name, "x-kvgate-backend": ticket.cluster}
        if ticket.endpoint is not None:
            # The pool's ORIGINAL_DST cluster connects to exactly this endpoint, the one
            # holding the reservation (clients' x-kvgate-* never get this far).
            route_headers[DESTINATION_HEADER] = ticket.endpoint
        upstream_key = self._snapshot.upstream_keys.get(ticket.cluster)
        if upstream_key is not None:
            route_headers["authorization"] = f"Bearer {upstream_key}"
        return messages.continue_request_body(
            route_headers, new_body=forward.body, dynamic_metadata=self._metadata("admitted")
        )

    def _extend_message_timeout(self, wait_s: float) -> None:
        """The request waits (an Idempotency-Key's first run, a pool's queue): ask Envoy
        (override_message_timeout, up to the filter's max_message_timeout) to wait as long
        as the exchange's own decision deadline, so neither answers with a timeout while the
        request is in line."""
        interim = self._interim
        if interim is not None and not interim.done():
            interim.set_result(messages.override_message_timeout(wait_s + QUEUE_DEADLINE_MARGIN_S))

    def wants_interim(self, message: pb.ProcessingRequest) -> bool:
        """Whether this message's decision may wait in a pool's queue, so that the servicer
        must be able to send Envoy a message-timeout extension before the reply."""
        return (
            self.phase is Phase.REQUEST_BODY
            and self._may_wait
            and message.WhichOneof("request") == "request_body"
        )

    async def handle_with_interim(
        self, message: pb.ProcessingRequest
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """handle(), but yield the message-timeout extension first if the request queues."""
        interim: asyncio.Future[pb.ProcessingResponse] = asyncio.get_running_loop().create_future()
        self._interim = interim
        task = asyncio.ensure_future(self.handle(message))
        try:
            await asyncio.wait({task, interim}, return_when=asyncio.FIRST_COMPLETED)
            if interim.done() and not task.done():
                yield interim.result()
            reply = await task
            if reply is not None:
                yield reply
        finally:
            self._interim = None
            if not task.done():
                # The stream went away while the request waited: leave the queue now (the
                # admission's own cancel handling releases whatever it reserved).
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _answered(self, hit: Hit) -> pb.ProcessingResponse:
        """A stored answer answers the request: nothing is forwarded or metered."""
        self.phase = Phase.REJECTED  # answered by kvgate: nothing to meter
        self._svc.metrics.requests.labels("answered", hit.reason).inc()
        return messages.immediate_response(
            hit.answer.status,
            hit.answer.body,
            {**dict(hit.headers), "content-type": hit.answer.content_type},
            details=f"kvgate_{hit.reason}",
            dynamic_metadata=self._metadata(hit.reason),
        )

    def _reject(self, answer: ErrorAnswer, label: Reason | Outcome) -> pb.ProcessingResponse:
        self.phase = Phase.REJECTED
        self._svc.metrics.requests.labels("rejected", label.value).inc()
        if self.tenant is not None:
            self._svc.metrics.tenant_rejections.labels(self.tenant, label.value).inc()
        log.debug(
            "rejected",
            extra={
                "request_id": self.request_id,
                "tenant": self.tenant,
                "status": answer.status,
                "reason": label.value,
            },
        )
        return messages.immediate_response(
            answer.status,
            answer.to_body(),
            answer.headers,
            details=f"kvgate_{label.value}",
            dynamic_metadata=self._metadata(label.value),
        )

    # ------------------------------------------------------------------ response path

    async def _on_response_headers(self, http: pb.HttpHeaders) -> pb.ProcessingResponse:
        exchange = self._exchange
        if not self.phase.unsettled or exchange is None:
            return messages.continue_response_headers()
        headers = messages.header_map_to_dict(http.headers)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        content_type = headers.get("content-type", "")
        added = exchange.answer_headers(status, content_type)
        self.phase = Phase.RESPONSE
        if http.end_of_stream:
            # A body-less answer (e.g. an upstream error with no body): settle now.
            await self._settle(exchange, exchange.end_cause())
            return messages.continue_response_headers(added)
        return messages.continue_response_headers(
            added,
            buffer_body=not self._answer_seen_elsewhere
            and _small_json_answer(content_type, headers.get("content-length", "")),
        )

    async def _on_response_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        exchange = self._exchange
        if not self.phase.unsettled or exchange is None:
            return messages.continue_response_body()
        replacement = exchange.on_chunk(http.body, end_of_stream=http.end_of_stream)
        if not http.end_of_stream:
            return messages.continue_response_body(replacement)
        cause = exchange.end_cause()
        # Settled before replying (the reply may never be read); the store write goes on
        # in the background.
        charged = await self._settle(exchange, cause)
        meta = self._metadata("admitted")
        ticket = self.ticket
        if charged is not None and ticket is not None:
            meta["output_tokens"] = charged.output_tokens
            meta["settled"] = cause.value
            cost = ticket.pricing.cost(
                charged.prompt_tokens, charged.output_tokens, charged.cached_tokens
            )
            meta["cost_usd"] = str(pico_to_usd(cost))
        return messages.continue_response_body(replacement, dynamic_metadata=meta)

    async def _settle(self, exchange: Exchange, cause: SettleCause) -> ActualUsage | None:
        self.phase = Phase.SETTLED  # before any await: exactly once
        return await exchange.settle(cause)

    def close(self, *, shutting_down: bool) -> None:
        """The gRPC stream ended. If the request was admitted and not settled, the client
        went away (or Envoy gave up): settle with what was seen so far."""
        exchange = self._exchange
        if exchange is None:
            return
        cause = SettleCause.SHUTDOWN if shutting_down else SettleCause.DISCONNECTED
        if exchange.close(cause):
            self._svc.metrics.stream_disconnects.labels(self.phase.value).inc()
            self.phase = Phase.SETTLED

    # ------------------------------------------------------------------ helpers

    def _metadata(self, decision: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"decision": decision}
        if self.tenant:
            meta["tenant"] = self.tenant
        if isinstance(self._route, RouteSettings) and self._route.name:
            meta["route"] = self._route.name
        request = self._exchange.request if self._exchange is not None else None
        if request is not None:
            meta["model"] = request.model
        ticket = self.ticket
        if ticket is not None:
            # After a budget fallback this is the model that really served the request.
            meta["model"] = ticket.model
            meta["backend"] = ticket.cluster
            if ticket.endpoint is not None:
                meta["endpoint"] = ticket.endpoint
            meta["reserved_tokens"] = ticket.reservation.kv_tokens
            meta[METADATA_KEY] = ticket.reservation.reservation_id
            meta["prompt_tokens"] = ticket.prompt_tokens
        return meta
