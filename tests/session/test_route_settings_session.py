"""Per-route settings arrive as the ext_proc stream's gRPC metadata and decide at once."""

from __future__ import annotations

import json
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.session.conftest import SessionRig, body_msg, headers_msg

CHAT = {
    "model": "qwen2.5-demo",
    "messages": [{"role": "user", "content": "Name three uses of a route."}],
    "max_tokens": 32,
}


def error_of(reply: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    answer = reply.immediate_response
    return answer.status.code, json.loads(answer.body)["error"]


async def test_a_route_limited_to_other_models_refuses_before_admission(rig: SessionRig) -> None:
    stream = rig.stream([("x-kvgate-route", "small"), ("x-kvgate-route-models", "tiny")])
    reply = await stream.exchange(headers_msg())
    assert reply.WhichOneof("response") == "request_headers"
    status, error = error_of(await stream.exchange(body_msg(CHAT)))
    assert (status, error["code"]) == (404, "model_not_found")
    assert await rig.in_flight() == (0, 0)
    assert await rig.usage() == (0, 0, 0)


async def test_a_route_allowing_the_model_admits_and_names_itself(rig: SessionRig) -> None:
    stream = rig.stream(
        [("x-kvgate-route", "team-a"), ("x-kvgate-route-models", "qwen2.5-demo, tiny")]
    )
    await stream.exchange(headers_msg())
    reply = await stream.exchange(body_msg(CHAT))
    assert reply.WhichOneof("response") == "request_body"
    meta = reply.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert meta["route"].string_value == "team-a"
    stream.call.cancel()


async def test_a_route_for_other_tenants_refuses_the_key(rig: SessionRig) -> None:
    stream = rig.stream([("x-kvgate-route-tenants", "someone-else")])
    status, error = error_of(await stream.exchange(headers_msg()))
    assert (status, error["code"]) == (403, "tenant_not_allowed_on_route")
    # An invalid key still gets its 401 first: the route check needs a tenant.
    stream = rig.stream([("x-kvgate-route-tenants", "someone-else")])
    status, _ = error_of(await stream.exchange(headers_msg(key="sk-wrong")))
    assert status == 401


async def test_unusable_settings_fail_closed_naming_the_key(rig: SessionRig) -> None:
    stream = rig.stream([("x-kvgate-route-model", "qwen2.5-demo")])  # a typo
    status, error = error_of(await stream.exchange(headers_msg()))
    assert (status, error["code"]) == (500, "route_misconfigured")
    assert "x-kvgate-route-model" in error["message"]
    assert await rig.in_flight() == (0, 0)
