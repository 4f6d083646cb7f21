"""vLLM's --api-key check, and the /sim/requests record of what reached the backend."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, stats
from vllm_sim.cli import build_parser, config_from_args


async def _records(client: TestClient, query: str = "") -> dict[str, Any]:
    resp = await client.get("/sim/requests" + query)
    assert resp.status == 200
    return await resp.json()


# --- API key -------------------------------------------------------------------------


async def test_api_key_required_on_v1(make_client: MakeClient) -> None:
    client = await make_client(api_keys=("sk-backend",))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-backend"}):
        resp = await client.post(CHAT, json=chat_body(max_tokens=2), headers=headers)
        assert resp.status == 401
        assert resp.headers["Content-Type"] == "application/json"
        assert await resp.read() == b'{"error":"Unauthorized"}'
    # Before routing, as vLLM's ASGI middleware: unknown /v1 paths and GETs too.
    for path in ("/v1/models", "/v1/nope"):
        resp = await client.get(path)
        assert resp.status == 401
    # Nothing reached the engine.
    assert (await stats(client))["requests_total"] == 0

    ok = {"Authorization": "Bearer sk-backend"}
    resp = await client.post(CHAT, json=chat_body(max_tokens=2), headers=ok)
    assert resp.status == 200
    resp = await client.post(
        COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=ok
    )
    assert resp.status == 200
    assert (await client.get("/v1/models", headers=ok)).status == 200


async def test_api_key_leaves_side_routes_open(make_client: MakeClient) -> None:
    client = await make_client(api_keys=("k1", "k2"))
    for path in ("/health", "/metrics", "/sim/stats", "/sim/requests", "/version", "/ping"):
        assert (await client.get(path)).status == 200, path
    assert (await client.post("/sim/reset")).status == 200
    # Any of several keys works (vLLM's --api-key takes a list).
    resp = await client.get("/v1/models", headers={"Authorization": "Bearer k2"})
    assert resp.status == 200


async def test_no_api_key_means_open(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(max_tokens=1))
    assert resp.status == 200


def test_cli_api_key_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--model-dir", "/m"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert config_from_args(build_parser().parse_args(base)).api_keys == ()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert config_from_args(build_parser().parse_args(base)).api_keys == ("from-env",)
    # The flag wins over the environment.
    args = build_parser().parse_args([*base, "--api-key", "a", "b"])
    assert config_from_args(args).api_keys == ("a", "b")
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert config_from_args(build_parser().parse_args(base)).api_keys == ()


def test_cli_logprobs_and_history_flags() -> None:
    base = ["--model-dir", "/m"]
    config = config_from_args(build_parser().parse_args(base))
    assert (config.max_logprobs, config.request_history) == (20, 1000)
    args = build_parser().parse_args([*base, "--max-logprobs", "5", "--request-history", "7"])
    config = config_from_args(args)
    assert (config.max_logprobs, config.request_history) == (5, 7)


# --- /sim/requests ----------------------------------------------------------------------


async def test_requests_record_headers_and_body(client: TestClient) -> None:
    headers = {
        "Authorization": "Bearer tenant-key",
        "x-api-key": "tenant-key-2",
        "X-Request-Id": "req-123",
    }
    body = chat_body(max_tokens=3, min_tokens=2, ignore_eos=True, n=2, temperature=0.5)
    resp = await client.post(CHAT, json=body, headers=headers)
    assert resp.status == 200
    data = await _records(client)
    assert data["total"] == 1
    assert data["generation_requests_total"] == 1
    (rec,) = data["requests"]
    assert rec["seq"] == 1
    assert rec["method"] == "POST"
    assert rec["path"] == CHAT
    assert rec["status"] == 200
    assert rec["request_id"] == "req-123"
    assert rec["headers"]["authorization"] == "Bearer tenant-key"
    assert rec["headers"]["x-api-key"] == "tenant-key-2"
    assert rec["body"] == {
        "model": MODEL,
        "max_tokens": 3,
        "min_tokens": 2,
        "ignore_eos": True,
        "n": 2,
    }
    assert rec["body_keys"] == list(body)
    assert rec["prompt_embeds"] is False


async def test_requests_record_absent_and_null_fields(client: TestClient) -> None:
    await client.post(CHAT, json=chat_body(max_completion_tokens=None))
    await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi"})
    first, second = (await _records(client))["requests"]
    assert first["body"] == {"model": MODEL, "max_completion_tokens": None}
    assert "max_tokens" not in first["body"]
    assert "authorization" not in first["headers"]
    assert first["request_id"] is None
    assert second["path"] == COMPLETIONS
    assert second["body"] == {"model": MODEL}


async def test_requests_record_refusals_and_other_routes(make_client: MakeClient) -> None:
    client = await make_client(api_keys=("k",))
    await client.post(CHAT, json=chat_body())  # 401
    await client.get("/v1/models", headers={"Authorization": "Bearer k"})
    await client.post(  # 400: reached the backend, refused there
        CHAT, json=chat_body(max_tokens=10**6), headers={"Authorization": "Bearer k"}
    )
    await client.post(
        CHAT,
        json=chat_body(max_tokens=1),
        headers={"Authorization": "Bearer k", "x-sim-error": "503"},
    )
    await client.get("/health")  # not recorded: not a /v1 path
    data = await _records(client)
    assert [(r["method"], r["path"], r["status"]) for r in data["requests"]] == [
        ("POST", CHAT, 401),
        ("GET", "/v1/models", 200),
        ("POST", CHAT, 400),
        ("POST", CHAT, 503),
    ]
    assert data["generation_requests_total"] == 3
    assert data["requests"][0]["body"] is None  # never read: refused at the door
    assert data["requests"][2]["body"]["max_tokens"] == 10**6
    assert data["requests"][3]["body"]["max_tokens"] == 1
    snap = await stats(client)
    assert snap["generation_requests_total"] == 3
    assert snap["http_requests_total"] == 4
    assert snap["requests_total"] == 0  # no engine sequence ran


async def test_requests_ring_limit_and_reset(make_client: MakeClient) -> None:
    client = await make_client(request_history=3)
    for i in range(5):
        await client.post(CHAT, json=chat_body(max_tokens=1), headers={"X-Request-Id": f"r{i}"})
    data = await _records(client)
    assert data["total"] == 5
    assert [r["request_id"] for r in data["requests"]] == ["r2", "r3", "r4"]
    assert [r["seq"] for r in data["requests"]] == [3, 4, 5]
    limited = await _records(client, "?limit=1")
    assert [r["request_id"] for r in limited["requests"]] == ["r4"]
    assert (await client.get("/sim/requests?limit=x")).status == 400
    assert (await client.post("/sim/reset")).status == 200
    data = await _records(client)
    assert data == {"total": 0, "generation_requests_total": 0, "requests": []}
    assert (await stats(client))["generation_requests_total"] == 0


async def test_requests_record_streaming_status(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(max_tokens=2, stream=True))
    assert resp.status == 200
    await resp.read()
    (rec,) = (await _records(client))["requests"]
    assert rec["status"] == 200
    assert rec["body"]["stream"] is True
