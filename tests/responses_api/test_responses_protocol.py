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
from kvgate.lifecycle.answer_sources import Hit, SourceName
from kvgate.lifecycle.exchange import Exchange, Forward
from kvgate.lifecycle.protocol import ClientError, Outcome, Refused
from kvgate.lifecycle.response_cache import CACHE_HEADER
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


def response(prompt_tokens: int, status: str = "completed", **fields: Any) -> dict[str, Any]:
    """A finished ``response`` as vLLM writes it (one message item)."""
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": MODEL,
        "status": status,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
            }
        ],
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 3, "total_tokens": 0},
        **fields,
    }


def response_stream(prompt_tokens: int, terminal: str = "response.completed") -> bytes:
    """A finished Responses stream as vLLM writes it."""
    status = "incomplete" if terminal == "response.incomplete" else "completed"
    initial = response(prompt_tokens, "in_progress", output=[], usage=None)
    events = [
        sse("response.created", response=initial, sequence_number=0),
        sse("response.in_progress", response=initial, sequence_number=1),
        sse(
            "response.output_text.delta",
            delta="Sunny.",
            item_id="msg_1",
            output_index=0,
            content_index=0,
            sequence_number=2,
        ),
        sse(terminal, response=response(prompt_tokens, status), sequence_number=3),
    ]
    return b"".join(events)


# Deterministic, and plain: the same body hits.
GREEDY: dict[str, Any] = {
    "model": MODEL,
    "max_output_tokens": 16,
    "temperature": 0,
    "input": "Weather in Paris?",
}


async def test_the_exact_cache_keeps_a_complete_response_and_a_hit_is_a_charged_request(
    server: KvgateServer,
) -> None:
    """A finished response is kept; the same body again is a hit, charged to the tenant
    (``hit_charge: full``) and taking its RPM slot. The key is the client's own body: a
    field the converted chat request drops (``metadata``, echoed in the response) makes
    another entry."""
    body = json.dumps(GREEDY).encode()
    first = exchange_for(server, 1)
    forward = await first.decide(body)
    assert isinstance(forward, Forward)
    assert first.answer_headers(200, "application/json")[CACHE_HEADER] == "miss"
    first.on_chunk(json.dumps(response(forward.ticket.prompt_tokens)).encode(), end_of_stream=True)
    await first.settle(first.end_cause())
    await server.services.drain(timeout_s=5)
    hit = await exchange_for(server, 2).decide(body)
    assert isinstance(hit, Hit) and hit.headers[CACHE_HEADER] == "hit"
    assert json.loads(hit.answer.body) == response(forward.ticket.prompt_tokens)
    other = exchange_for(server, 3)
    tagged = json.dumps({**GREEDY, "metadata": {"run": "2"}}).encode()
    assert isinstance(await other.decide(tagged), Forward)
    assert other.answer_headers(200, "application/json")[CACHE_HEADER] == "miss"
    other.close(SettleCause.DISCONNECTED)
    with pytest.raises(Refused) as refused:  # rpm 3: the hit was one of them
        await exchange_for(server, 4).decide(body)
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert await in_flight(server) == (0, 0)
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert (totals.cache_hits, totals.cache_saved_tokens) == (1, forward.ticket.prompt_tokens + 3)
    assert totals.requests == 3  # the run, the charged hit, the request cut short


@pytest.mark.parametrize("terminal", ["response.completed", "response.incomplete"])
async def test_an_idempotency_key_replays_a_complete_response_stream(
    server: KvgateServer, terminal: str
) -> None:
    """The same key and body again: the stored stream, marked as a replay, not charged
    again but a request the tenant made. A response cut by its own max_output_tokens is
    the request's complete answer."""
    body = json.dumps({**GREEDY, "stream": True}).encode()
    first = exchange_for(server, 1, idempotency_key="k-1")
    forward = await first.decide(body)
    assert isinstance(forward, Forward)
    stream = response_stream(forward.ticket.prompt_tokens, terminal)
    first.answer_headers(200, "text/event-stream; charset=utf-8")
    first.on_chunk(stream, end_of_stream=True)
    await first.settle(first.end_cause())
    await server.services.drain(timeout_s=5)
    replay = await exchange_for(server, 2, idempotency_key="k-1").decide(body)
    assert isinstance(replay, Hit) and replay.reason == "idempotent_replay"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.answer.body == stream
    with pytest.raises(Refused) as refused:  # another body under the key
        await exchange_for(server, 3, idempotency_key="k-1").decide(json.dumps(GREEDY).encode())
    assert refused.value.answer.status == 422
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert totals.requests == 1  # the replay was charged when it ran
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 4).decide(body)
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert await in_flight(server) == (0, 0)


def _broken(prompt_tokens: int) -> list[tuple[str, bytes]]:
    whole = response_stream(prompt_tokens)
    cut = whole[: whole.index(b"event: response.completed")]
    failed = response(prompt_tokens, "failed", error={"code": "server_error", "message": "x"})
    return [
        ("text/event-stream", cut),  # no terminal event
        ("text/event-stream", cut + sse("error", code="server_error", message="engine died")),
        ("text/event-stream", cut + sse("response.failed", response=failed, sequence_number=3)),
        ("application/json", json.dumps(response(prompt_tokens, "cancelled")).encode()),
        ("text/html", b"<html>502 Bad Gateway</html>"),
    ]


@pytest.mark.parametrize("case", range(5))
async def test_a_broken_response_is_never_kept(server: KvgateServer, case: int) -> None:
    """A 200 that is not a finished response: neither the key nor the cache keeps it, so
    the same request with the same key runs again (and misses again)."""
    body = json.dumps({**GREEDY, "stream": case < 3}).encode()
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
    assert API.answer_sources == {SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE}
    greedy = json.dumps(GREEDY).encode()
    assert API.client_body(API.parse(greedy)) == GREEDY  # not the converted chat request
    streamed = API.parse(json.dumps({**TURNS, "stream": True}).encode())
    assert not API.wants_usage_report(streamed)
    with pytest.raises(ClientError) as error:
        API.parse(b'{"model": "m"}')
    assert error.value.answer.status == 400
    assert json.loads(error.value.answer.to_body())["error"]["param"] == "input"

    class Stub:
        request = streamed

    assert isinstance(API.meter(Stub()), ResponsesMeter)  # type: ignore[arg-type]
