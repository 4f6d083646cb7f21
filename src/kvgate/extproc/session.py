"""One ext_proc stream = one HTTP request: an explicit state machine that admits and settles.

REQUEST_HEADERS -> REQUEST_BODY -> FORWARDED -> RESPONSE_BODY -> SETTLED, or REJECTED /
PASSTHROUGH. Settlement happens exactly once whichever way the stream ends: the response's
end_of_stream, a client disconnect, an upstream reset, an Envoy timeout, or shutdown.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
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
from kvgate.openai import (
    ApiError,
    ParsedRequest,
    SseStreamFilter,
    parse_request,
    rewrite_body,
    usage_from_json_body,
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

log = logging.getLogger("kvgate.session")

_Mode = processing_mode_pb2.ProcessingMode

ADMITTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Requests that only need a valid key: they cost the GPU nothing.
PASSTHROUGH_PATHS = frozenset({"/v1/models"})
HEADER_PREFIX = "x-kvgate-"


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


def _api_key(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, token = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key", "").strip()
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
        self.observer = False
        self._handed_off = False
        self._usage_injected = False
        self._path = ""
        self._body = bytearray()
        self._request: ParsedRequest | None = None
        self._prompt_tokens = 0
        self._max_new_tokens = 0
        self.reservation: Reservation | None = None
        self._settling = False
        self._response_status = 0
        self._streaming_response = False
        self._sse: SseStreamFilter | None = None
        self._response_body = bytearray()
        self._response_body_overflow = False
        self._last_renewal = 0.0

    # ------------------------------------------------------------------ dispatch

    async def handle(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if message.observability_mode:
            return await self._observe(message, kind)
        if message.HasField("protocol_config"):
            # Sent on a stream's first message: NONE means this filter never sees the response.
            self._response_elsewhere = message.protocol_config.response_body_mode == _Mode.NONE
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
        self._last_renewal = self._svc.clock.now()

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
            return self._reject(
                ApiError(
                    status=500,
                    message="kvgate could not process this request.",
                    type="server_error",
                    code="internal_error",
                    param=None,
                ),
                Reason.INTERNAL_ERROR,
            )
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
                {"x-kvgate-tenant": tenant}, forged, skip_rest=True
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
        self.phase = Phase.REQUEST_BODY
        return messages.continue_request_headers({"x-kvgate-tenant": tenant}, forged)

    async def _on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if self.phase is not Phase.REQUEST_BODY:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        self._body += http.body
        if not http.end_of_stream:
            # BUFFERED mode sends one message; be tolerant of a split body anyway.
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        started = time.perf_counter()
        try:
            reply = await self._admit(bytes(self._body))
        except ApiError as error:
            reply = self._reject(error, _reason_for(error))
        except AdmissionRejected as rejected:
            reply = self._reject(rejected.error, rejected.reason)
        outcome = "admitted" if self.reservation is not None else "rejected"
        self._svc.metrics.decision_seconds.labels(outcome).observe(time.perf_counter() - started)
        return reply

    async def _admit(self, body: bytes) -> pb.ProcessingResponse:
        request = parse_request(self._path, body)
        self._request = request
        assert self._tenant_policy is not None
        admitted = await AdmissionPlanner(self._svc, self._snapshot).admit(
            request, self._tenant_policy, self.request_id
        )
        self.reservation = admitted.reservation
        self._route = admitted.route
        self._prompt_tokens = admitted.prompt_tokens
        self._max_new_tokens = admitted.max_new_tokens
        self._client_headers = admitted.client_headers
        self.phase = Phase.FORWARDED
        self._last_renewal = self._svc.clock.now()
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
        new_body: bytes | None = None
        if force_usage or admitted.new_model or admitted.new_max_tokens:
            new_body = rewrite_body(
                request.body,
                model=admitted.new_model,
                max_tokens=admitted.new_max_tokens,
                force_usage=force_usage,
            )
        return messages.continue_request_body(
            {"x-kvgate-model": admitted.route.name, "x-kvgate-backend": admitted.route.backend},
            new_body=new_body,
            dynamic_metadata=self._metadata("admitted"),
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
        if self.phase is Phase.FORWARDED:
            self.phase = Phase.RESPONSE_BODY
        if http.end_of_stream:
            # A body-less response (e.g. an upstream error with no body): settle now.
            usage = self._usage_at_end() or await self._counted_usage()
            await self._settle(self._end_cause(), usage)
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
        elif not self._response_body_overflow:
            limit = self._snapshot.config.server.max_buffered_response_bytes
            if len(self._response_body) + len(chunk) <= limit:
                self._response_body += chunk
            else:
                self._response_body_overflow = True
                self._response_body.clear()

        if not http.end_of_stream:
            await self._maybe_renew_lease()
            return messages.continue_response_body(replacement)

        usage = self._usage_at_end()
        if usage is None:
            # No usage from the backend: count what was streamed with the model's tokenizer.
            usage = await self._counted_usage()
        # Record the settlement before replying: the reply may never be read.
        await self._settle(self._end_cause(), usage)
        meta = self._metadata("admitted")
        meta["output_tokens"] = usage.output_tokens
        meta["settled"] = self._end_cause().value
        if self._route is not None:
            cost = self._route.pricing.cost(
                usage.prompt_tokens, usage.output_tokens, usage.cached_tokens
            )
            meta["cost_usd"] = str(pico_to_usd(cost))
        return messages.continue_response_body(replacement, dynamic_metadata=meta)

    def _streamed(self) -> bool:
        """Whether any answer text reached the client (decides what a cut request costs)."""
        return self._sse is not None and bool(self._sse.output_text())

    def _ok(self) -> bool:
        return 200 <= self._response_status < 300

    def _end_cause(self) -> SettleCause:
        return SettleCause.COMPLETED if self._ok() else SettleCause.UPSTREAM_ERROR

    def _usage_at_end(self) -> ActualUsage | None:
        """Usage as the backend reported it, or None when it did not."""
        if not self._ok():
            # The backend generated nothing we can bill for.
            return ActualUsage(prompt_tokens=0, output_tokens=0)
        reported = None
        if self._sse is not None:
            reported = self._sse.usage
        elif self._response_body and not self._response_body_overflow:
            reported = usage_from_json_body(bytes(self._response_body))
        if reported is None:
            return None
        self._observe_prompt_count(reported.prompt_tokens)
        return ActualUsage(
            prompt_tokens=reported.prompt_tokens,
            output_tokens=reported.completion_tokens,
            cached_tokens=reported.cached_tokens,
        )

    async def _counted_usage(self) -> ActualUsage:
        output = 0
        if self._sse is not None and self._request is not None:
            text = self._sse.output_text()
            if text:
                output = await self._svc.tokenizers.count_text(self._request.model, text)
        return ActualUsage(prompt_tokens=self._prompt_tokens, output_tokens=output)

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

    async def _maybe_renew_lease(self) -> None:
        if self.reservation is None:
            return
        now = self._svc.clock.now()
        if now - self._last_renewal >= self._svc.lease_renew_interval_s:
            self._last_renewal = now
            await self._svc.store.renew(self.reservation)

    # ------------------------------------------------------------------ settlement

    async def _settle(self, cause: SettleCause, usage: ActualUsage) -> None:
        task = self._start_settlement(cause, usage)
        if task is not None:
            # Shielded: if this stream is cancelled right now, the settlement still lands.
            await asyncio.shield(task)

    def _start_settlement(
        self, cause: SettleCause, usage: ActualUsage
    ) -> asyncio.Task[None] | None:
        if self.reservation is None or self._settling:
            return None
        self._settling = True  # set before any await: exactly once
        self.phase = Phase.SETTLED
        return self._svc.settle(
            self.reservation,
            cause,
            usage,
            request_id=self.request_id,
            streamed=self._streamed(),
            pricing=self._route.pricing if self._route else Pricing(),
        )

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
            reported = self._usage_at_end() if self._sse is not None else None
            usage = reported if reported is not None else await self._counted_usage()
            await self._svc.settle(
                reservation,
                cause,
                usage,
                request_id=self.request_id,
                streamed=self._streamed(),
                pricing=self._route.pricing if self._route else Pricing(),
            )

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


def _reason_for(error: ApiError) -> Reason:
    if error.status == 404 and error.code == "model_not_found":
        return Reason.MODEL_NOT_FOUND
    if error.code == "context_length_exceeded":
        return Reason.CONTEXT_LENGTH_EXCEEDED
    return Reason.INVALID_REQUEST
