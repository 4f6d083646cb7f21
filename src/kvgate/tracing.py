"""OpenTelemetry traces: one span per admission decision, one per settlement.

Optional (`pip install 'kvgate[otel]'`) and off by default. With `tracing.enabled: false`
nothing here is imported or built: the session and the settler hold `None` and skip every
tracing call with one `is not None` check. A config that enables tracing without the
OpenTelemetry packages fails at start, naming the extra.

Both spans join the request's trace through the W3C `traceparent`/`tracestate` headers Envoy
passes to ext_proc (Envoy's own span when its tracing is on, or the client's). Whether they are
kept is kvgate's own decision (`sample_ratio`, one random draw per request): the sampled flag
of that traceparent may come straight from a client, which must not be able to switch on
tracing for everything it sends (nor hide from it). `trust_parent_sampling` follows the flag
instead. `kvgate.decision`
covers the request body's arrival to kvgate's reply; `kvgate.settlement` covers settling the
admitted request (charging it and the store write) and links to the decision. Attribute names
follow the OpenTelemetry generative-AI semantic conventions where one exists (`gen_ai.*`), and
are `kvgate.*` otherwise; the tenant is an attribute only when the operator enables it.

Spans are recorded after the fact with explicit start times: nothing is held open across an
await, and a span is one `start_span` + `end` at the point the work is done.
"""

from __future__ import annotations

import importlib.metadata
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvgate.config.model import ConfigError, TracingConfig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import SpanContext

    from kvgate.lifecycle.ticket import Ticket
    from kvgate.openai import ParsedRequest
    from kvgate.policy import ActualUsage, SettleCause

INSTALL_HINT = "pip install 'kvgate[otel]'"
DECISION_SPAN = "kvgate.decision"
SETTLEMENT_SPAN = "kvgate.settlement"
# kvgate speaks the OpenAI REST API: the semantic conventions' telemetry flavour "openai"
# (gen_ai.provider.name replaced gen_ai.system in semantic conventions 1.37).
PROVIDER_NAME = "openai"
OPERATION_NAMES = {"chat": "chat", "completion": "text_completion", "pooling": "embeddings"}
# Admitted requests waiting for their settlement span (their trace parent and decision span).
# Every admitted request is settled, so entries leave on their own; the bound only guards
# against an unforeseen leak.
MAX_PENDING = 100_000
# Rejections that are kvgate failing, not a policy answer: the decision span is an error.
ERROR_REASONS = frozenset({"internal_error", "decision_timeout", "store_unavailable"})


def build_tracing(config: TracingConfig, *, exporter: SpanExporter | None = None) -> Tracing | None:
    """The tracer for this config, or None when tracing is off (nothing is imported then).

    `exporter` replaces the OTLP exporter (tests; spans are then exported synchronously)."""
    if not config.enabled:
        return None
    try:
        return Tracing(config, exporter=exporter)
    except ImportError as exc:
        if _otel_proto_shadowed(exc):
            raise ConfigError(
                "tracing.enabled: opentelemetry-proto is installed but its generated modules "
                "were overwritten by xds-protos, which ships older copies of the same files "
                f"({exc}); reinstall it after kvgate's other dependencies: pip install "
                "--no-deps --force-reinstall opentelemetry-proto"
            ) from None
        raise ConfigError(
            f"tracing.enabled needs the OpenTelemetry packages, which are not installed "
            f"({exc.name or exc}): {INSTALL_HINT}, or set tracing.enabled: false"
        ) from None


def _otel_proto_shadowed(error: ImportError) -> bool:
    """xds-protos and opentelemetry-proto both install opentelemetry/proto/**/*_pb2.py; the
    package installed last wins, and xds-protos' copies lack newer messages."""
    from importlib import metadata

    if not (error.name or "").startswith("opentelemetry.proto"):
        return False
    try:
        metadata.version("opentelemetry-proto")
    except metadata.PackageNotFoundError:
        return False
    return True


class Tracing:
    def __init__(
        self,
        config: TracingConfig,
        *,
        exporter: SpanExporter | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        """`draw`: a uniform number in [0, 1) per traced request (the sampling decision)."""
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        try:
            version = importlib.metadata.version("kvgate")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            version = "unknown"

        self._trace = trace
        self._kind = trace.SpanKind.INTERNAL
        self._error = trace.Status(trace.StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()
        self._tenant_attribute = config.tenant_attribute
        # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES (e.g. k8s.pod.name).
        resource = Resource.create(
            {"service.name": config.service_name, "service.version": version}
        )
        # Spans follow their parent's sampled flag: the incoming one when it is trusted, else
        # the flag extract() sets from kvgate's own draw. sample_ratio decides the traces
        # kvgate starts itself.
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        self._sample_ratio = config.sample_ratio
        self._trust_parent_sampling = config.trust_parent_sampling
        self._draw = draw
        # kvgate's own provider, not the process-global one: nothing else in the process
        # (or another server in the same test process) is affected.
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # No endpoint: the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT environment,
            # else http://localhost:4317 (a node-local collector). OTEL_EXPORTER_OTLP_HEADERS
            # etc. apply as usual.
            otlp = OTLPSpanExporter(endpoint=config.otlp_endpoint)
            # Exports in its own thread, in batches; spans are dropped (counted by the SDK),
            # never waited for, when the collector is slow or gone.
            self.provider.add_span_processor(BatchSpanProcessor(otlp))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("kvgate", version)
        self._pending: dict[str, tuple[Context | None, SpanContext | None]] = {}

    # ------------------------------------------------------------------ request side

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The trace parent named by the request's traceparent/tracestate, if any: its trace
        and span ids, with kvgate's sampling decision in place of the incoming one unless
        that is trusted."""
        if "traceparent" not in headers:
            return None
        context = self._propagator.extract(headers)
        if self._trust_parent_sampling:
            return context
        # Imported by __init__ already (a sys.modules look-up): the typed module, which
        # self._trace (a ModuleType to the type checker) is not.
        from opentelemetry import trace

        incoming = trace.get_current_span(context).get_span_context()
        if not incoming.is_valid:
            return None  # malformed: kvgate starts a trace of its own
        # Not the trace id's bits (TraceIdRatioBased): the client chooses those too.
        sampled = self._draw() < self._sample_ratio
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT)
        own = trace.SpanContext(
            incoming.trace_id,
            incoming.span_id,
            is_remote=True,
            trace_flags=flags,
            trace_state=incoming.trace_state,
        )
        return trace.set_span_in_context(trace.NonRecordingSpan(own))

    def decision(
        self,
        parent: Context | None,
        start_ns: int,
        *,
        request_id: str,
        outcome: str,
        reason: str,
        tenant: str | None,
        request: ParsedRequest | None,
        ticket: Ticket | None,
    ) -> None:
        """Record the decision span (ends now); an admitted request's settlement span will
        join the same trace."""
        attributes: dict[str, Any] = {
            "gen_ai.provider.name": PROVIDER_NAME,
            "kvgate.decision.outcome": outcome,
            "kvgate.decision.reason": reason,
        }
        if request_id:
            attributes["kvgate.request_id"] = request_id
        if request is not None:
            attributes["gen_ai.operation.name"] = OPERATION_NAMES.get(request.kind, request.kind)
            attributes["gen_ai.request.model"] = request.model
            if request.stream:
                attributes["gen_ai.request.stream"] = True
            if request.n != 1:
                attributes["gen_ai.request.choice.count"] = request.n
            if request.max_new_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = request.max_new_tokens
        if ticket is not None:
            attributes["gen_ai.usage.input_tokens"] = ticket.prompt_tokens
            # The cap the engine may generate: what was reserved (after a clamp).
            attributes["gen_ai.request.max_tokens"] = ticket.max_new_tokens
            attributes["kvgate.model"] = ticket.model  # differs after a budget fallback
            attributes["kvgate.backend"] = ticket.backend
            attributes["kvgate.reserved_tokens"] = ticket.reservation.kv_tokens
            if ticket.fallback_from is not None:
                attributes["kvgate.fallback_from"] = ticket.fallback_from
            if ticket.clamped_from is not None:
                attributes["kvgate.clamped_from"] = ticket.clamped_from
        if tenant is not None and self._tenant_attribute:
            attributes["kvgate.tenant"] = tenant
        span = self._tracer.start_span(
            DECISION_SPAN,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            start_time=start_ns,
        )
        if reason in ERROR_REASONS:
            span.set_attribute("error.type", reason)
            span.set_status(self._error)
        span.end()
        if ticket is not None:
            pending = self._pending
            if len(pending) >= MAX_PENDING:
                del pending[next(iter(pending))]
            pending[ticket.reservation.reservation_id] = (parent, span.get_span_context())

    # ------------------------------------------------------------------ settlement side

    def settlement(
        self,
        ticket: Ticket,
        cause: SettleCause,
        usage: ActualUsage,
        cost_usd: float,
        start_ns: int,
        *,
        metered: bool,
        booked: str,
    ) -> None:
        """Record the settlement span (ends now): a child of the request's trace parent and
        linked to its decision (a child of the decision when the request had no parent)."""
        parent, decision = self._pending.pop(ticket.reservation.reservation_id, (None, None))
        links = []
        if decision is not None and decision.is_valid:
            links.append(self._trace.Link(decision))
            if parent is None:
                parent = self._trace.set_span_in_context(self._trace.NonRecordingSpan(decision))
        request = ticket.request
        attributes: dict[str, Any] = {
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.operation.name": OPERATION_NAMES.get(request.kind, request.kind),
            "gen_ai.request.model": request.model,
            "gen_ai.response.model": ticket.model,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
            "kvgate.settlement.cause": cause.value,
            "kvgate.settlement.metered": metered,
            "kvgate.settlement.booked": booked,
            "kvgate.cost_usd": cost_usd,
            "kvgate.backend": ticket.backend,
            "kvgate.reserved_tokens": ticket.reservation.kv_tokens,
        }
        if usage.cached_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
        if ticket.request_id:
            attributes["kvgate.request_id"] = ticket.request_id
        if self._tenant_attribute:
            attributes["kvgate.tenant"] = ticket.tenant
        span = self._tracer.start_span(
            SETTLEMENT_SPAN,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            links=links,
            start_time=start_ns,
        )
        if booked == "failed":
            span.set_attribute("error.type", "store_error")
            span.set_status(self._error)
        span.end()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: call from a worker thread)."""
        self.provider.shutdown()
