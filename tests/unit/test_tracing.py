"""Traces (kvgate.tracing): off means nothing is built; on, a decision and a settlement span
with the gen_ai.* attributes, joined to the trace named by the request's traceparent."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import kvgate.tracing as tracing_module
from kvgate.config import ConfigError, parse_config
from kvgate.config.model import TracingConfig
from kvgate.lifecycle import ResponseReading, Ticket
from kvgate.openai import parse_request
from kvgate.policy import ActualUsage, SettleCause
from kvgate.tracing import Tracing, build_tracing
from tests.lifecycle.conftest import MODEL, Lifecycle, config, make_lifecycle

CHAT = "/v1/chat/completions"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def chat_body(**fields: Any) -> bytes:
    import json

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **fields}
    return json.dumps(body).encode()


class Traced:
    def __init__(self, life: Lifecycle, exporter: InMemorySpanExporter, tracing: Tracing) -> None:
        self.life = life
        self.exporter = exporter
        self.tracing = tracing

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    async def admit(self, request_id: str = "req-1", **fields: Any) -> Ticket:
        request = parse_request(CHAT, chat_body(**fields))
        policy = self.life.snapshots.current.tenants["acme"]
        return await self.life.admission().admit(request, policy, request_id, f"{request_id}/x")

    def decide(self, ticket: Ticket, headers: dict[str, str], start_ns: int = 1) -> None:
        self.tracing.decision(
            self.tracing.extract(headers),
            start_ns,
            request_id=ticket.request_id,
            outcome="admitted",
            reason="admitted",
            tenant=ticket.tenant,
            request=ticket.request,
            ticket=ticket,
        )

    async def settle(self, ticket: Ticket, usage: ActualUsage) -> None:
        reading = ResponseReading(accepted=True, streamed=False, usage=usage)
        _, task = self.life.settler.settle(ticket, SettleCause.COMPLETED, reading)
        await task


async def traced_lifecycle(**tracing: Any) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    tracer = build_tracing(TracingConfig(enabled=True, **tracing), exporter=exporter)
    assert tracer is not None
    async for life in make_lifecycle():
        life.settler.tracing = tracer
        yield Traced(life, exporter, tracer)
    tracer.shutdown()


@pytest.fixture
async def traced() -> AsyncIterator[Traced]:
    async for value in traced_lifecycle():
        yield value


# ---------------------------------------------------------------------- configuration


def test_tracing_is_off_by_default_and_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def factory(*args: Any, **kwargs: Any) -> Tracing:
        raise AssertionError("no tracer may be built when tracing is off")

    monkeypatch.setattr(tracing_module, "Tracing", factory)
    loaded = parse_config(config())
    assert loaded.tracing == TracingConfig()
    assert not loaded.tracing.enabled and not loaded.tracing.tenant_attribute
    assert loaded.tracing.otlp_endpoint is None and loaded.tracing.sample_ratio == 1.0
    assert build_tracing(loaded.tracing) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("otlp_endpoint", "collector:4317"),
        ("sample_ratio", 1.5),
        ("service_name", ""),
        ("exporter", "zipkin"),
    ],
)
def test_bad_tracing_settings_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"tracing.{field}"):
        parse_config({**config(), "tracing": {"enabled": True, field: value}})


def test_enabled_without_the_extra_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import` raise ImportError, as when not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError) as caught:
        build_tracing(TracingConfig(enabled=True))
    message = str(caught.value)
    assert "tracing.enabled" in message and "kvgate[otel]" in message


def test_otlp_exporter_is_built_for_the_endpoint() -> None:
    tracer = build_tracing(
        TracingConfig(enabled=True, otlp_endpoint="http://127.0.0.1:1", service_name="gw-a")
    )
    assert tracer is not None
    try:
        assert tracer.provider.resource.attributes["service.name"] == "gw-a"
    finally:
        tracer.shutdown()  # nothing recorded: nothing to send


# ---------------------------------------------------------------------- spans


async def test_decision_and_settlement_spans_join_the_trace_parent(traced: Traced) -> None:
    ticket = await traced.admit(max_tokens=20, stream=True)
    traced.decide(ticket, {"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 7))

    [decision] = traced.spans("kvgate.decision")
    assert decision.kind is SpanKind.INTERNAL
    assert decision.context.trace_id == int(TRACE_ID, 16)
    assert decision.parent is not None and decision.parent.span_id == int(PARENT_ID, 16)
    assert decision.parent.is_remote
    assert decision.context.trace_state.get("vendor") == "1"
    attrs = dict(decision.attributes or {})
    assert attrs == {
        "gen_ai.provider.name": "openai",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 20,
        "gen_ai.usage.input_tokens": ticket.prompt_tokens,
        "kvgate.decision.outcome": "admitted",
        "kvgate.decision.reason": "admitted",
        "kvgate.request_id": "req-1",
        "kvgate.model": MODEL,
        "kvgate.backend": "gpu",
        "kvgate.reserved_tokens": ticket.reservation.kv_tokens,
    }
    assert "kvgate.tenant" not in attrs  # only when the operator enables it

    [settlement] = traced.spans("kvgate.settlement")
    assert settlement.context.trace_id == int(TRACE_ID, 16)
    assert settlement.parent is not None and settlement.parent.span_id == int(PARENT_ID, 16)
    assert [link.context.span_id for link in settlement.links] == [decision.context.span_id]
    attrs = dict(settlement.attributes or {})
    cost = ticket.pricing.cost(ticket.prompt_tokens, 7, 0)
    assert attrs == {
        "gen_ai.provider.name": "openai",
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.usage.input_tokens": ticket.prompt_tokens,
        "gen_ai.usage.output_tokens": 7,
        "kvgate.settlement.cause": "completed",
        "kvgate.settlement.metered": True,
        "kvgate.settlement.booked": "booked",
        "kvgate.cost_usd": pytest.approx(cost / 10**12),
        "kvgate.backend": "gpu",
        "kvgate.reserved_tokens": ticket.reservation.kv_tokens,
        "kvgate.request_id": "req-1",
    }
    assert attrs["kvgate.cost_usd"] > 0
    assert settlement.status.status_code is StatusCode.UNSET
    assert settlement.start_time is not None and settlement.end_time is not None
    assert settlement.start_time <= settlement.end_time


async def test_without_a_traceparent_the_decision_roots_the_trace(traced: Traced) -> None:
    ticket = await traced.admit()
    traced.decide(ticket, {})
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
    [decision] = traced.spans("kvgate.decision")
    [settlement] = traced.spans("kvgate.settlement")
    assert decision.parent is None
    assert settlement.context.trace_id == decision.context.trace_id
    assert settlement.parent is not None
    assert settlement.parent.span_id == decision.context.span_id


async def test_completions_and_cached_tokens(traced: Traced) -> None:
    request = parse_request("/v1/completions", b'{"model": "qwen2.5-demo", "prompt": "hi"}')
    policy = traced.life.snapshots.current.tenants["acme"]
    ticket = await traced.life.admission().admit(request, policy, "req-2", "req-2/x")
    traced.decide(ticket, {"traceparent": TRACEPARENT})
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 3, cached_tokens=2))
    [decision] = traced.spans("kvgate.decision")
    [settlement] = traced.spans("kvgate.settlement")
    assert decision.attributes is not None and settlement.attributes is not None
    assert decision.attributes["gen_ai.operation.name"] == "text_completion"
    assert settlement.attributes["gen_ai.operation.name"] == "text_completion"
    assert settlement.attributes["gen_ai.usage.cache_read.input_tokens"] == 2


async def test_tenant_attribute_when_enabled() -> None:
    async for traced in traced_lifecycle(tenant_attribute=True):
        ticket = await traced.admit()
        traced.decide(ticket, {"traceparent": TRACEPARENT})
        await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
        for name in ("kvgate.decision", "kvgate.settlement"):
            [span] = traced.spans(name)
            assert span.attributes is not None and span.attributes["kvgate.tenant"] == "acme"


async def test_rejections_and_failures() -> None:
    async for traced in traced_lifecycle(tenant_attribute=True):
        request = parse_request(CHAT, chat_body(max_tokens=5))
        for reason in ("tpm_exceeded", "decision_timeout"):
            traced.tracing.decision(
                traced.tracing.extract({"traceparent": TRACEPARENT}),
                1,
                request_id="req-3",
                outcome="rejected",
                reason=reason,
                tenant="acme",
                request=request,
                ticket=None,
            )
        limit, timeout = traced.spans("kvgate.decision")
        assert limit.attributes is not None
        assert limit.attributes["kvgate.decision.outcome"] == "rejected"
        assert limit.attributes["kvgate.decision.reason"] == "tpm_exceeded"
        assert limit.attributes["gen_ai.request.max_tokens"] == 5
        assert limit.attributes["kvgate.tenant"] == "acme"
        assert "gen_ai.usage.input_tokens" not in limit.attributes
        assert limit.status.status_code is StatusCode.UNSET  # a policy answer, not a failure
        assert timeout.status.status_code is StatusCode.ERROR
        assert timeout.attributes is not None
        assert timeout.attributes["error.type"] == "decision_timeout"
        # A rejection leaves nothing waiting for a settlement.
        assert traced.tracing._pending == {}


async def test_store_failure_marks_the_settlement_span(
    traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticket = await traced.admit()
    traced.decide(ticket, {})

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("store down")

    monkeypatch.setattr(traced.life.store, "settle", broken)
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
    [settlement] = traced.spans("kvgate.settlement")
    assert settlement.attributes is not None
    assert settlement.attributes["kvgate.settlement.booked"] == "failed"
    assert settlement.status.status_code is StatusCode.ERROR


async def test_settling_twice_records_the_duplicate(traced: Traced) -> None:
    ticket = await traced.admit()
    traced.decide(ticket, {})
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
    await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
    first, second = traced.spans("kvgate.settlement")
    assert first.attributes is not None and second.attributes is not None
    assert (
        first.attributes["kvgate.settlement.booked"],
        second.attributes["kvgate.settlement.booked"],
    ) == (
        "booked",
        "duplicate",
    )


@pytest.mark.parametrize(
    ("ratio", "traceparent", "trusted", "recorded"),
    [
        (0.0, None, False, False),  # kvgate's own traces: sampled by the ratio
        (1.0, None, False, True),
        (0.0, TRACEPARENT, False, False),  # a parent's flag is a client's say: the ratio decides
        (1.0, f"00-{TRACE_ID}-{PARENT_ID}-00", False, True),
        (0.0, TRACEPARENT, True, True),  # trust_parent_sampling: the flag is followed
        (1.0, f"00-{TRACE_ID}-{PARENT_ID}-00", True, False),
    ],
)
async def test_sampling(
    ratio: float, traceparent: str | None, trusted: bool, recorded: bool
) -> None:
    async for traced in traced_lifecycle(sample_ratio=ratio, trust_parent_sampling=trusted):
        ticket = await traced.admit()
        traced.decide(ticket, {"traceparent": traceparent} if traceparent else {})
        await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
        names = sorted(s.name for s in traced.exporter.get_finished_spans())
        assert names == (["kvgate.decision", "kvgate.settlement"] if recorded else [])


async def test_pending_settlements_are_bounded(
    traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracing_module, "MAX_PENDING", 2)
    tickets = [await traced.admit(f"req-{i}") for i in range(3)]
    for ticket in tickets:
        traced.decide(ticket, {})
    assert list(traced.tracing._pending) == [t.reservation.reservation_id for t in tickets[1:]]
    for ticket in tickets:
        await traced.settle(ticket, ActualUsage(ticket.prompt_tokens, 1))
    assert traced.tracing._pending == {}


async def test_settler_without_tracing_records_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tracing is off")

    monkeypatch.setattr(Tracing, "settlement", never)
    monkeypatch.setattr(Tracing, "decision", never)
    async for life in make_lifecycle():
        assert life.settler.tracing is None
        request = parse_request(CHAT, chat_body())
        ticket = await life.admission().admit(
            request, life.snapshots.current.tenants["acme"], "r", "r/x"
        )
        reading = ResponseReading(accepted=True, streamed=False, usage=ActualUsage(3, 1))
        _, task = life.settler.settle(ticket, SettleCause.COMPLETED, reading)
        await task


def test_shadowed_otel_modules_are_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """xds-protos' older copy of an opentelemetry-proto module (installed after it) shows up
    as an ImportError from that module: kvgate says so, and how to repair the install."""
    import kvgate.tracing as tracing_module

    def overwritten(*args: object, **kwargs: object) -> None:
        raise ImportError(
            "cannot import name 'InstrumentationScope'",
            name="opentelemetry.proto.common.v1.common_pb2",
        )

    monkeypatch.setattr(tracing_module, "Tracing", overwritten)
    with pytest.raises(ConfigError) as caught:
        build_tracing(TracingConfig(enabled=True))
    message = str(caught.value)
    assert "xds-protos" in message and "--force-reinstall opentelemetry-proto" in message
