"""Traces through the real Envoy: kvgate (its own process) exports its decision and
settlement spans over OTLP/gRPC to a receiver in this test, in the trace the client's
traceparent names (Envoy hands the request headers to ext_proc)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from testbed.harness import Stack
from tests.e2e.otlp import OtlpReceiver, attributes

MODEL = "qwen2.5-demo"
TRACE_ID = "5b8efff798038103d269b633813fc60c"
CLIENT_SPAN = "eee19b7ec3c1b174"


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    collector = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver: tuple[OtlpReceiver, int]) -> Iterator[Stack]:
    _, port = receiver
    tracing = {
        "enabled": True,
        "otlp_endpoint": f"http://127.0.0.1:{port}",
        "service_name": "kvgate-e2e",
        "tenant_attribute": True,
    }
    with Stack(kvgate_overrides={"tracing": tracing}) as running:
        yield running


def test_spans_reach_the_collector_in_the_clients_trace(
    stack: Stack, receiver: tuple[OtlpReceiver, int]
) -> None:
    collector, _ = receiver
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "trace me"}],
        "max_tokens": 16,
        "stream": True,
    }
    headers = {**stack.auth_headers(), "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert "[DONE]" in text
    # A graceful stop flushes the batch exporter (the spans would otherwise leave within
    # its 5 s schedule).
    assert stack.stop_kvgate() == 0

    spans = {span.name: (resource, span) for resource, span in collector.spans}
    assert {"kvgate.decision", "kvgate.settlement"} <= set(spans)
    for name in ("kvgate.decision", "kvgate.settlement"):
        resource, span = spans[name]
        assert resource["service.name"] == "kvgate-e2e"
        assert span.trace_id.hex() == TRACE_ID
        assert span.parent_span_id.hex() == CLIENT_SPAN
        attrs = attributes(span.attributes)
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["kvgate.tenant"] == "demo"
    decision = attributes(spans["kvgate.decision"][1].attributes)
    settlement = attributes(spans["kvgate.settlement"][1].attributes)
    assert decision["kvgate.decision.outcome"] == "admitted"
    assert decision["gen_ai.request.max_tokens"] == 16
    assert decision["gen_ai.usage.input_tokens"] == settlement["gen_ai.usage.input_tokens"] > 0
    assert settlement["gen_ai.usage.output_tokens"] > 0
    assert settlement["kvgate.settlement.cause"] == "completed"
    assert settlement["kvgate.settlement.booked"] == "booked"
    [link] = spans["kvgate.settlement"][1].links
    assert link.span_id == spans["kvgate.decision"][1].span_id
