"""The Responses API's protocol behind the seam, driven through a real Exchange (the
composition root's services, the memory store, the demo model's tokenizer): no gRPC."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvgate.app import KvgateServer
from kvgate.config import hash_api_key, parse_config
from kvgate.lifecycle.exchange import Exchange, Forward
from kvgate.lifecycle.protocol import ClientError, Outcome, Refused
from kvgate.lifecycle.ticket import CLAMP_HEADER, FALLBACK_HEADER
from kvgate.policy import Reason, SettleCause
from kvgate.protocols import CHAT_COMPLETIONS
from kvgate.protocols.openai_responses import OpenAIResponses
from kvgate.responses_api import ResponsesMeter, ResponsesRequest
from testbed.demo_model import demo_model_dir

MODEL = "qwen2.5-demo"
API = OpenAIResponses()
TURNS: dict[str, Any] = {
    "model": MODEL,
    "max_output_tokens": 64,
    "instructions": "You are terse.",
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks; summarise."}]},
    ],
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
}


def config(**tenant_limits: Any) -> dict[str, Any]:
    return {
        "tenants": [{"name": "acme", "api_key_sha256": hash_api_key("k"), "limits": tenant_limits}],
        "models": [
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": 4096,
                "default_max_new_tokens": 100,
                "backend": "gpu",
            }
        ],
        "backends": [{"name": "gpu", "kv_budget_tokens": 8192, "kv_block_size": 16}],
        # Both on: neither may touch a Responses answer.
        "response_cache": {"enabled": True},
        "idempotency": {"enabled": True},
    }


@pytest.fixture
async def server() -> AsyncIterator[KvgateServer]:
    value = KvgateServer(
        parse_config(config(rpm=3, tpm={"capacity": 100_000, "refill_per_s": 1000}))
    )
    yield value
    await value.services.drain(timeout_s=5)
    value.tokenizers.close()


def exchange_for(server: KvgateServer, n: int, api: Any = API, **options: Any) -> Exchange:
    snapshot = server.snapshots.current
    return Exchange(
        server.services,
        snapshot,
        api,
        snapshot.tenants["acme"],
        request_id=f"req-{n}",
        admission_id=f"req-{n}/adm",
        **options,
    )


async def in_flight(server: KvgateServer) -> tuple[int, int]:
    await server.services.drain(timeout_s=5)
    [status] = await server.store.backend_status() or [None]
    return (0, 0) if status is None else (status.kv_tokens_in_flight, status.requests_in_flight)


def sse(kind: str, **payload: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


async def test_a_responses_request_is_counted_as_the_chat_request_vllm_renders(
    server: KvgateServer,
) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps({**TURNS, "stream": True}).encode())
    assert isinstance(forward, Forward)
    request = forward.ticket.request
    assert isinstance(request, ResponsesRequest)
    expected = await server.tokenizers.count_chat(
        MODEL, request.messages or [], request.tools, tool_choice="auto"
    )
    assert forward.ticket.prompt_tokens == expected
    # The same chat request sent to /v1/chat/completions (where a part is "text": the
    # chat template sees input_text as text) is counted the same.
    chat_body = json.loads(json.dumps(request.body).replace('"input_text"', '"text"'))
    chat = exchange_for(server, 2, CHAT_COMPLETIONS)
    chat_forward = await chat.decide(json.dumps(chat_body).encode())
    assert isinstance(chat_forward, Forward)
    assert chat_forward.ticket.prompt_tokens == expected
    assert chat.close(SettleCause.DISCONNECTED)
    # Nothing to change: the client's own body goes upstream, nothing injected.
    assert forward.body is None and not forward.ticket.usage_injected

    added = exchange.answer_headers(200, "text/event-stream")
    assert added["x-ratelimit-limit-requests"] == "3"
    usage = {"input_tokens": expected, "output_tokens": 2}
    stream = b"".join(
        [
            sse("response.created", response={"status": "in_progress", "usage": None}),
            sse("response.output_text.delta", delta="Sunny."),
            sse("response.completed", response={"status": "completed", "usage": usage}),
        ]
    )
    assert exchange.on_chunk(stream, end_of_stream=True) is None  # passed on untouched
    charged = await exchange.settle(exchange.end_cause())
    assert charged is not None and (charged.prompt_tokens, charged.output_tokens) == (expected, 2)
    assert await in_flight(server) == (0, 0)


async def test_without_max_output_tokens_the_reserved_cap_is_written_in(
    server: KvgateServer,
) -> None:
    body = {k: v for k, v in TURNS.items() if k != "max_output_tokens"}
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps(body).encode())
    assert isinstance(forward, Forward)
    assert forward.ticket.max_new_tokens == 100  # the model's default cap
    assert json.loads(forward.body or b"{}") == {**body, "max_output_tokens": 100}
    exchange.answer_headers(200, "application/json")
    answer = {
        "object": "response",
        "status": "completed",
        "output": [],
        "usage": {"input_tokens": forward.ticket.prompt_tokens, "output_tokens": 3},
    }
    exchange.on_chunk(json.dumps(answer).encode(), end_of_stream=True)
    charged = await exchange.settle(exchange.end_cause())
    assert charged is not None
    assert (charged.prompt_tokens, charged.output_tokens) == (forward.ticket.prompt_tokens, 3)
    assert await in_flight(server) == (0, 0)


async def test_the_answer_layer_does_not_apply(server: KvgateServer) -> None:
    """Neither the Idempotency-Key nor the exact cache reads a Responses answer: the same
    request with the same key runs twice, and nothing is kept."""
    body = json.dumps({**TURNS, "temperature": 0}).encode()
    for n in (1, 2):
        exchange = exchange_for(server, n, idempotency_key="same-key")
        forward = await exchange.decide(body)
        assert isinstance(forward, Forward)
        exchange.answer_headers(200, "application/json")
        usage = {"input_tokens": forward.ticket.prompt_tokens, "output_tokens": 1}
        exchange.on_chunk(
            json.dumps({"object": "response", "usage": usage}).encode(), end_of_stream=True
        )
        await exchange.settle(exchange.end_cause())
    assert await in_flight(server) == (0, 0)
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert totals.requests == 2


async def test_refusals_are_openai_shaped(server: KvgateServer) -> None:
    with pytest.raises(Refused) as refused:
        body = {**TURNS, "previous_response_id": "resp_1"}
        await exchange_for(server, 1).decide(json.dumps(body).encode())
    assert refused.value.label is Outcome.INVALID_REQUEST
    error = json.loads(refused.value.answer.to_body())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "previous_response_id")
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 2).decide(json.dumps({**TURNS, "model": "gpt-x"}).encode())
    assert (refused.value.answer.status, refused.value.label) == (404, Reason.MODEL_NOT_FOUND)
    with pytest.raises(Refused) as refused:
        body = {**TURNS, "max_output_tokens": 5000}
        await exchange_for(server, 3).decide(json.dumps(body).encode())
    assert refused.value.label is Reason.CONTEXT_LENGTH_EXCEEDED
    # The refusal names the field the client wrote its prompt in.
    assert json.loads(refused.value.answer.to_body())["error"]["param"] == "input"
    # Admitted until the tenant's RPM (3) is spent, then refused.
    with pytest.raises(Refused) as refused:
        for n in range(4, 8):
            exchange = exchange_for(server, n)
            await exchange.decide(json.dumps(TURNS).encode())
            exchange.close(SettleCause.DISCONNECTED)
    answer = refused.value.answer
    assert (answer.status, refused.value.label) == (429, Reason.RPM_EXCEEDED)
    assert json.loads(answer.to_body())["error"]["code"] == "rpm_exceeded"
    assert "retry-after" in answer.headers and "x-ratelimit-limit-requests" in answer.headers
    assert await in_flight(server) == (0, 0)


async def test_the_forwarded_body_after_a_fallback_or_a_clamp(server: KvgateServer) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps(TURNS).encode())
    assert isinstance(forward, Forward)
    assert forward.body is None  # the client's cap is the one reserved
    ticket = forward.ticket
    fallback = dataclasses.replace(ticket, new_model="small-model", fallback_from=MODEL)
    body = json.loads(API.forward_body(fallback) or b"{}")
    assert body == {**TURNS, "model": "small-model"}
    assert API.answer_headers(fallback)[FALLBACK_HEADER] == f"{MODEL} -> {ticket.route.name}"
    clamped = dataclasses.replace(ticket, max_new_tokens=16, clamped_from=64)
    body = json.loads(API.forward_body(clamped) or b"{}")
    assert body == {**TURNS, "max_output_tokens": 16}
    assert "max_tokens" not in body  # a Responses body, not the chat request
    assert API.answer_headers(clamped)[CLAMP_HEADER] == "64 -> 16"
    assert exchange.close(SettleCause.DISCONNECTED)
    assert await in_flight(server) == (0, 0)


def test_the_protocols_parts() -> None:
    assert API.path == "/v1/responses" and API.name == "openai_responses"
    assert not API.reuses_answers
    streamed = API.parse(json.dumps({**TURNS, "stream": True}).encode())
    assert not API.wants_usage_report(streamed)
    with pytest.raises(ClientError) as error:
        API.parse(b'{"model": "m"}')
    assert error.value.answer.status == 400
    assert json.loads(error.value.answer.to_body())["error"]["param"] == "input"

    class Stub:
        request = streamed

    assert isinstance(API.meter(Stub()), ResponsesMeter)  # type: ignore[arg-type]
