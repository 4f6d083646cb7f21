"""What a stream does with Envoy's messages once its request headers chose a role.

* ``Handler``: the null object: a request answered at its headers (a refusal, the usage
  report) or passed through (``/v1/models``); every later message continues unchanged.
* ``MeteredHandler``: a metered API's request: the body's decision through its
  ``Exchange``, then the answer's headers and chunks to the one settlement.
* ``ObservingHandler``: the split layout's observing stream: the answer of a request
  admitted on another stream, metered and settled; Envoy ignores its replies.
* ``CountingHandler``: an endpoint kvgate answers itself with the prompt's exact count
  (``PromptCount``); nothing is forwarded.

The phase of each says what may still happen:

    REQUEST_HEADERS -> REQUEST_BODY -> FORWARDED -> RESPONSE -> SETTLED
                    \\-> REJECTED | PASSTHROUGH    \\-> HANDED_OFF (split layout)
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.config.model import QUEUE_DEADLINE_MARGIN_S
from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.extproc import messages
from kvgate.extproc.handoff import METADATA_KEY
from kvgate.extproc.route_settings import RouteSettings, RouteSettingsError
from kvgate.extproc.services import GatewayServices
from kvgate.lifecycle import Ticket
from kvgate.lifecycle.answer_sources import Hit
from kvgate.lifecycle.exchange import Exchange, Forward, PromptCount, UnmeteredForward
from kvgate.lifecycle.protocol import ErrorAnswer, Outcome, Refused
from kvgate.openai import ParsedRequest
from kvgate.policy import ActualUsage, Reason, SettleCause, pico_to_usd
from kvgate.usage_records.facts import NO_PRINCIPAL, Principal

if TYPE_CHECKING:
    from opentelemetry.context import Context

log = logging.getLogger("kvgate.session")

# Where a pool request goes: the endpoint kvgate reserved on (Envoy's ORIGINAL_DST
# cluster reads it with original_dst_lb_config.http_header_name).
DESTINATION_HEADER = "x-kvgate-destination"
# A JSON answer up to this size (by its content-length) comes in one BUFFERED message
# instead of chunk by chunk. Well below the 8 MiB buffer limit of the shipped configs:
# Envoy fails a BUFFERED body over its limit, so larger or unsized answers stay STREAMED.
BUFFERED_ANSWER_MAX_BYTES = 1024 * 1024


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


def _small_json_answer(content_type: str, content_length: str) -> bool:
    """A whole (non-streamed) answer whose declared size fits one buffered message."""
    if not content_type.startswith("application/json") or not (
        content_length.isascii() and content_length.isdigit()
    ):
        return False
    return int(content_length) <= BUFFERED_ANSWER_MAX_BYTES


@dataclass
class StreamFacts:
    """What a stream knows of its request, for every reply, log line and metric."""

    services: GatewayServices
    # What Envoy's route said for this request (gRPC metadata), or why it is unusable.
    route: RouteSettings | RouteSettingsError
    # The configuration the whole request is decided with.
    snapshot: RuntimeSnapshot
    request_id: str = ""
    tenant: str | None = None
    # Who the caller is inside its tenant (a token's user and team, a directory key's
    # team, user and id); empty for a config key.
    principal: Principal = NO_PRINCIPAL
    # How the mesh identified the caller ("jwt", "spiffe"); None for an API key.
    identity_source: str | None = None

    def metadata(
        self,
        decision: str,
        request: ParsedRequest | None = None,
        ticket: Ticket | None = None,
    ) -> dict[str, Any]:
        """Envoy's dynamic metadata for the access log (and the split layout's hand-off)."""
        meta: dict[str, Any] = {"decision": decision}
        if self.tenant:
            meta["tenant"] = self.tenant
        if self.identity_source:
            meta["identity"] = self.identity_source
        principal = self.principal
        if principal.user:
            meta["user"] = principal.user
        if principal.team:
            meta["team"] = principal.team
        if principal.key_id:
            meta["key_id"] = principal.key_id
        if isinstance(self.route, RouteSettings) and self.route.name:
            meta["route"] = self.route.name
        if request is not None:
            meta["model"] = request.model
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

    def refusal(
        self,
        answer: ErrorAnswer,
        label: Reason | Outcome,
        request: ParsedRequest | None = None,
    ) -> pb.ProcessingResponse:
        """The refusal's immediate response, counted and logged."""
        metrics = self.services.metrics
        metrics.requests.labels("rejected", label.value).inc()
        if self.tenant is not None:
            metrics.tenant_rejections.labels(self.tenant, label.value).inc()
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
            dynamic_metadata=self.metadata(label.value, request),
        )


class Handler:
    """The null object: the request was answered at its headers or passed through, so
    every later message continues unchanged and there is nothing to settle."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase

    @property
    def ticket(self) -> Ticket | None:
        return None

    def may_wait(self) -> bool:
        """Whether the request body's decision may wait (a queue, an Idempotency-Key)."""
        return False

    async def on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(request_body=pb.BodyResponse())

    async def on_response_headers(self, http: pb.HttpHeaders) -> pb.ProcessingResponse:
        return messages.continue_response_headers()

    async def on_response_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        return messages.continue_response_body()

    def close(self, *, shutting_down: bool) -> None:
        """The stream ended."""


class CountingHandler(Handler):
    """A request answered with its prompt's exact count, decided on its body."""

    def __init__(self, facts: StreamFacts, count: PromptCount) -> None:
        super().__init__(Phase.REQUEST_BODY)
        self._facts = facts
        self._count = count

    async def on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if self.phase is not Phase.REQUEST_BODY:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        self.phase = Phase.REJECTED  # answered by kvgate: nothing to meter
        facts = self._facts
        try:
            body = await self._count.answer(http.body)
        except Refused as refused:
            return facts.refusal(refused.answer, refused.label, self._count.request)
        decision = self._count.api.name
        facts.services.metrics.requests.labels("answered", decision).inc()
        return messages.immediate_response(
            200,
            body,
            {"content-type": "application/json"},
            details=f"kvgate_{decision}",
            dynamic_metadata=facts.metadata(decision, self._count.request),
        )


def _route_headers(
    facts: StreamFacts, model: str, cluster: str, endpoint: str | None
) -> dict[str, str]:
    """The headers Envoy routes a forwarded request on (clients' x-kvgate-* never get this
    far), and the backend's own key where it has one."""
    headers = {"x-kvgate-model": model, "x-kvgate-backend": cluster}
    if endpoint is not None:
        # The pool's ORIGINAL_DST cluster connects to exactly this endpoint (for a metered
        # request, the one holding its reservation).
        headers[DESTINATION_HEADER] = endpoint
    upstream_key = facts.snapshot.upstream_keys.get(cluster)
    if upstream_key is not None:
        headers["authorization"] = f"Bearer {upstream_key}"
    return headers


class UnmeteredHandler(Handler):
    """A request that generates nothing (vLLM's /tokenize), forwarded on its body after the
    tenant's RPM slot; nothing to meter or settle."""

    def __init__(self, facts: StreamFacts, forward: UnmeteredForward) -> None:
        super().__init__(Phase.REQUEST_BODY)
        self._facts = facts
        self._forward = forward

    async def on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if self.phase is not Phase.REQUEST_BODY:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        facts = self._facts
        try:
            destination = await self._forward.decide(http.body)
        except Refused as refused:
            self.phase = Phase.REJECTED
            return facts.refusal(refused.answer, refused.label)
        self.phase = Phase.PASSTHROUGH
        name = self._forward.api.name
        facts.services.metrics.requests.labels("passthrough", name).inc()
        meta = facts.metadata(name)
        meta["model"] = destination.model
        meta["backend"] = destination.cluster
        if destination.endpoint is not None:
            meta["endpoint"] = destination.endpoint
        return messages.continue_request_body(
            _route_headers(facts, destination.model, destination.cluster, destination.endpoint),
            new_body=None,
            dynamic_metadata=meta,
        )


class ObservingHandler(Handler):
    """The answer of an admitted request, metered to its one settlement."""

    def __init__(self, facts: StreamFacts, exchange: Exchange, phase: Phase) -> None:
        super().__init__(phase)
        self._facts = facts
        self._exchange = exchange

    @property
    def ticket(self) -> Ticket | None:
        return self._exchange.ticket

    async def on_response_headers(self, http: pb.HttpHeaders) -> pb.ProcessingResponse:
        if not self.phase.unsettled:
            return messages.continue_response_headers()
        exchange = self._exchange
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
            await self._settle(exchange.end_cause())
            return messages.continue_response_headers(added)
        return messages.continue_response_headers(
            added, buffer_body=_small_json_answer(content_type, headers.get("content-length", ""))
        )

    async def on_response_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if not self.phase.unsettled:
            return messages.continue_response_body()
        exchange = self._exchange
        replacement = exchange.on_chunk(http.body, end_of_stream=http.end_of_stream)
        if not http.end_of_stream:
            return messages.continue_response_body(replacement)
        cause = exchange.end_cause()
        # Settled before replying (the reply may never be read); the store write goes on
        # in the background.
        charged = await self._settle(cause)
        ticket = exchange.ticket
        meta = self._facts.metadata("admitted", exchange.request, ticket)
        if charged is not None and ticket is not None:
            meta["output_tokens"] = charged.output_tokens
            meta["settled"] = cause.value
            cost = ticket.pricing.cost(
                charged.prompt_tokens, charged.output_tokens, charged.cached_tokens
            )
            meta["cost_usd"] = str(pico_to_usd(cost))
        return messages.continue_response_body(replacement, dynamic_metadata=meta)

    async def _settle(self, cause: SettleCause) -> ActualUsage | None:
        self.phase = Phase.SETTLED  # before any await: exactly once
        return await self._exchange.settle(cause)

    def close(self, *, shutting_down: bool) -> None:
        """If the request was admitted and not settled, the client went away (or Envoy gave
        up): it settles with what was seen so far."""
        cause = SettleCause.SHUTDOWN if shutting_down else SettleCause.DISCONNECTED
        if self._exchange.close(cause):
            self._facts.services.metrics.stream_disconnects.labels(self.phase.value).inc()
            self.phase = Phase.SETTLED


class MeteredHandler(ObservingHandler):
    """A metered API's request: decided on its body, then its answer metered."""

    def __init__(
        self,
        facts: StreamFacts,
        exchange: Exchange,
        *,
        may_wait: bool,
        answer_seen_elsewhere: bool,
        trace_parent: Context | None,
    ) -> None:
        super().__init__(facts, exchange, Phase.REQUEST_BODY)
        self._may_wait = may_wait
        # The split layout: an observing stream meters and settles the answer.
        self._answer_seen_elsewhere = answer_seen_elsewhere
        self._tracing = facts.services.settler.tracing
        self._trace_parent = trace_parent
        # The message-timeout extension for Envoy while the decision waits.
        self._interim: asyncio.Future[pb.ProcessingResponse] | None = None

    def may_wait(self) -> bool:
        return self.phase is Phase.REQUEST_BODY and self._may_wait

    async def on_request_body(self, http: pb.HttpBody) -> pb.ProcessingResponse:
        if self.phase is not Phase.REQUEST_BODY:
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        # In BUFFERED mode this one message is the whole body, whatever end_of_stream says:
        # with HTTP/2 request trailers it arrives with end_of_stream=false (the trailers end
        # the stream). So this message is the admission point, always; nothing that follows
        # can carry more body.
        started = time.perf_counter()
        trace_start = time.time_ns() if self._tracing is not None else 0
        try:
            decided = await self._exchange.decide(http.body)
        except Refused as refused:
            self.phase = Phase.REJECTED
            reply = self._facts.refusal(refused.answer, refused.label, self._exchange.request)
        else:
            reply = self._answered(decided) if isinstance(decided, Hit) else self._forward(decided)
        outcome = "admitted" if self.ticket is not None else "rejected"
        self._facts.services.metrics.decision_seconds.labels(outcome).observe(
            time.perf_counter() - started
        )
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
                request_id=self._facts.request_id,
                outcome=outcome,
                reason=details.removeprefix("kvgate_") or Reason.ADMITTED.value,
                tenant=self._facts.tenant,
                request=self._exchange.request,
                ticket=self.ticket,
            )
        except Exception:
            log.exception("recording the decision span failed")

    def _forward(self, forward: Forward) -> pb.ProcessingResponse:
        """Admitted: the request goes upstream to the endpoint holding its reservation."""
        facts = self._facts
        ticket = forward.ticket
        facts.request_id = ticket.request_id
        self.phase = Phase.FORWARDED
        facts.services.metrics.requests.labels("admitted", Reason.ADMITTED.value).inc()
        if self._answer_seen_elsewhere:
            # The observing stream meters and settles it (see handoff.py).
            self._exchange.hand_off()
            self.phase = Phase.HANDED_OFF
            facts.services.handoffs.register(ticket, facts.services.settle_unclaimed)
        return messages.continue_request_body(
            _route_headers(facts, ticket.route.name, ticket.cluster, ticket.endpoint),
            new_body=forward.body,
            dynamic_metadata=facts.metadata("admitted", self._exchange.request, ticket),
        )

    def _answered(self, hit: Hit) -> pb.ProcessingResponse:
        """A stored answer answers the request: nothing is forwarded or metered."""
        self.phase = Phase.REJECTED  # answered by kvgate: nothing to meter
        self._facts.services.metrics.requests.labels("answered", hit.reason).inc()
        return messages.immediate_response(
            hit.answer.status,
            hit.answer.body,
            {**dict(hit.headers), "content-type": hit.answer.content_type},
            details=f"kvgate_{hit.reason}",
            dynamic_metadata=self._facts.metadata(hit.reason, self._exchange.request),
        )

    def extend_message_timeout(self, wait_s: float) -> None:
        """The decision waits (an Idempotency-Key's first run, a pool's queue): ask Envoy
        (override_message_timeout, up to the filter's max_message_timeout) to wait as long
        as the exchange's own decision deadline, so neither answers with a timeout while the
        request is in line."""
        interim = self._interim
        if interim is not None and not interim.done():
            interim.set_result(messages.override_message_timeout(wait_s + QUEUE_DEADLINE_MARGIN_S))

    async def decide_with_interim(
        self, decide: asyncio.Future[pb.ProcessingResponse | None]
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """``decide``'s reply, preceded by the message-timeout extension if it waits."""
        interim: asyncio.Future[pb.ProcessingResponse] = asyncio.get_running_loop().create_future()
        self._interim = interim
        try:
            await asyncio.wait({decide, interim}, return_when=asyncio.FIRST_COMPLETED)
            if interim.done() and not decide.done():
                yield interim.result()
            reply = await decide
            if reply is not None:
                yield reply
        finally:
            self._interim = None
            if not decide.done():
                # The stream went away while the request waited: leave the queue now (the
                # admission's own cancel handling releases whatever it reserved).
                decide.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await decide
