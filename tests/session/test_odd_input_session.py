"""Odd values in the headers kvgate reads: each is a clear OpenAI-shaped 4xx naming what
was wrong, never an internal error."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import get_current_span

from kvgate.config.model import TracingConfig
from kvgate.tracing import Tracing
from tests.session.conftest import SessionRig, _rig, body_msg, headers_msg, make_config
from tests.session.support import CHAT, error_of, run_stream, traced_rig

PRIORITY_HEADER = "kvgate-priority"


@pytest.fixture
async def priority_rig() -> AsyncIterator[SessionRig]:
    """The tenant's own class is 0; it may also ask for 5 and -1."""
    config = make_config()
    config["tenants"][0]["allowed_priorities"] = [5, -1]
    async for rig in _rig(config):
        yield rig


@pytest.mark.parametrize(
    "value",
    [
        "--5",
        "---1",
        "-",
        "",
        "\u00b2",  # superscript two: str.isdigit() says yes, int() refuses it
        "\u0663",  # Arabic-Indic three: int() reads it as 3
        "\uff15",  # fullwidth five
        "+5",
        "5_0",
        "5.0",
        "0x5",
        "5 5",
        "1" * 5000,  # past int()'s digit limit
        "99999999999999999999",
        "5\n",
    ],
)
async def test_a_malformed_priority_is_a_400_naming_the_header(
    priority_rig: SessionRig, value: str
) -> None:
    stream = priority_rig.stream()
    status, body, headers = error_of(
        await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value}))
    )
    assert status == 400
    assert body["error"]["param"] == PRIORITY_HEADER
    assert body["error"]["code"] == "invalid_value"
    assert body["error"]["type"] == "invalid_request_error"
    assert "allowed for this key: -1, 0, 5" in body["error"]["message"]
    assert headers["content-type"] == "application/json"
    assert priority_rig.server.metrics.internal_errors.labels("request_headers")._value.get() == 0


@pytest.mark.parametrize("value", ["5", " 5 ", "\t-1", "-1", "0", "-0", "005"])
async def test_a_plain_allowed_priority_is_admitted(priority_rig: SessionRig, value: str) -> None:
    stream = priority_rig.stream()
    reply = await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value}))
    assert reply.WhichOneof("response") == "request_headers"
    reply = await stream.exchange(body_msg(CHAT))
    assert reply.WhichOneof("response") == "request_body"
    stream.reset()
    assert await priority_rig.in_flight_after_reset() == (0, 0)


@pytest.mark.parametrize("value", ["7", "-100", "100"])
async def test_a_well_formed_class_the_key_may_not_use_is_a_400(
    priority_rig: SessionRig, value: str
) -> None:
    stream = priority_rig.stream()
    status, body, _ = error_of(await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value})))
    assert status == 400
    assert body["error"]["param"] == PRIORITY_HEADER
    assert "may not use (allowed: -1, 0, 5)" in body["error"]["message"]


# --------------------------------------------------------------------------- trace flags

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def traceparent(flags: str) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-{flags}"}


async def test_a_clients_sampled_flag_does_not_switch_tracing_on() -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter, sample_ratio=0.0):
        await run_stream(rig, traceparent("01"))
    assert exporter.get_finished_spans() == ()


async def test_a_clients_unsampled_flag_does_not_hide_from_tracing() -> None:
    """The trace id and parent span are kept (the spans join the client's trace); only the
    keep-or-drop decision is kvgate's."""
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter, sample_ratio=1.0):
        await run_stream(rig, traceparent("00"))
    spans = exporter.get_finished_spans()
    assert {span.name for span in spans} == {"kvgate.decision", "kvgate.settlement"}
    for span in spans:
        assert span.context.trace_id == int(TRACE_ID, 16)
        assert span.context.trace_flags.sampled
        assert span.parent is not None and span.parent.span_id == int(CLIENT_SPAN, 16)


@pytest.mark.parametrize(("flags", "ratio", "kept"), [("01", 0.0, True), ("00", 1.0, False)])
async def test_trusted_parent_sampling_follows_the_flag(
    flags: str, ratio: float, kept: bool
) -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter, sample_ratio=ratio, trust_parent_sampling=True):
        await run_stream(rig, traceparent(flags))
    assert len(exporter.get_finished_spans()) == (2 if kept else 0)


@pytest.mark.parametrize(
    "value", ["garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01", ""]
)
async def test_a_malformed_traceparent_starts_kvgates_own_trace(value: str) -> None:
    exporter = InMemorySpanExporter()
    async for rig in traced_rig(exporter):
        await run_stream(rig, {"traceparent": value})
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    assert len({span.context.trace_id for span in spans}) == 1
    assert all(span.context.trace_id != int(TRACE_ID, 16) for span in spans)


@pytest.mark.parametrize(("draw", "sampled"), [(0.24, True), (0.26, False)])
def test_kvgates_own_draw_decides_whatever_the_trace_id(draw: float, sampled: bool) -> None:
    """A trace id whose low bits TraceIdRatioBased would always keep does not help either."""
    tracing = Tracing(
        TracingConfig(enabled=True, sample_ratio=0.25),
        exporter=InMemorySpanExporter(),
        draw=lambda: draw,
    )
    try:
        for trace_id in (TRACE_ID, "0" * 31 + "1", "f" * 32):
            parent = tracing.extract({"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
            assert parent is not None
            span = get_current_span(parent).get_span_context()
            assert span.trace_id == int(trace_id, 16)
            assert span.span_id == int(CLIENT_SPAN, 16)
            assert span.trace_flags.sampled is sampled
    finally:
        tracing.shutdown()


# --------------------------------------------------------------------------- body fields

COMPLETION = {"model": "qwen2.5-demo", "prompt": "Say hi", "max_tokens": 8}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"model": 5}, "model"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"max_tokens": "16"}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"stream": "true"}, "stream"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"temperature": True}, "temperature"),
        ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        ("/v1/chat/completions", {"tools": {"type": "function"}}, "tools"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {"tools": [{"function": 5}]}, "tools[0].function"),
        ("/v1/chat/completions", {"tools": [{"function": {}}]}, "tools[0].function.name"),
        (
            "/v1/chat/completions",
            {"tools": [{"function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        ("/v1/chat/completions", {"tools": [{"type": 3}]}, "tools[0].type"),
        ("/v1/completions", {"prompt": [1.5]}, "prompt[0]"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"logprobs": "5"}, "logprobs"),
        ("/v1/completions", {"temperature": [0]}, "temperature"),
    ],
)
async def test_a_bad_body_field_is_a_400_naming_it(
    rig: SessionRig, path: str, fields: dict[str, object], param: str
) -> None:
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    stream = rig.stream()
    await stream.exchange(headers_msg(path))
    status, body, _ = error_of(await stream.exchange(body_msg({**base, **fields})))
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error"
    assert await rig.in_flight() == (0, 0)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"temperature": 0, "logprobs": True, "top_logprobs": 20}),
        ("/v1/chat/completions", {"temperature": 1.7, "logprobs": None, "top_logprobs": None}),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        ),
        ("/v1/completions", {"logprobs": 5, "temperature": 0.0}),
        ("/v1/completions", {"logprobs": -1}),
    ],
)
async def test_well_typed_sampling_fields_and_tools_are_admitted(
    rig: SessionRig, path: str, fields: dict[str, object]
) -> None:
    base = CHAT if path == "/v1/chat/completions" else COMPLETION
    stream = rig.stream()
    await stream.exchange(headers_msg(path))
    reply = await stream.exchange(body_msg({**base, **fields}))
    assert reply.WhichOneof("response") == "request_body"
    stream.reset()
    assert await rig.in_flight_after_reset() == (0, 0)


# --------------------------------------------------------------------------- method, body type


@pytest.mark.parametrize("method", ["post", "Post"])
async def test_a_method_is_case_sensitive(priority_rig: SessionRig, method: str) -> None:
    """RFC 9110: "post" is not POST (vLLM answers 405), so it is never admitted."""
    stream = priority_rig.stream()
    status, body, _ = error_of(await stream.exchange(headers_msg(method=method)))
    assert status == 405
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content_type", "admitted"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("application/vnd.api+json", False),  # vLLM takes application/json only
        ("multipart/form-data; boundary=x", False),
    ],
)
async def test_only_a_json_body_is_admitted(
    priority_rig: SessionRig, content_type: str, admitted: bool
) -> None:
    stream = priority_rig.stream()
    reply = await stream.exchange(headers_msg(extra={"content-type": content_type}))
    if not admitted:
        status, body, _ = error_of(reply)
        assert status == 400 and body["error"]["param"] == "content-type"
        return
    assert reply.WhichOneof("response") == "request_headers"
    reply = await stream.exchange(body_msg(CHAT))
    assert reply.WhichOneof("response") == "request_body"
    stream.reset()
    assert await priority_rig.in_flight_after_reset() == (0, 0)
