"""Traces through the real gRPC servicer: Envoy's traceparent in the request headers, the
decision and settlement spans out (an in-memory exporter in place of OTLP)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvgate.tracing import Tracing
from tests.session.conftest import (
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    sse_events,
)
from tests.session.support import CHAT, chunk, run_stream, traced_rig

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ENVOY_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{ENVOY_SPAN}-01"


async def test_spans_join_envoys_trace() -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter, tenant_attribute=True):
        prompt = await run_stream(rig, {"traceparent": TRACEPARENT, "tracestate": "envoy=1"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"kvgate.decision", "kvgate.settlement"}
    decision, settlement = spans["kvgate.decision"], spans["kvgate.settlement"]
    for span in (decision, settlement):
        assert span.context.trace_id == int(TRACE_ID, 16)
        assert span.parent is not None and span.parent.span_id == int(ENVOY_SPAN, 16)
        assert span.resource.attributes["service.name"] == "kvgate"
        assert span.attributes is not None
        assert span.attributes["kvgate.tenant"] == "acme"
        assert span.attributes["kvgate.request_id"] == "req-1"
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.provider.name"] == "openai"
    assert decision.attributes is not None and settlement.attributes is not None
    assert decision.attributes["gen_ai.request.model"] == "qwen2.5-demo"
    assert decision.attributes["gen_ai.request.max_tokens"] == CHAT["max_tokens"]
    assert decision.attributes["gen_ai.usage.input_tokens"] == prompt
    assert decision.attributes["kvgate.decision.outcome"] == "admitted"
    assert settlement.attributes["gen_ai.usage.input_tokens"] == prompt
    assert settlement.attributes["gen_ai.usage.output_tokens"] == 2
    assert settlement.attributes["gen_ai.response.model"] == "qwen2.5-demo"
    assert settlement.attributes["kvgate.settlement.cause"] == "completed"
    assert settlement.attributes["kvgate.settlement.booked"] == "booked"
    assert [link.context.span_id for link in settlement.links] == [decision.context.span_id]


async def test_a_rejection_is_a_decision_span() -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter):
        stream = rig.stream()
        await stream.exchange(headers_msg(extra={"traceparent": TRACEPARENT}))
        too_long = dict(CHAT, max_tokens=10_000_000)
        reply = await stream.exchange(body_msg(too_long))
        assert reply.WhichOneof("response") == "immediate_response"
        reason = reply.immediate_response.details.removeprefix("kvgate_")
        await stream.half_close()
    [decision] = exporter.get_finished_spans()
    assert decision.name == "kvgate.decision"
    assert decision.attributes is not None
    assert decision.attributes["kvgate.decision.outcome"] == "rejected"
    assert decision.attributes["kvgate.decision.reason"] == reason
    assert "kvgate.tenant" not in decision.attributes  # not enabled here
    assert decision.status.status_code is StatusCode.UNSET
    assert decision.context.trace_id == int(TRACE_ID, 16)


async def test_a_client_gone_is_settled_in_the_trace() -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter):
        stream = rig.stream()
        await stream.exchange(headers_msg(extra={"traceparent": TRACEPARENT}))
        await stream.exchange(body_msg(dict(CHAT, stream=True)))
        await stream.exchange(response_headers_msg())
        await stream.exchange(response_body_msg(sse_events([chunk(role=True), chunk(" a")])))
        stream.reset()
        assert await rig.in_flight_after_reset() == (0, 0)
    [settlement] = [s for s in exporter.get_finished_spans() if s.name == "kvgate.settlement"]
    assert settlement.attributes is not None
    assert settlement.attributes["kvgate.settlement.cause"] == "disconnected"
    assert settlement.context.trace_id == int(TRACE_ID, 16)


async def test_tracing_off_builds_and_calls_nothing(
    rig_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tracing is off: no tracer, no span")

    # The default config: the tracer is never built, and no span method is ever reached.
    monkeypatch.setattr(Tracing, "__init__", never)
    monkeypatch.setattr(Tracing, "extract", never)
    monkeypatch.setattr(Tracing, "decision", never)
    monkeypatch.setattr(Tracing, "settlement", never)
    async for rig in rig_factory():
        assert rig.server.tracing is None
        assert rig.server.services.settler.tracing is None
        await run_stream(rig, {"traceparent": TRACEPARENT})
        assert await rig.usage() != (0, 0, 0)
