"""Split response path: the request-path stream hands off, the observability stream settles."""

from __future__ import annotations

import asyncio
import json

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvgate.extproc.handoff import HandoffRegistry
from tests.session.conftest import (
    SessionRig,
    body_msg,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    sse_events,
)

Mode = processing_mode_pb2.ProcessingMode
CHAT = {
    "model": "qwen2.5-demo",
    "messages": [{"role": "user", "content": "Tell me about KV caches."}],
    "max_tokens": 32,
    "stream": True,
}


def request_path_headers() -> pb.ProcessingRequest:
    message = headers_msg()
    # What Envoy sends on a stream's first message: this filter never sees the response.
    message.protocol_config.CopyFrom(
        pb.ProtocolConfiguration(request_body_mode=Mode.BUFFERED, response_body_mode=Mode.NONE)
    )
    return message


def observed(message: pb.ProcessingRequest, reservation_id: str) -> pb.ProcessingRequest:
    message.observability_mode = True
    meta = struct_pb2.Struct()
    meta.update({"reservation_id": reservation_id})
    message.metadata_context.filter_metadata["kvgate"].CopyFrom(meta)
    return message


def chunk(content: str) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "qwen2.5-demo",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }


async def send_only(rig: SessionRig, messages: list[pb.ProcessingRequest]) -> None:
    """Play an observability stream: Envoy sends without waiting and reads no replies."""

    async def requests():
        for message in messages:
            yield message

    call = rig.stub.Process(requests())
    replies = [reply async for reply in call]
    assert replies == []  # kvgate sends nothing back on an observability stream
    assert await call.code() == grpc.StatusCode.OK


async def admit_on_request_path(rig: SessionRig) -> str:
    stream = rig.stream()
    await stream.exchange(request_path_headers())
    reply = await stream.exchange(body_msg(CHAT))
    common = reply.request_body.response
    # No usage injection: an observability stream could not strip it from the client's view.
    assert not common.HasField("body_mutation")
    meta = reply.dynamic_metadata.fields["kvgate"].struct_value.fields
    await stream.half_close()
    assert await stream.call.code() == grpc.StatusCode.OK
    return meta["reservation_id"].string_value


async def test_observability_stream_settles_the_handed_off_reservation(rig: SessionRig) -> None:
    reservation_id = await admit_on_request_path(rig)
    # The request-path stream ended, but the request is still in flight: not settled.
    assert (await rig.in_flight())[1] == 1
    events = sse_events([chunk(" Hello"), chunk(" world"), "[DONE]"])
    await send_only(
        rig,
        [
            observed(headers_msg(), reservation_id),
            observed(response_headers_msg(), reservation_id),
            observed(response_body_msg(events[:20]), reservation_id),
            observed(response_body_msg(events[20:], end_of_stream=True), reservation_id),
        ],
    )
    assert await rig.in_flight() == (0, 0)
    requests, prompt, output = await rig.usage()
    prompt_expected = await rig.server.tokenizers.count_chat("qwen2.5-demo", CHAT["messages"])
    # No usage event (the client did not ask): output counted from the streamed text.
    assert (requests, prompt, output) == (1, prompt_expected, 2)


async def test_observed_disconnect_settles_with_what_was_streamed(rig: SessionRig) -> None:
    reservation_id = await admit_on_request_path(rig)
    await send_only(
        rig,
        [
            observed(response_headers_msg(), reservation_id),
            observed(response_body_msg(sse_events([chunk(" Hello")])), reservation_id),
        ],
    )
    assert await rig.in_flight() == (0, 0)
    assert (await rig.usage())[2] == 1


async def test_unclaimed_hand_off_is_settled_and_charges_nothing(rig: SessionRig) -> None:
    rig.server.services.handoffs = HandoffRegistry(claim_timeout_s=0.2)
    await admit_on_request_path(rig)
    assert (await rig.in_flight())[1] == 1
    await asyncio.sleep(0.4)
    assert await rig.in_flight() == (0, 0)
    assert await rig.usage() == (1, 0, 0)


async def test_observing_a_rejected_request_does_nothing(rig: SessionRig) -> None:
    stream = rig.stream()
    reply = await stream.exchange(headers_msg(key="sk-wrong"))
    assert reply.WhichOneof("response") == "immediate_response"
    message = headers_msg(key="sk-wrong")
    message.observability_mode = True
    await send_only(rig, [message, observed(response_headers_msg(401), "no-such-id")])
    assert await rig.in_flight() == (0, 0)
    assert json.loads(reply.immediate_response.body)["error"]["code"] == "invalid_api_key"
