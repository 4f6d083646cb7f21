"""Meter holes at the session level: the ext_proc message orders a hostile client can cause."""

from __future__ import annotations

from tests.session.conftest import (
    SessionRig,
    body_msg,
    header_values,
    headers_msg,
    response_body_msg,
    response_headers_msg,
    sse_events,
)
from tests.session.support import CHAT, chunk


async def test_body_without_end_of_stream_is_the_admission_point(rig: SessionRig) -> None:
    """With HTTP/2 request trailers Envoy sends the BUFFERED body with end_of_stream=false.
    It must be admitted (reserved, routed) right there, never passed on bare."""
    stream = rig.stream()
    await stream.exchange(headers_msg())
    reply = await stream.exchange(body_msg(CHAT, end_of_stream=False))
    assert reply.WhichOneof("response") == "request_body"
    routed = header_values(reply.request_body.response.header_mutation)
    assert routed["x-kvgate-backend"] == "gpu-a"
    assert (await rig.in_flight())[1] == 1
    stream.reset()
    assert await rig.in_flight_after_reset() == (0, 0)


async def test_credentials_are_removed_on_the_way_upstream(rig: SessionRig) -> None:
    stream = rig.stream()
    reply = await stream.exchange(headers_msg(extra={"x-api-key": "sk-also-sent"}))
    removed = set(reply.request_headers.response.header_mutation.remove_headers)
    assert {"authorization", "x-api-key"} <= removed
    stream.reset()


async def test_settles_although_a_reload_removed_the_model(rig: SessionRig) -> None:
    """The model that served the request is gone from the tokenizer registry by the time
    the answer ends (a reload removed it): the settlement still lands, at least one token
    per content event. Before, counting raised KeyError, the settlement task died and the
    lease stayed held."""
    stream = rig.stream()
    await stream.exchange(headers_msg())
    await stream.exchange(body_msg({**CHAT, "stream": True}))
    await stream.exchange(response_headers_msg())
    rig.server.tokenizers.unregister("qwen2.5-demo")
    events = sse_events([chunk(" one"), chunk(" two"), chunk(" three"), "[DONE]"])
    await stream.exchange(response_body_msg(events, end_of_stream=True))
    assert await rig.in_flight() == (0, 0)
    requests, _, output = await rig.usage()
    assert (requests, output) == (1, 3)
