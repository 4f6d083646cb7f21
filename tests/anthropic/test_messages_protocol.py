"""The Messages API's protocol behind the seam, driven through a real Exchange (the
composition root's services, the memory store, the demo model's tokenizer): no gRPC."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvgate.anthropic import MessagesRequest
from kvgate.anthropic.meter import MessagesMeter
from kvgate.app import KvgateServer
from kvgate.config import hash_api_key, parse_config
from kvgate.lifecycle.answer_sources import Hit, SourceName
from kvgate.lifecycle.exchange import Exchange, Forward
from kvgate.lifecycle.protocol import ClientError, Outcome, Refused
from kvgate.lifecycle.response_cache import CACHE_HEADER
from kvgate.lifecycle.ticket import CLAMP_HEADER, FALLBACK_HEADER
from kvgate.policy import Reason, SettleCause
from kvgate.protocols import CHAT_COMPLETIONS
from kvgate.protocols.anthropic_messages import AnthropicMessages
from testbed.demo_model import demo_model_dir

MODEL = "qwen2.5-demo"
API = AnthropicMessages()
TURNS = {
    "model": MODEL,
    "max_tokens": 64,
    "system": "You are terse.",
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "Sunny"}],
                },
                {"type": "text", "text": "Thanks; summarise."},
            ],
        },
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "The weather.",
            "input_schema": {"properties": {"city": {"type": "string"}}},
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
        # Both on, a hit charged as the answer it replays.
        "response_cache": {"enabled": True, "hit_charge": "full"},
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
    statuses = await server.store.backend_status()  # a charged hit's ledger is one too
    return (
        sum(status.kv_tokens_in_flight for status in statuses),
        sum(status.requests_in_flight for status in statuses),
    )


def sse(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


async def test_a_messages_request_is_counted_as_the_chat_request_vllm_runs(
    server: KvgateServer,
) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps({**TURNS, "stream": True}).encode())
    assert isinstance(forward, Forward)
    request = forward.ticket.request
    assert isinstance(request, MessagesRequest)
    # The prompt is the converted chat request's, counted exactly as kvgate counts chat.
    expected = await server.tokenizers.count_chat(
        MODEL, request.messages or [], request.tools, tool_choice="auto"
    )
    assert forward.ticket.prompt_tokens == expected
    # The same chat request sent to /v1/chat/completions is counted the same.
    chat = exchange_for(server, 2, CHAT_COMPLETIONS)
    chat_forward = await chat.decide(json.dumps(request.body).encode())
    assert isinstance(chat_forward, Forward)
    assert chat_forward.ticket.prompt_tokens == expected
    assert chat.close(SettleCause.DISCONNECTED)
    # Nothing to change: the client's own body goes upstream.
    assert forward.body is None and not forward.ticket.usage_injected

    added = exchange.answer_headers(200, "text/event-stream")
    assert added["anthropic-ratelimit-requests-limit"] == "3"
    assert added["anthropic-ratelimit-tokens-limit"] == "100000"
    assert not any(name.startswith("x-ratelimit") for name in added)
    stream = b"".join(
        [
            sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {"usage": {"input_tokens": expected, "output_tokens": 0}},
                },
            ),
            sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "Sunny."},
                },
            ),
            sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2}}),
            sse("message_stop", {"type": "message_stop"}),
        ]
    )
    assert exchange.on_chunk(stream, end_of_stream=True) is None  # passed on untouched
    charged = await exchange.settle(exchange.end_cause())
    assert charged is not None and (charged.prompt_tokens, charged.output_tokens) == (expected, 2)
    assert await in_flight(server) == (0, 0)


async def test_a_json_answer_is_billed_by_its_usage(server: KvgateServer) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps(TURNS).encode())
    assert isinstance(forward, Forward)
    exchange.answer_headers(200, "application/json")
    answer = {
        "id": "m1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Sunny."}],
        "model": MODEL,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": forward.ticket.prompt_tokens, "output_tokens": 3},
    }
    exchange.on_chunk(json.dumps(answer).encode(), end_of_stream=True)
    charged = await exchange.settle(exchange.end_cause())
    assert charged is not None
    assert (charged.prompt_tokens, charged.output_tokens) == (forward.ticket.prompt_tokens, 3)
    assert await in_flight(server) == (0, 0)


def message(prompt_tokens: int, **fields: Any) -> dict[str, Any]:
    """A finished ``message`` as vLLM writes it."""
    return {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Sunny."}],
        "model": MODEL,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 3},
        **fields,
    }


def message_stream(prompt_tokens: int, *, stop_reason: str | None = "end_turn") -> bytes:
    """A finished Messages stream as vLLM writes it (a text block, then the stop)."""
    start = message(prompt_tokens, content=[], stop_reason=None)
    start["usage"] = {"input_tokens": prompt_tokens, "output_tokens": 0}
    return b"".join(
        [
            sse("message_start", {"type": "message_start", "message": start}),
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            ),
            sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "Sunny."},
                },
            ),
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 3},
                },
            ),
            sse("message_stop", {"type": "message_stop"}),
        ]
    )


async def answered(
    exchange: Exchange, body: bytes, content_type: str, answer: bytes | None = None
) -> Forward:
    """The exchange runs (admitted) and its answer passes whole; ``None``: a finished
    message for its own prompt."""
    forward = await exchange.decide(body)
    assert isinstance(forward, Forward)
    headers = exchange.answer_headers(200, content_type)
    assert headers[CACHE_HEADER] in ("miss", "bypass")
    if answer is None:
        answer = json.dumps(message(forward.ticket.prompt_tokens)).encode()
    exchange.on_chunk(answer, end_of_stream=True)
    await exchange.settle(exchange.end_cause())
    return forward


# Valid for both APIs: the same bytes on /v1/messages and /v1/chat/completions.
GREEDY = json.dumps(
    {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
).encode()


async def test_the_exact_cache_keeps_a_complete_message_and_a_hit_is_a_charged_request(
    server: KvgateServer,
) -> None:
    """A finished Messages answer is kept; the same body again is a hit in the Messages
    shape, charged to the tenant (``hit_charge: full``) and taking its RPM slot; the same
    bytes sent to chat/completions never meet the entry."""
    first = exchange_for(server, 1)
    forward = await answered(first, GREEDY, "application/json")
    await server.services.drain(timeout_s=5)
    hit = await exchange_for(server, 2).decide(GREEDY)
    assert isinstance(hit, Hit) and hit.reason == "response_cache_hit"
    assert hit.headers[CACHE_HEADER] == "hit"
    assert json.loads(hit.answer.body) == message(forward.ticket.prompt_tokens)
    assert hit.answer.content_type == "application/json"
    chat = exchange_for(server, 3, CHAT_COMPLETIONS)
    other_api = await chat.decide(GREEDY)
    assert isinstance(other_api, Forward)  # another path: another entry
    assert chat.answer_headers(200, "application/json")[CACHE_HEADER] == "miss"
    chat.close(SettleCause.DISCONNECTED)
    with pytest.raises(Refused) as refused:  # rpm 3: the hit was one of them
        await exchange_for(server, 4).decide(GREEDY)
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert json.loads(refused.value.answer.to_body())["error"]["type"] == "rate_limit_error"
    assert await in_flight(server) == (0, 0)
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    prompt = forward.ticket.prompt_tokens
    assert (totals.cache_hits, totals.cache_saved_tokens) == (1, prompt + 3)
    # The run, the charged hit and the chat request cut short.
    assert totals.requests == 3 and totals.prompt_tokens >= 2 * prompt


async def test_an_idempotency_key_replays_a_complete_message_stream(
    server: KvgateServer,
) -> None:
    """The same key and body again: the stored stream, byte for byte, marked as a replay;
    not charged again, but a request the tenant made (its RPM slot)."""
    body = json.dumps({**TURNS, "stream": True}).encode()
    first = exchange_for(server, 1, idempotency_key="k-1")
    forward = await first.decide(body)
    assert isinstance(forward, Forward)
    stream = message_stream(forward.ticket.prompt_tokens)
    first.answer_headers(200, "text/event-stream; charset=utf-8")
    first.on_chunk(stream, end_of_stream=True)
    await first.settle(first.end_cause())
    await server.services.drain(timeout_s=5)
    replay = await exchange_for(server, 2, idempotency_key="k-1").decide(body)
    assert isinstance(replay, Hit) and replay.reason == "idempotent_replay"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.answer.body == stream
    # Another body under the key: Anthropic's invalid_request_error.
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 3, idempotency_key="k-1").decide(GREEDY)
    assert refused.value.answer.status == 422
    assert json.loads(refused.value.answer.to_body())["type"] == "error"
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert totals.requests == 1  # the replay was charged when it ran
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 4).decide(GREEDY)
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert await in_flight(server) == (0, 0)


def _broken(prompt_tokens: int) -> list[tuple[str, bytes]]:
    whole = message_stream(prompt_tokens)
    cut = whole[: whole.index(b"event: message_stop")]
    error = sse(
        "error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}}
    )
    return [
        ("text/event-stream", cut),  # no message_stop
        ("text/event-stream", cut + error),  # vLLM's failure after the 200
        ("text/event-stream", message_stream(prompt_tokens, stop_reason=None)),  # aborted
        ("application/json", json.dumps(message(prompt_tokens, stop_reason=None)).encode()),
        ("text/html", b"<html>502 Bad Gateway</html>"),
    ]


@pytest.mark.parametrize("case", range(5))
async def test_a_broken_message_is_never_kept(server: KvgateServer, case: int) -> None:
    """A 200 that is not a finished Messages answer: neither the key nor the cache keeps
    it, so the same request with the same key runs again (and misses again)."""
    stream = case < 3
    body = json.dumps({**json.loads(GREEDY), "stream": stream}).encode()
    first = exchange_for(server, 1, idempotency_key="k-broken")
    forward = await first.decide(body)
    assert isinstance(forward, Forward)
    content_type, answer = _broken(forward.ticket.prompt_tokens)[case]
    assert first.answer_headers(200, content_type)[CACHE_HEADER] == "miss"
    first.on_chunk(answer, end_of_stream=True)
    await first.settle(first.end_cause())
    await server.services.drain(timeout_s=5)
    again = exchange_for(server, 2, idempotency_key="k-broken")
    assert isinstance(await again.decide(body), Forward)
    assert again.answer_headers(200, content_type)[CACHE_HEADER] == "miss"
    again.close(SettleCause.DISCONNECTED)
    assert await in_flight(server) == (0, 0)


async def test_refusals_are_anthropic_shaped(server: KvgateServer) -> None:
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 1).decide(json.dumps({**TURNS, "max_tokens": None}).encode())
    assert refused.value.label is Outcome.INVALID_REQUEST
    assert json.loads(refused.value.answer.to_body()) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 2).decide(json.dumps({**TURNS, "model": "claude-x"}).encode())
    assert (refused.value.answer.status, refused.value.label) == (404, Reason.MODEL_NOT_FOUND)
    assert json.loads(refused.value.answer.to_body())["error"]["type"] == "not_found_error"
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 3).decide(json.dumps({**TURNS, "max_tokens": 5000}).encode())
    assert refused.value.label is Reason.CONTEXT_LENGTH_EXCEEDED
    assert "exceed context limit" in json.loads(refused.value.answer.to_body())["error"]["message"]
    # Admitted until the tenant's RPM (3) is spent, then refused.
    with pytest.raises(Refused) as refused:
        for n in range(4, 8):
            exchange = exchange_for(server, n)
            await exchange.decide(json.dumps(TURNS).encode())
            exchange.close(SettleCause.DISCONNECTED)
    answer = refused.value.answer
    assert (answer.status, refused.value.label) == (429, Reason.RPM_EXCEEDED)
    assert json.loads(answer.to_body())["error"]["type"] == "rate_limit_error"
    assert (
        "retry-after" in answer.headers and "anthropic-ratelimit-requests-reset" in answer.headers
    )
    assert await in_flight(server) == (0, 0)


async def test_the_forwarded_body_after_a_fallback_or_a_clamp(server: KvgateServer) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps(TURNS).encode())
    assert isinstance(forward, Forward)
    ticket = forward.ticket
    fallback = dataclasses.replace(ticket, new_model="small-model", fallback_from=MODEL)
    body = json.loads(API.forward_body(fallback) or b"{}")
    assert body == {**TURNS, "model": "small-model"}
    assert API.answer_headers(fallback)[FALLBACK_HEADER] == f"{MODEL} -> {ticket.route.name}"
    clamped = dataclasses.replace(ticket, max_new_tokens=16, clamped_from=64)
    body = json.loads(API.forward_body(clamped) or b"{}")
    assert body == {**TURNS, "max_tokens": 16}
    assert "max_completion_tokens" not in body  # an Anthropic body, not the chat request
    assert API.answer_headers(clamped)[CLAMP_HEADER] == "64 -> 16"
    assert exchange.close(SettleCause.DISCONNECTED)
    assert await in_flight(server) == (0, 0)


def test_the_protocols_parts() -> None:
    assert API.path == "/v1/messages" and API.name == "anthropic_messages"
    assert API.answer_sources == {SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE}
    assert SourceName.SEMANTIC_CACHE in CHAT_COMPLETIONS.answer_sources
    assert API.client_body(API.parse(GREEDY)) == json.loads(GREEDY)  # not the chat request
    streamed = API.parse(json.dumps({**TURNS, "stream": True}).encode())
    assert not API.wants_usage_report(streamed)
    with pytest.raises(ClientError) as error:
        API.parse(b'{"model": "m"}')
    assert error.value.answer.status == 400
    assert json.loads(error.value.answer.to_body())["type"] == "error"
    assert isinstance(API.meter(_ticket_stub(streamed)), MessagesMeter)


def _ticket_stub(request: MessagesRequest) -> Any:
    class Stub:
        pass

    stub = Stub()
    stub.request = request  # type: ignore[attr-defined]
    return stub
