"""Odd client input through the real Envoy: a malformed kvgate-priority header is a 400
naming it (not kvgate's 500), and a client's traceparent names the trace kvgate's spans
join but not whether they are kept (kvgate's sample_ratio decides)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from testbed.harness import DEFAULT_MODEL_NAME, Stack
from tests.e2e.otlp import OtlpReceiver

CHAT = "/v1/chat/completions"
BODY = {
    "model": DEFAULT_MODEL_NAME,
    "messages": [{"role": "user", "content": "odd input"}],
    "max_tokens": 8,
}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/gRPC trace receiver on a free port, for one stack."""

    def __init__(self) -> None:
        from concurrent import futures

        self.receiver = OtlpReceiver()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.receiver, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def spans_of(self, trace_id: str) -> list[trace_pb2.Span]:
        return [span for _, span in self.receiver.spans if span.trace_id.hex() == trace_id]

    def stop(self) -> None:
        self.server.stop(0)


def traced_stack(
    collector: Collector, sample_ratio: float, monkeypatch: pytest.MonkeyPatch
) -> Stack:
    # Spans leave kvgate within 0.1 s instead of the batch exporter's 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    tracing = {
        "enabled": True,
        "otlp_endpoint": f"http://127.0.0.1:{collector.port}",
        "sample_ratio": sample_ratio,
    }
    return Stack(kvgate_overrides={"tracing": tracing})


@pytest.fixture(scope="module")
def module_monkeypatch() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def traced_all(module_monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Stack, Collector]]:
    """Every request traced (sample_ratio 1)."""
    collector = Collector()
    try:
        with traced_stack(collector, 1.0, module_monkeypatch) as running:
            yield running, collector
    finally:
        collector.stop()


def post(stack: Stack, headers: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}{CHAT}",
        json=BODY,
        headers={**stack.auth_headers(), **headers},
        timeout=30,
    )


@pytest.mark.parametrize(
    "value",
    [b"--5", b"---1", "\u00b2".encode(), "\u0663".encode(), b"+1", b"9" * 5000],
    ids=["double-minus", "triple-minus", "superscript-two", "arabic-indic-three", "plus", "huge"],
)
def test_a_malformed_priority_is_a_400_naming_the_header(
    traced_all: tuple[Stack, Collector], value: bytes
) -> None:
    stack, _ = traced_all
    answer = post(stack, {"kvgate-priority": value})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "kvgate-priority"
    assert error["code"] == "invalid_value"
    assert error["type"] == "invalid_request_error"
    assert "must be a whole number" in error["message"]
    # The same client, with a plain class it may use, is admitted and answered.
    assert post(stack, {"kvgate-priority": b"0"}).status_code == 200


def wait_for_spans(collector: Collector, trace_id: str, count: int) -> list[trace_pb2.Span]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = collector.spans_of(trace_id)
        if len(spans) >= count:
            return spans
        time.sleep(0.1)
    return collector.spans_of(trace_id)


def test_a_clients_unsampled_flag_does_not_hide_its_requests(
    traced_all: tuple[Stack, Collector],
) -> None:
    stack, collector = traced_all
    trace_id = "1" * 16 + CLIENT_TRACE_ID[16:]
    answer = post(stack, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-00"})
    assert answer.status_code == 200, answer.text
    # Exported at all: kept by kvgate's own decision, whatever the client's flag said.
    spans = wait_for_spans(collector, trace_id, 2)
    assert sorted(span.name for span in spans) == ["kvgate.decision", "kvgate.settlement"]
    for span in spans:
        # The client's trace and span are the parent: its own trace view correlates.
        assert span.parent_span_id.hex() == CLIENT_SPAN


def test_a_clients_sampled_flag_does_not_force_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvgate traces nothing (sample_ratio 0): a client's -01 changes nothing."""
    collector = Collector()
    try:
        with traced_stack(collector, 0.0, monkeypatch) as stack:
            for _ in range(3):
                answer = post(stack, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN}-01"})
                assert answer.status_code == 200, answer.text
            # A graceful stop flushes whatever kvgate recorded.
            assert stack.stop_kvgate() == 0
        assert collector.spans_of(CLIENT_TRACE_ID) == []
        assert collector.receiver.spans == []
    finally:
        collector.stop()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_is_refused_before_anything_is_reserved(
    traced_all: tuple[Stack, Collector], content_type: str
) -> None:
    """vLLM reads only application/json bodies: anything else is refused by kvgate, in the
    API's shape, before a reservation is made for a request the engine would refuse."""
    stack, _ = traced_all
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    arrived = len(records["requests"])
    answer = post(stack, {"content-type": content_type})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "content-type" and error["type"] == "invalid_request_error"
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    assert len(records["requests"]) == arrived
    assert post(stack, {"content-type": "application/json; charset=utf-8"}).status_code == 200
