"""The per-stream state machine, driven through a real gRPC channel like Envoy drives it."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from kvgate.extproc.handlers import BUFFERED_ANSWER_MAX_BYTES
from tests.session.conftest import (
    SessionRig,
    body_msg,
    header_values,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    sse_events,
)
from tests.session.support import CHAT, chunk, error_of, usage_event


async def expected_prompt_tokens(rig: SessionRig, body: dict) -> int:
    return await rig.server.tokenizers.count_chat(body["model"], body["messages"])


@pytest.mark.parametrize(("key", "code"), [(None, None), ("sk-wrong", "invalid_api_key")])
async def test_missing_or_unknown_key_is_401(
    rig: SessionRig, key: str | None, code: str | None
) -> None:
    stream = rig.stream()
    status, body, headers = error_of(await stream.exchange(headers_msg(key=key)))
    assert status == 401
    assert set(body["error"]) == {"message", "type", "code", "param"}
    assert body["error"]["code"] == code
    assert headers["content-type"] == "application/json"
    assert "sk-wrong" not in json.dumps(body)


async def test_models_listing_passes_with_auth_only(rig: SessionRig) -> None:
    stream = rig.stream()
    reply = await stream.exchange(
        headers_msg("/v1/models", "GET", end_of_stream=True, extra={"x-kvgate-backend": "evil"})
    )
    assert reply.WhichOneof("response") == "request_headers"
    mutation = reply.request_headers.response.header_mutation
    assert header_values(mutation) == {"x-kvgate-tenant": "acme"}
    assert "x-kvgate-backend" in mutation.remove_headers
    assert reply.HasField("mode_override")
    assert await rig.in_flight() == (0, 0)


async def test_streaming_chat_is_admitted_rewritten_and_settled(rig: SessionRig) -> None:
    body = dict(CHAT, stream=True)
    prompt = await expected_prompt_tokens(rig, body)
    stream = rig.stream()
    reply = await stream.exchange(headers_msg())
    assert header_values(reply.request_headers.response.header_mutation) == {
        "x-kvgate-tenant": "acme"
    }
    reply = await stream.exchange(body_msg(body))
    common = reply.request_body.response
    routed = header_values(common.header_mutation)
    assert routed["x-kvgate-backend"] == "gpu-a"
    assert routed["x-kvgate-model"] == "qwen2.5-demo"
    assert common.clear_route_cache
    forwarded = json.loads(common.body_mutation.body)
    assert forwarded["stream_options"] == {"include_usage": True}
    assert routed["content-length"] == str(len(common.body_mutation.body))
    meta = reply.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert meta["prompt_tokens"].number_value == prompt
    # prompt + 64, rounded up to 16-token blocks
    reserved = -(-(prompt + 64) // 16) * 16
    assert meta["reserved_tokens"].number_value == reserved
    assert await rig.in_flight() == (reserved, 1)

    await stream.exchange(response_headers_msg())
    stream_bytes = sse_events(
        [
            chunk(role=True),
            chunk(" Tokens"),
            chunk(" rest", finish="stop"),
            usage_event(prompt, 2),
            "[DONE]",
        ]
    )
    split = len(stream_bytes) // 2
    first = await stream.exchange(response_body_msg(stream_bytes[:split]))
    last = await stream.exchange(response_body_msg(stream_bytes[split:], end_of_stream=True))
    client_saw = b""
    for part, reply in ((stream_bytes[:split], first), (stream_bytes[split:], last)):
        mutation = reply.response_body.response.body_mutation
        client_saw += (
            mutation.body if mutation.HasField("body") else (b"" if mutation.clear_body else part)
        )
    # The client never asked for usage, so it never sees the usage event.
    assert b'"choices":[]' not in client_saw
    assert client_saw.endswith(b"data: [DONE]\n\n")
    assert await rig.in_flight() == (0, 0)
    assert await rig.usage() == (1, prompt, 2)
    out_meta = last.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert out_meta["output_tokens"].number_value == 2


async def test_client_asking_for_usage_keeps_it(rig: SessionRig) -> None:
    body = dict(CHAT, stream=True, stream_options={"include_usage": True})
    stream = rig.stream()
    await stream.exchange(headers_msg())
    reply = await stream.exchange(body_msg(body))
    assert not reply.request_body.response.HasField("body_mutation")
    await stream.exchange(response_headers_msg())
    events = sse_events([chunk(role=True), usage_event(10, 0), "[DONE]"])
    reply = await stream.exchange(response_body_msg(events, end_of_stream=True))
    assert not reply.response_body.response.HasField("body_mutation")


async def test_non_streaming_usage_is_read_from_the_json_body(rig: SessionRig) -> None:
    stream = rig.stream()
    await stream.exchange(headers_msg())
    await stream.exchange(body_msg(CHAT))
    await stream.exchange(response_headers_msg(content_type="application/json"))
    payload = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [],
            "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
        }
    ).encode()
    await stream.exchange(response_body_msg(payload[:10]))
    await stream.exchange(response_body_msg(payload[10:], end_of_stream=True))
    assert await rig.usage() == (1, 21, 9)
    assert await rig.in_flight() == (0, 0)


_Mode = processing_mode_pb2.ProcessingMode


@pytest.mark.parametrize(
    ("content_type", "content_length", "buffered"),
    [
        ("application/json", "2048", True),
        ("application/json; charset=utf-8", str(BUFFERED_ANSWER_MAX_BYTES), True),
        ("application/json", str(BUFFERED_ANSWER_MAX_BYTES + 1), False),  # over Envoy's care
        ("application/json", None, False),  # unsized: may be larger than the buffer limit
        ("application/json", "\u00b2", False),  # a Unicode digit is not a length
        ("text/event-stream", "2048", False),  # streams are read chunk by chunk
    ],
)
async def test_small_json_answers_come_in_one_message(
    rig: SessionRig, content_type: str, content_length: str | None, buffered: bool
) -> None:
    """The reply to the answer's headers asks Envoy for a sized JSON body in one BUFFERED
    message; everything else stays STREAMED, and the answer is settled either way."""
    stream = rig.stream()
    await stream.exchange(headers_msg())
    await stream.exchange(body_msg(CHAT))
    extra = {"content-length": content_length} if content_length is not None else {}
    reply = await stream.exchange(response_headers_msg(200, content_type, extra))
    assert reply.HasField("mode_override") == buffered
    if buffered:
        mode = reply.mode_override
        assert mode.response_body_mode == _Mode.BUFFERED
        assert (mode.request_trailer_mode, mode.response_trailer_mode) == (_Mode.SKIP, _Mode.SKIP)
    payload = json.dumps(
        {"choices": [], "usage": {"prompt_tokens": 21, "completion_tokens": 9}}
    ).encode()
    if content_type.startswith("text/event-stream"):
        payload = sse_events([usage_event(21, 9), "[DONE]"])
    await stream.exchange(response_body_msg(payload, end_of_stream=True))
    assert await rig.usage() == (1, 21, 9)
    assert await rig.in_flight() == (0, 0)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, None),
        ({"model": "qwen2.5-demo", "messages": []}, 400, None),
        (
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "model_not_found",
        ),
        (dict(CHAT, max_tokens=40_000), 400, "context_length_exceeded"),
    ],
)
async def test_bad_requests_get_openai_errors(
    rig: SessionRig, body: bytes | dict, status: int, code: str | None
) -> None:
    stream = rig.stream()
    await stream.exchange(headers_msg())
    got_status, error, _ = error_of(await stream.exchange(body_msg(body)))
    assert got_status == status
    assert set(error["error"]) == {"message", "type", "code", "param"}
    if code:
        assert error["error"]["code"] == code
    assert await rig.in_flight() == (0, 0)


async def test_kv_exhaustion_is_429_with_retry_after(rig_factory) -> None:
    async for rig in rig_factory(kv_budget_tokens=400):
        holder = rig.stream()
        await holder.exchange(headers_msg())
        admitted = await holder.exchange(body_msg(dict(CHAT, max_tokens=300)))
        assert admitted.WhichOneof("response") == "request_body"
        second = rig.stream()
        await second.exchange(headers_msg())
        status, error, headers = error_of(
            await second.exchange(body_msg(dict(CHAT, max_tokens=300)))
        )
        assert status == 429
        assert error["error"]["code"] == "kv_budget_exhausted"
        assert int(headers["retry-after"]) >= 1
        # Too big for the whole backend: waiting cannot help, so 400 and no Retry-After.
        third = rig.stream()
        await third.exchange(headers_msg())
        status, error, headers = error_of(
            await third.exchange(body_msg(dict(CHAT, max_tokens=500)))
        )
        assert status == 400 and "retry-after" not in headers
        holder.reset()
        assert await rig.in_flight_after_reset() == (0, 0)


@pytest.mark.parametrize("how", ["reset", "half_close"])
@pytest.mark.parametrize("phase", ["after_headers", "after_admission", "mid_response"])
async def test_disconnect_at_every_phase_settles_once(
    rig: SessionRig, how: str, phase: str
) -> None:
    body = dict(CHAT, stream=True)
    prompt = await expected_prompt_tokens(rig, body)
    stream = rig.stream()
    await stream.exchange(headers_msg())
    if phase != "after_headers":
        await stream.exchange(body_msg(body))
        assert (await rig.in_flight())[1] == 1
    if phase == "mid_response":
        await stream.exchange(response_headers_msg())
        await stream.exchange(
            response_body_msg(sse_events([chunk(role=True), chunk(" Hello"), chunk(" world")]))
        )
    if how == "reset":
        stream.reset()
    else:
        await stream.half_close()
        assert await stream.call.code() == grpc.StatusCode.OK
    assert await rig.in_flight_after_reset() == (0, 0)
    requests, prompt_seen, output_seen = await rig.usage()
    if phase == "after_headers":
        assert requests == 0
    elif phase == "after_admission":
        # Cut before any answer reached the client: settled, but nothing is charged, so a
        # retry is not paid for twice.
        assert (requests, prompt_seen, output_seen) == (1, 0, 0)
    else:
        # " Hello world" is two tokens in this vocabulary; they were streamed, so they count.
        assert (requests, prompt_seen, output_seen) == (1, prompt, 2)
    disconnects = rig.server.metrics.stream_disconnects
    total = sum(
        s.value for m in disconnects.collect() for s in m.samples if s.name.endswith("_total")
    )
    assert total == (0 if phase == "after_headers" else 1)


async def test_counting_metrics(rig: SessionRig) -> None:
    """The engine per model and the segment cache are exported: a resent long prompt is a
    cache hit."""
    from prometheus_client import generate_latest

    long_chat = dict(CHAT, messages=[{"role": "user", "content": "Explain the KV cache. " * 20}])
    for _ in range(2):
        stream = rig.stream()
        await stream.exchange(headers_msg())
        reply = await stream.exchange(body_msg(long_chat))
        assert reply.WhichOneof("response") == "request_body"
        stream.reset()
    text = generate_latest(rig.server.metrics.registry).decode()
    assert 'kvgate_counting_engine_info{engine="compiled-bpe",model="qwen2.5-demo"} 1.0' in text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("kvgate_prompt_segment_cache")
    }
    assert samples["kvgate_prompt_segment_cache_hits_total"] >= 1
    assert samples["kvgate_prompt_segment_cache_misses_total"] >= 1
    assert samples["kvgate_prompt_segment_cache_entries"] >= 1


async def test_a_second_request_head_on_one_stream_is_not_taken(rig: SessionRig) -> None:
    """Envoy sends one request head per stream; a second one (another path, another key)
    changes nothing: the body is decided as the first head said, and settles once."""
    stream = rig.stream()
    await stream.exchange(headers_msg())
    again = await stream.exchange(headers_msg("/v1/models", "GET", key="sk-other"))
    assert again.WhichOneof("response") == "request_headers"
    assert not again.request_headers.response.HasField("header_mutation")
    reply = await stream.exchange(body_msg(CHAT))
    assert reply.WhichOneof("response") == "request_body"
    assert (await rig.in_flight())[1] == 1
    await stream.exchange(response_headers_msg(content_type="application/json"))
    answer = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    await stream.exchange(response_body_msg(json.dumps(answer).encode(), end_of_stream=True))
    assert await rig.in_flight() == (0, 0)
    assert await rig.usage() == (1, 5, 2)
