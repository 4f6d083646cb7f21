"""Hot reload: a good config applies without dropping streams; a bad one keeps the old."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import yaml

from kvgate.app import KvgateServer
from kvgate.config import hash_api_key, load_config
from tests.session.conftest import (
    SessionRig,
    body_msg,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
)

CHAT = {"model": "qwen2.5-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def metric(server: KvgateServer, result: str) -> float:
    return sum(
        s.value
        for m in server.metrics.config_reloads.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["result"] == result
    )


async def test_reload_applies_atomically_and_keeps_streams(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    config = make_config()
    path.write_text(yaml.safe_dump(config))
    server = KvgateServer(load_config(path), path)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    rig = SessionRig(server, channel)
    try:
        # A stream admitted under the old config...
        held = rig.stream()
        await held.exchange(headers_msg())
        admitted = await held.exchange(body_msg(CHAT))
        assert admitted.WhichOneof("response") == "request_body"

        # ...then a new tenant and a smaller KV budget arrive.
        config["tenants"].append({"name": "newco", "api_key_sha256": hash_api_key("sk-new")})
        config["backends"][0]["kv_budget_tokens"] = 32_000
        path.write_text(yaml.safe_dump(config))
        assert server.reloader is not None
        assert await server.reloader.reload("test")
        assert server.snapshots.current.backends["gpu-a"].kv_budget_tokens == 32_000
        assert metric(server, "success") == 1

        newcomer = rig.stream()
        reply = await newcomer.exchange(headers_msg(key="sk-new"))
        assert reply.WhichOneof("response") == "request_headers"

        # The old stream finishes and settles normally.
        await held.exchange(response_headers_msg(content_type="application/json"))
        payload = json.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 3}}).encode()
        await held.exchange(response_body_msg(payload, end_of_stream=True))
        assert await rig.in_flight() == (0, 0)
        assert await rig.usage() == (1, 9, 3)

        # A broken config is refused; the previous one keeps serving.
        path.write_text("tenants: [ {name: x, api_key_sha256: not-a-hash} ]\nmodels: []\n")
        assert not await server.reloader.reload("test")
        assert metric(server, "failure") == 1
        assert "api_key_sha256" in (server.reloader.last_error or "")
        still = rig.stream()
        reply = await still.exchange(headers_msg(key="sk-new"))
        assert reply.WhichOneof("response") == "request_headers"

        # Listen addresses are bound at start: changing them is refused, not half-applied.
        config["server"]["grpc_listen"] = "127.0.0.1:1"
        path.write_text(yaml.safe_dump(config))
        assert not await server.reloader.reload("test")
        assert "restart" in (server.reloader.last_error or "")
    finally:
        await channel.close()
        await server.stop()
