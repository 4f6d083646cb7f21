"""One ext_proc stream = one HTTP request: an explicit state machine that admits and settles.

REQUEST_HEADERS -> REQUEST_BODY -> FORWARDED -> RESPONSE_BODY -> SETTLED, or REJECTED /
PASSTHROUGH. Settlement happens exactly once whichever way the stream ends: the response's
end_of_stream, a client disconnect, an upstream reset, an Envoy timeout, or shutdown.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import secrets
import time
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.config import hash_api_key
from kvgate.config.snapshot import ModelRoute
from kvgate.extproc import messages
from kvgate.extproc.admission import AdmissionPlanner, AdmissionRejected
from kvgate.extproc.handoff import METADATA_KEY, HandedOff
from kvgate.extproc.services import GatewayServices
from kvgate.extproc.usage_report import USAGE_PATH, tenant_usage_report
from kvgate.lifecycle import CutRequestCharge, ResponseReading, charged_usage
from kvgate.openai import (
    ApiError,
    JsonUsageScanner,
    ParsedRequest,
    SseStreamFilter,
    parse_request,
    rewrite_body,
)
from kvgate.openai import errors as api_errors
from kvgate.policy import (
    ActualUsage,
    Pricing,
    Reason,
    Reservation,
    SettleCause,
    TenantPolicy,
    pico_to_usd,
)
from kvgate.store import StoreUnavailable
from kvgate.tokenize import TokenizerBusy

log = logging.getLogger("kvgate.session")

_Mode = processing_mode_pb2.ProcessingMode

ADMITTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Requests that only need a valid key: they cost the GPU nothing.
PASSTHROUGH_PATHS = frozenset({"/v1/models"})
HEADER_PREFIX = "x-kvgate-"
# Bodies larger than this are parsed on a worker thread, not on the event loop.
_PARSE_OFF_LOOP_BYTES = 64 * 1024


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    FORWARDED = "forwarded"
    RESPONSE_BODY = "response_body"
    SETTLED = "settled"
    REJECTED = "rejected"
    PASSTHROUGH = "passthrough"


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


# HTTP's optional whitespace (RFC 9110 5.6.3): the only padding trimmed from a credential.
# str.strip() would also drop U+00A0, U+3000, U+2028, U+0085 ..., so "key\u3000" would
# authenticate as "key".
_OWS = " \t"
# Tenant credentials: removed before a request goes upstream; a backend that needs a key
# gets its own from kvgate's config.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")


def _api_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.strip(_OWS).partition(" ")
    token = token.strip(_OWS)
    if scheme.lower() == "bearer" and token:
        return token
    key = headers.get("x-api-key", "").strip(_OWS)
    return key or None


class StreamSession:
    def __init__(self, services: GatewayServices) -> None:
        self._svc = services
        self._snapshot = services.snapshots.current
        self.phase = Phase.REQUEST_HEADERS
        self.request_id = ""
        self.tenant: str | None = None
        self._tenant_policy: TenantPolicy | None = None
        self._route: ModelRoute | None = None
        self._client_headers: dict[str, str] = {}
        # Split response path (envoy-observability.yaml): this request-path stream will not
        # see the response; or this is the observability stream that does.
        self._response_elsewhere = False
        # Admission needs the whole body in one message; Envoy says which mode it uses.
        self._request_body_mode: int = _Mode.BUFFERED
        self.observer = False
        self._handed_off = False
        self._usage_injected = False
        self._path = ""
        self._body = bytearray()
        self._request: ParsedRequest | None = None
        self._prompt_tokens = 0
        self.reservation: Reservation | None = None
        self._settling = False
        self._response_status = 0
        self._streaming_response = False
        self._sse: SseStreamFilter | None = None
        self._json_usage: JsonUsageScanner | None = None

    # ------------------------------------------------------------------ dispatch

    async def handle(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if message.observability_mode:
            return await self._observe(message, kind)
        if message.HasField("protocol_config"):
            # Sent on a stream's first message: NONE means this filter never sees the response.
            self._response_elsewhere = message.protocol_config.response_body_mode == _Mode.NONE
            self._request_body_mode = message.protocol_config.request_body_mode
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
        """The observability stream: Envoy ignores replies, so none are sent."""
        if not self.observer:
            self.observer = True
            fields = message.metadata_context.filter_metadata.get(messages.METADATA_NAMESPACE)
            key = fields.fields.get(METADATA_KEY) if fields is not None else None
            state = self._svc.handoffs.claim(key.string_value) if key is not None else None
            if state is not None:
                self._adopt(state)
        if self.reservation is None or self._settling:
            return None  # a rejected or pass-through request: nothing to settle
        try:
            if kind == "response_headers":
                await self._on_response_headers(message.response_headers)
            elif kind == "response_body":
                await self._on_response_body(message.response_body)
        except Exception:
            self._svc.metrics.internal_errors.labels("observe").inc()
            log.exception("internal error", extra={"request_id": self.request_id})
        return None

    def _adopt(self, state: HandedOff) -> None:
        self.reservation = state.reservation
        self._route = state.route
        self._request = state.request
        self._prompt_tokens = state.prompt_tokens
        self.tenant = state.tenant
        self.request_id = state.request_id
        self.phase = Phase.FORWARDED

    def _hand_off(self) -> None:
        assert self.reservation is not None and self._route is not None
        assert self._request is not None and self.tenant is not None
        self._handed_off = True
        state = HandedOff(
            reservation=self.reservation,
            route=self._route,
            request=self._request,
            prompt_tokens=self._prompt_tokens,
            tenant=self.tenant,
            request_id=self.request_id,
        )
        self._svc.handoffs.register(state, self._svc.settle_unclaimed)

    def _internal_error_reply(self, kind: str | None) -> pb.ProcessingResponse:
        if kind in ("request_headers", "request_body") and self.reservation is None:
            self.phase = Phase.REJECTED
            return self._reject(api_errors.internal_error(), Reason.INTERNAL_ERROR)
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
        self._path = _path_only(headers.get(":path", ""))
        method = headers.get(":method", "").upper()
        # Clients must not be able to forge the headers Envoy routes and logs on.
        forged = [name for name in headers if name.startswith(HEADER_PREFIX)]

        key = _api_key(headers)
        if key is None:
            return self._reject(api_errors.missing_api_key(), Reason.MISSING_API_KEY)
        tenant = self._snapshot.tenants_by_key_hash.get(hash_api_key(key))
        if tenant is None:
            return self._reject(api_errors.invalid_api_key(), Reason.INVALID_API_KEY)
        self.tenant = tenant
        self._tenant_policy = self._snapshot.tenants[tenant]

        if self._path == USAGE_PATH:
            if method not in ("GET", "HEAD"):
                return self._reject(
                    api_errors.method_not_allowed(method, self._path, ("GET", "HEAD")),
                    Reason.INVALID_REQUEST,
                )
            self.phase = Phase.PASSTHROUGH
            self._svc.metrics.requests.labels("answered", Reason.USAGE_REPORT.value).inc()
            try:
                report = await tenant_usage_report(self._svc, self._snapshot, tenant)
            except StoreUnavailable as exc:
                return self._reject(
                    api_errors.service_unavailable(
                        "Usage is unavailable while kvgate cannot reach its state store.",
                        retry_after_s=exc.retry_after_s,
                    ),
                    Reason.STORE_UNAVAILABLE,
                )
            return messages.immediate_response(
                200, json.dumps(report, separators=(",", ":")).encode(), details="kvgate_usage"
            )

        if self._path in PASSTHROUGH_PATHS or self._path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                return self._reject(
                    api_errors.method_not_allowed(method, self._path), Reason.INVALID_REQUEST
                )
            self.phase = Phase.PASSTHROUGH
            self._svc.metrics.requests.labels("passthrough", Reason.PASSTHROUGH.value).inc()
            reply = messages.continue_request_headers(
                {"x-kvgate-tenant": tenant}, [*forged, *CREDENTIAL_HEADERS], skip_rest=True
            )
            reply.dynamic_metadata.CopyFrom(messages.metadata(self._metadata("passthrough")))
            return reply
        if self._path not in ADMITTED_PATHS:
            return self._reject(api_errors.unsupported_path(self._path), Reason.UNSUPPORTED_PATH)
        if method != "POST":
            return self._reject(
                api_errors.method_not_allowed(method, self._path), Reason.INVALID_REQUEST
            )
        if http.end_of_stream:
            return self._reject(
                api_errors.invalid_request("The request body is empty; expected JSON."),
                Reason.INVALID_REQUEST,
            )
        if self._request_body_mode != _Mode.BUFFERED:
            # With STREAMED or partial bodies the first body message is not the whole body:
            # admitting on it would let the rest through unmetered. A deployment error.
            log.error("ext_proc request_body_mode must be BUFFERED for metered paths")
            return self._reject(
                api_errors.internal_error("kvgate is misconfigured: it cannot meter this request."),
                Reason.INTERNAL_ERROR,
            )
        self.phase = Phase.REQUEST_BODY
        return messages.continue_request_headers(
            {"x-kvgate-tenant": tenant}, [*forged, *CREDENTIAL_HEADERS]
        )

    async def _on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if self.phase is not Phase.REQUEST_BODY:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        # In BUFFERED mode this one message is the whole body, whatever end_of_stream says:
        # with HTTP/2 request trailers it arrives with end_of_stream=false (the trailers end
        # the stream). So this message is the admission point, always; nothing that follows
        # can carry more body.
        self._body += http.body
        started = time.perf_counter()
        deadline = self._snapshot.config.server.decision_timeout_s
        try:
            async with asyncio.timeout(deadline):
                reply = await self._admit(bytes(self._body))
        except ApiError as error:
            reply = self._reject(error, _reason_for(error))
        except AdmissionRejected as rejected:
            reply = self._reject(rejected.error, rejected.reason)
        except TimeoutError:
            # Answer before Envoy's message timeout does (an empty 504): whatever the
            # admission was waiting on was cancelled, and a reserve in flight is abandoned.
            reply = self._reject(
                api_errors.service_unavailable(
                    f"kvgate could not decide on this request within {deadline:g} s "
                    "(it is busy counting prompts). Please retry.",
                    retry_after_s=1,
                ),
                Reason.DECISION_TIMEOUT,
            )
        outcome = "admitted" if self.reservation is not None else "rejected"
        self._svc.metrics.decision_seconds.labels(outcome).observe(time.perf_counter() - started)
        return reply

    async def _admit(self, body: bytes) -> pb.ProcessingResponse:
        assert self._tenant_policy is not None
        if len(body) > _PARSE_OFF_LOOP_BYTES:
            # Megabytes of JSON take tens of milliseconds to parse: off the event loop, in
            # the tenant's fair share of the workers, so other tenants' decisions go on.
            try:
                request = await self._svc.tokenizers.run(
                    self._tenant_policy.name,
                    functools.partial(parse_request, self._path, body),
                    cost=len(body),
                )
            except TokenizerBusy as busy:
                raise AdmissionRejected(
                    api_errors.rate_limited(
                        "Too many of your requests are waiting to be read; "
                        "retry when some have been answered.",
                        Reason.COUNTING_BUSY.value,
                        busy.retry_after_s,
                    ),
                    Reason.COUNTING_BUSY,
                ) from None
        else:
            request = parse_request(self._path, body)
        self._request = request
        admitted = await AdmissionPlanner(self._svc, self._snapshot).admit(
            request, self._tenant_policy, _admission_id(self.request_id)
        )
        self.reservation = admitted.reservation
        self._route = admitted.route
        self._prompt_tokens = admitted.prompt_tokens
        self._client_headers = admitted.client_headers
        self.phase = Phase.FORWARDED
        # Renewed on a timer for as long as the request is open, chunks or not.
        self._svc.leases.keep(admitted.reservation)
        self._svc.metrics.requests.labels("admitted", Reason.ADMITTED.value).inc()

        # Exact output counts need the usage event; when the client did not ask for it, the
        # response filter strips it again before the client sees it. An observability stream
        # cannot strip anything, so in the split mode nothing is injected.
        force_usage = (
            request.stream and not request.include_usage_requested and not self._response_elsewhere
        )
        self._usage_injected = force_usage
        if self._response_elsewhere:
            self._hand_off()
        # What is reserved is what the engine may generate: whenever the body does not
        # already carry exactly the reserved cap (no max_tokens, null, a clamp, both names
        # with different values), the cap is written into the forwarded body.
        cap = admitted.max_new_tokens
        exact = request.max_tokens_param is not None and request.max_new_tokens == cap
        new_cap = None if exact and not request.conflicting_caps else cap
        new_body: bytes | None = None
        if force_usage or admitted.new_model or new_cap is not None:
            new_body = rewrite_body(
                request.body,
                model=admitted.new_model,
                max_tokens=new_cap,
                force_usage=force_usage,
            )
        route_headers = {
            "x-kvgate-model": admitted.route.name,
            "x-kvgate-backend": admitted.route.backend,
        }
        upstream_key = self._snapshot.upstream_keys.get(admitted.route.backend)
        if upstream_key is not None:
            route_headers["authorization"] = f"Bearer {upstream_key}"
        return messages.continue_request_body(
            route_headers, new_body=new_body, dynamic_metadata=self._metadata("admitted")
        )

    def _reject(self, error: ApiError, reason: Reason) -> pb.ProcessingResponse:
        self.phase = Phase.REJECTED
        self._svc.metrics.requests.labels("rejected", reason.value).inc()
        if self.tenant is not None:
            self._svc.metrics.tenant_rejections.labels(self.tenant, reason.value).inc()
        log.debug(
            "rejected",
            extra={
                "request_id": self.request_id,
                "tenant": self.tenant,
                "status": error.status,
                "reason": reason.value,
            },
        )
        return messages.immediate_response(
            error.status,
            error.to_body(),
            error.headers,
            details=f"kvgate_{reason.value}",
            dynamic_metadata=self._metadata(reason.value),
        )

    # ------------------------------------------------------------------ response path

    async def _on_response_headers(self, http: pb.HttpHeaders) -> pb.ProcessingResponse:
        headers = messages.header_map_to_dict(http.headers)
        try:
            self._response_status = int(headers.get(":status", "0"))
        except ValueError:
            self._response_status = 0
        content_type = headers.get("content-type", "")
        self._streaming_response = content_type.startswith("text/event-stream")
        if self._streaming_response and self._request is not None:
            self._sse = SseStreamFilter(strip_usage_event=self._usage_injected)
        elif self._ok():
            self._json_usage = JsonUsageScanner()
        if self.phase is Phase.FORWARDED:
            self.phase = Phase.RESPONSE_BODY
        if http.end_of_stream:
            # A body-less response (e.g. an upstream error with no body): settle now.
            await self._settle(self._end_cause())
        return messages.continue_response_headers(self._client_headers)

    async def _on_response_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        replacement: bytes | None = None
        chunk = http.body
        if self._sse is not None:
            forwarded = self._sse.feed(chunk)
            if http.end_of_stream:
                forwarded += self._sse.finish()
            if forwarded is not chunk and forwarded != chunk:
                replacement = forwarded
        elif self._json_usage is not None:
            # Bounded memory whatever the body's size: only `usage` is kept.
            self._json_usage.feed(chunk)

        if not http.end_of_stream:
            return messages.continue_response_body(replacement)

        cause = self._end_cause()
        # Record the settlement before replying: the reply may never be read.
        charged = await self._settle(cause)
        meta = self._metadata("admitted")
        if charged is not None:
            meta["output_tokens"] = charged.output_tokens
            meta["settled"] = cause.value
            if self._route is not None:
                cost = self._route.pricing.cost(
                    charged.prompt_tokens, charged.output_tokens, charged.cached_tokens
                )
                meta["cost_usd"] = str(pico_to_usd(cost))
        return messages.continue_response_body(replacement, dynamic_metadata=meta)

    def _ok(self) -> bool:
        return 200 <= self._response_status < 300

    def _end_cause(self) -> SettleCause:
        return SettleCause.COMPLETED if self._ok() else SettleCause.UPSTREAM_ERROR

    def _reported_usage(self) -> ActualUsage | None:
        """Usage as the backend reported it, or None when kvgate could not read it."""
        reported = None
        if self._sse is not None:
            reported = self._sse.usage
        elif self._json_usage is not None:
            reported = self._json_usage.usage
        if reported is None:
            return None
        self._observe_prompt_count(reported.prompt_tokens)
        return ActualUsage(
            prompt_tokens=reported.prompt_tokens,
            output_tokens=reported.completion_tokens,
            cached_tokens=reported.cached_tokens,
        )

    async def _reading(self) -> ResponseReading:
        """What was seen of the answer, for the billing rule."""
        usage = self._reported_usage() if self._ok() else None
        sse = self._sse
        counted = 0
        if usage is None and sse is not None and self._ok():
            counted = await self._count_output(sse.output_text())
        return ResponseReading(
            accepted=self._ok(),
            streamed=self._request.stream if self._request is not None else sse is not None,
            usage=usage,
            counted_output_tokens=counted,
            content_events=sse.content_events if sse is not None else 0,
            output_text_complete=sse is not None and not sse.output_text_truncated,
            visible_text=sse is not None and bool(sse.output_text()),
        )

    async def _count_output(self, text: str) -> int:
        if not text or self.reservation is None:
            return 0
        # The model that served the request (after a budget fallback, not the one asked).
        model = self.reservation.request.model
        try:
            return await self._svc.tokenizers.count_text(
                model, text, tenant=self.reservation.request.tenant
            )
        except Exception:
            # E.g. the model was removed by a reload since admission: the billing rule
            # still charges at least one token per content event.
            log.warning(
                "could not count output tokens",
                extra={"request_id": self.request_id, "model": model},
                exc_info=True,
            )
            return 0

    def _observe_prompt_count(self, backend_prompt_tokens: int) -> None:
        if self._request is None:
            return
        error = self._prompt_tokens - backend_prompt_tokens
        self._svc.metrics.prompt_count_error.labels(self._request.model).observe(error)
        if error:
            self._svc.metrics.prompt_count_mismatches.labels(self._request.model).inc()
            log.warning(
                "prompt count differs from the backend's",
                extra={
                    "request_id": self.request_id,
                    "model": self._request.model,
                    "kvgate_prompt_tokens": self._prompt_tokens,
                    "backend_prompt_tokens": backend_prompt_tokens,
                },
            )

    # ------------------------------------------------------------------ settlement

    async def _settle(self, cause: SettleCause) -> ActualUsage | None:
        """Settle once with what was seen; returns what was charged (None if this stream
        had nothing to settle or already settled)."""
        if self.reservation is None or self._settling:
            return None
        self._settling = True  # set before any await: exactly once
        self.phase = Phase.SETTLED
        reservation = self.reservation
        try:
            reading = await self._reading()
        except asyncio.CancelledError:
            # Cancelled while counting: settle in the background with what is known.
            self._svc.track(self._settle_in_background(reservation, cause, ResponseReading()))
            raise
        charged, metered = charged_usage(cause, reading, reservation, self._cut_rule())
        task = self._svc.settle(
            reservation,
            cause,
            charged,
            metered=metered,
            request_id=self.request_id,
            pricing=self._route.pricing if self._route else Pricing(),
        )
        # Shielded: if this stream is cancelled right now, the settlement still lands.
        await asyncio.shield(task)
        return charged

    async def _settle_in_background(
        self, reservation: Reservation, cause: SettleCause, reading: ResponseReading
    ) -> None:
        charged, metered = charged_usage(cause, reading, reservation, self._cut_rule())
        await self._svc.settle(
            reservation,
            cause,
            charged,
            metered=metered,
            request_id=self.request_id,
            pricing=self._route.pricing if self._route else Pricing(),
        )

    def _cut_rule(self) -> CutRequestCharge:
        return CutRequestCharge(self._snapshot.config.server.cut_request_charge)

    def close(self, *, shutting_down: bool) -> None:
        """The gRPC stream ended. If the request was admitted and not settled, the client
        went away (or Envoy gave up): settle with what was seen so far."""
        if self.reservation is None or self._settling or self._handed_off:
            return
        self._svc.metrics.stream_disconnects.labels(self.phase.value).inc()
        self._settling = True
        reservation = self.reservation
        cause = SettleCause.SHUTDOWN if shutting_down else SettleCause.DISCONNECTED
        self.phase = Phase.SETTLED

        async def settle_after_disconnect() -> None:
            reading = await self._reading()
            await self._settle_in_background(reservation, cause, reading)

        self._svc.track(settle_after_disconnect())

    # ------------------------------------------------------------------ helpers

    def _metadata(self, decision: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"decision": decision}
        if self.tenant:
            meta["tenant"] = self.tenant
        if self._request is not None:
            meta["model"] = self._request.model
        if self.reservation is not None:
            # After a budget fallback this is the model that really served the request.
            meta["model"] = self.reservation.request.model
            meta["backend"] = self.reservation.request.backend
            meta["reserved_tokens"] = self.reservation.kv_tokens
            meta[METADATA_KEY] = self.reservation.reservation_id
        if self._prompt_tokens:
            meta["prompt_tokens"] = self._prompt_tokens
        return meta


def _admission_id(request_id: str) -> str:
    """The store's key for this admission: unique per stream. x-request-id alone is not:
    a client may send its own (Envoy keeps it), and reservations, billing records and
    abandon tombstones must never be shared between two requests."""
    return f"{request_id}/{secrets.token_hex(8)}"


def _reason_for(error: ApiError) -> Reason:
    if error.status == 404 and error.code == "model_not_found":
        return Reason.MODEL_NOT_FOUND
    if error.code == "context_length_exceeded":
        return Reason.CONTEXT_LENGTH_EXCEEDED
    return Reason.INVALID_REQUEST
