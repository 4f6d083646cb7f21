"""Non-streaming shapes, the side routes, and vLLM's error statuses and bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, USER_HI, chat_body


async def test_chat_non_stream_shape(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(max_tokens=3))
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/json"
    raw = await resp.text()
    data = json.loads(raw)
    assert list(data) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "kv_transfer_params",
    ]
    assert data["id"].startswith("chatcmpl-")
    assert data["object"] == "chat.completion"
    assert data["model"] == MODEL
    choice = data["choices"][0]
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": " the cat sat",
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        },
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": None,
    }
    assert list(data["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
    ]
    assert data["usage"]["completion_tokens"] == 3
    assert data["usage"]["prompt_tokens_details"] is None
    # Starlette's compact JSON with raw UTF-8.
    assert ": " not in raw and ", " not in raw.replace(" the cat sat", "")


async def test_completion_non_stream_shape(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "echo": True}
    data = await (await client.post(COMPLETIONS, json=body)).json()
    assert list(data) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
    ]
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert data["choices"] == [
        {
            "index": 0,
            "text": "Hello the cat",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    ]


async def test_completions_default_max_tokens_is_16(make_client: MakeClient) -> None:
    client = await make_client(default_output_tokens=100)
    data = await (await client.post(COMPLETIONS, json={"prompt": "Hi"})).json()
    assert data["usage"]["completion_tokens"] == 16
    assert data["choices"][0]["finish_reason"] == "length"


async def test_missing_model_means_the_served_one(client: TestClient) -> None:
    resp = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 1})
    assert resp.status == 200
    assert (await resp.json())["model"] == MODEL


async def test_request_id_header_and_body(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(max_tokens=1), headers={"X-Request-Id": "abc"})
    assert (await resp.json())["id"] == "chatcmpl-abc"
    resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1, "request_id": "r1"})
    assert (await resp.json())["id"] == "cmpl-r1"


async def test_models_health_version(client: TestClient, model_dir: Path) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and await resp.read() == b""
    data = await (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    card = data["data"][0]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["root"] == str(model_dir) and card["parent"] is None
    assert card["max_model_len"] == 32768
    assert card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["id"].startswith("modelperm-")
    assert (await (await client.get("/version")).json()) == {"version": "0.10.2"}


async def test_unknown_model_is_404(client: TestClient) -> None:
    resp = await client.post(CHAT, json={"model": "gpt-4", "messages": USER_HI})
    assert resp.status == 404
    assert await resp.text() == (
        '{"error":{"message":"The model `gpt-4` does not exist.",'
        '"type":"NotFoundError","param":null,"code":404}}'
    )


@pytest.mark.parametrize(
    ("raw", "content_type", "needle"),
    [
        (b"{not json", "application/json", "json_invalid"),
        (b"[1, 2]", "application/json", "model_attributes_type"),
        (json.dumps({"model": MODEL}).encode(), "application/json", "'messages'"),
        (json.dumps({"messages": "hi"}).encode(), "application/json", "list_type"),
        (b'{"messages": []}', "text/plain", "Unsupported Media Type"),
        (
            json.dumps({"messages": USER_HI, "stream_options": {"include_usage": True}}).encode(),
            "application/json",
            "Stream options can only be defined when `stream=True`.",
        ),
    ],
)
async def test_validation_errors_are_400_bad_request(
    client: TestClient, raw: bytes, content_type: str, needle: str
) -> None:
    resp = await client.post(CHAT, data=raw, headers={"Content-Type": content_type})
    assert resp.status == 400
    body = await resp.json()
    assert list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == "Bad Request"
    assert body["error"]["code"] == 400 and body["error"]["param"] is None
    assert needle in body["error"]["message"]


async def test_context_length_errors(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    long_text = "word " * 200
    resp = await client.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": long_text}])
    )
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError"
    assert err["message"].startswith("This model's maximum context length is 64 tokens. However, ")
    assert err["message"].endswith("input tokens. Please reduce the length of the input messages.")

    resp = await client.post(CHAT, json=chat_body(max_tokens=60))
    err = (await resp.json())["error"]
    assert resp.status == 400
    assert err["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large: 60.")
    assert "(60 > 64 - " in err["message"]

    resp = await client.post(CHAT, json=chat_body(max_completion_tokens=60))
    assert resp.status == 400

    resp = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 0})
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "max_tokens must be at least 1, got 0."


async def test_template_error_is_400(client: TestClient) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    resp = await client.post(CHAT, json=chat_body(messages=messages))
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "BadRequestError"
    assert "A system message is only allowed as the first message." in err["message"]


@pytest.mark.parametrize(
    ("status", "err_type"),
    [
        (500, "InternalServerError"),
        (503, "ServiceUnavailableError"),
        (429, "TooManyRequestsError"),
        (400, "BadRequestError"),
    ],
)
async def test_sim_error_header(client: TestClient, status: int, err_type: str) -> None:
    resp = await client.post(CHAT, json=chat_body(), headers={"x-sim-error": str(status)})
    assert resp.status == status
    body = await resp.json()
    assert body == {
        "error": {
            "message": f"Simulated error (x-sim-error: {status})",
            "type": err_type,
            "param": None,
            "code": status,
        }
    }
    snap = await (await client.get("/sim/stats")).json()
    assert snap["requests_total"] == 0


async def test_unknown_route_and_method(client: TestClient) -> None:
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert await resp.text() == (
        '{"error":{"message":"Not Found","type":"Not Found","param":null,"code":404}}'
    )
    resp = await client.get(CHAT)
    assert resp.status == 405
    assert (await resp.json())["error"]["type"] == "Method Not Allowed"
    assert resp.headers["Server"] == "uvicorn"
