"""One request's exchange and the OpenAI protocols, driven directly: no gRPC, no Envoy.

The parts are the real ones (the composition root's services, the memory store, the demo
model's tokenizer); only the Envoy adapter is absent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvgate.app import KvgateServer
from kvgate.config import hash_api_key, parse_config
from kvgate.lifecycle.admission import Rejection
from kvgate.lifecycle.answer_sources import Hit
from kvgate.lifecycle.exchange import Exchange, Forward, PromptCount, RouteScope
from kvgate.lifecycle.protocol import ClientError, Outcome, Refused, rejection_answer
from kvgate.lifecycle.response_cache import CACHE_HEADER
from kvgate.openai import errors as openai_errors
from kvgate.policy import Reason, SettleCause
from kvgate.protocols import (
    ANTHROPIC_COUNT_TOKENS,
    ANTHROPIC_MESSAGES,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    METERED_APIS,
)
from testbed.demo_model import demo_model_dir

MODEL = "qwen2.5-demo"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


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
        "response_cache": {"enabled": True},
    }


@pytest.fixture
async def server() -> AsyncIterator[KvgateServer]:
    value = KvgateServer(parse_config(config(rpm=2)))
    yield value
    await value.services.drain(timeout_s=5)
    value.tokenizers.close()


def exchange_for(server: KvgateServer, n: int, **options: Any) -> Exchange:
    snapshot = server.snapshots.current
    return Exchange(
        server.services,
        snapshot,
        CHAT_COMPLETIONS,
        snapshot.tenants["acme"],
        request_id=f"req-{n}",
        admission_id=f"req-{n}/adm",
        **options,
    )


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


async def in_flight(server: KvgateServer) -> tuple[int, int]:
    await server.services.drain(timeout_s=5)
    statuses = await server.store.backend_status()
    return (
        sum(status.kv_tokens_in_flight for status in statuses),
        sum(status.requests_in_flight for status in statuses),
    )


async def test_an_admitted_stream_is_metered_and_settled_once(server: KvgateServer) -> None:
    exchange = exchange_for(server, 1)
    body = dict(CHAT, stream=True)
    forward = await exchange.decide(json.dumps(body).encode())
    assert isinstance(forward, Forward)
    prompt = await server.tokenizers.count_chat(MODEL, body["messages"])
    assert forward.ticket.prompt_tokens == prompt
    # The client did not ask for the usage event: the forwarded body asks for it.
    assert json.loads(forward.body or b"{}")["stream_options"] == {"include_usage": True}
    added = exchange.answer_headers(200, "text/event-stream")
    assert added[CACHE_HEADER] == "bypass"  # a stream is not cached here
    assert added["x-ratelimit-limit-requests"] == "2"
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 3}}
    seen = exchange.on_chunk(sse(chunk, usage), end_of_stream=True)
    # The injected usage event is stripped before the client sees the stream.
    assert seen is not None and b'"usage"' not in seen and b'"hi"' in seen
    charged = await exchange.settle(exchange.end_cause())
    assert charged is not None and (charged.prompt_tokens, charged.output_tokens) == (prompt, 3)
    assert await exchange.settle(SettleCause.COMPLETED) is None  # exactly once
    assert exchange.close(SettleCause.DISCONNECTED) is False
    assert await in_flight(server) == (0, 0)
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens) == (1, prompt, 3)


async def test_a_stream_that_ends_early_settles_in_the_background(server: KvgateServer) -> None:
    exchange = exchange_for(server, 1)
    forward = await exchange.decide(json.dumps(dict(CHAT, stream=True)).encode())
    assert isinstance(forward, Forward)
    assert (await in_flight(server))[1] == 1
    exchange.answer_headers(200, "text/event-stream")
    exchange.on_chunk(
        sse({"choices": [{"index": 0, "delta": {"content": "h"}}]})[:40], end_of_stream=False
    )
    assert exchange.close(SettleCause.DISCONNECTED) is True
    assert exchange.close(SettleCause.DISCONNECTED) is False
    assert await in_flight(server) == (0, 0)
    totals = (await server.store.usage_totals())[("acme", MODEL)]
    assert totals.requests == 1


@pytest.mark.parametrize(
    ("body", "status", "label"),
    [
        (b"{not json", 400, Outcome.INVALID_REQUEST),
        (json.dumps(dict(CHAT, model="nope")).encode(), 404, Reason.MODEL_NOT_FOUND),
        (json.dumps(dict(CHAT, max_tokens=10_000)).encode(), 400, Reason.CONTEXT_LENGTH_EXCEEDED),
    ],
)
async def test_every_refusal_is_one_type_in_the_apis_shape(
    server: KvgateServer, body: bytes, status: int, label: Reason | Outcome
) -> None:
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 1).decide(body)
    assert refused.value.label is label
    assert refused.value.answer.status == status
    assert set(json.loads(refused.value.answer.to_body())["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert await in_flight(server) == (0, 0)


async def test_a_model_outside_the_route_is_refused_before_anything_is_taken(
    server: KvgateServer,
) -> None:
    exchange = exchange_for(server, 1, route=RouteScope(models=frozenset({"other"})))
    with pytest.raises(Refused) as refused:
        await exchange.decide(json.dumps(CHAT).encode())
    assert refused.value.label is Outcome.MODEL_NOT_ALLOWED_ON_ROUTE
    assert refused.value.answer.status == 404
    # No RPM slot was taken: the tenant's two requests are still there.
    for n in (2, 3):
        assert isinstance(await exchange_for(server, n).decide(json.dumps(CHAT).encode()), Forward)


async def test_a_cache_hit_is_a_request_the_tenant_made(server: KvgateServer) -> None:
    """A stored answer counts against the tenant's RPM like any request: its third request
    is refused although the cache holds the answer."""
    body = json.dumps(dict(CHAT, temperature=0)).encode()  # a sampled answer is not kept
    first = exchange_for(server, 1)
    forward = await first.decide(body)
    assert isinstance(forward, Forward)
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": forward.ticket.prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": forward.ticket.prompt_tokens + 1,
        },
    }
    assert first.answer_headers(200, "application/json")[CACHE_HEADER] == "miss"
    first.on_chunk(json.dumps(answer).encode(), end_of_stream=True)
    await first.settle(first.end_cause())
    await server.services.drain(timeout_s=5)
    hit = await exchange_for(server, 2).decide(body)
    assert isinstance(hit, Hit)
    assert json.loads(hit.answer.body)["choices"][0]["message"]["content"] == "hello"
    with pytest.raises(Refused) as refused:
        await exchange_for(server, 3).decide(body)
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert refused.value.answer.status == 429


async def test_a_wait_moves_the_decision_deadline_once(server: KvgateServer) -> None:
    """The first wait tells the adapter how long the whole decision may now take (its
    Idempotency-Key's wait and the decision time); later waits are already covered."""
    notices: list[float] = []
    exchange = exchange_for(server, 1, idempotency_key="k1", on_wait=notices.append)
    started = asyncio.get_running_loop().time()
    exchange._started = started  # as decide() sets it
    exchange._waiting(0.0)
    snapshot = server.snapshots.current
    longest = snapshot.config.idempotency.max_wait_s + snapshot.config.server.decision_timeout_s
    assert len(notices) == 1 and 0 < notices[0] <= longest
    exchange._waiting(0.0)
    assert len(notices) == 1  # Envoy extends a message's timeout once


def test_the_openai_protocols_by_path() -> None:
    assert METERED_APIS["/v1/chat/completions"] is CHAT_COMPLETIONS
    assert METERED_APIS["/v1/completions"] is COMPLETIONS
    request = COMPLETIONS.parse(json.dumps({"model": MODEL, "prompt": ["a", "b"], "n": 2}).encode())
    assert request.num_prompts == 2 and request.n == 2
    with pytest.raises(ClientError) as error:
        CHAT_COMPLETIONS.parse(json.dumps({"model": MODEL, "prompt": "x"}).encode())
    assert error.value.answer.status == 400
    assert not CHAT_COMPLETIONS.wants_usage_report(
        CHAT_COMPLETIONS.parse(json.dumps(CHAT).encode())
    )
    streamed = CHAT_COMPLETIONS.parse(json.dumps(dict(CHAT, stream=True)).encode())
    assert CHAT_COMPLETIONS.wants_usage_report(streamed)
    asked = dict(CHAT, stream=True, stream_options={"include_usage": True})
    assert not CHAT_COMPLETIONS.wants_usage_report(
        CHAT_COMPLETIONS.parse(json.dumps(asked).encode())
    )


@pytest.mark.parametrize(
    ("reason", "status", "retry_after"),
    [
        (Reason.RPM_EXCEEDED, 429, "3"),
        (Reason.BUDGET_EXCEEDED, 429, "3"),
        (Reason.STORE_UNAVAILABLE, 503, "3"),
        (Reason.REQUEST_EXCEEDS_KV_BUDGET, 400, None),
        (Reason.MODEL_NOT_FOUND, 404, None),
    ],
)
def test_one_mapping_from_a_rejection_to_an_answer(
    reason: Reason, status: int, retry_after: str | None
) -> None:
    answer = rejection_answer(Rejection(reason, "why", retry_after_s=2.5), openai_errors)
    assert answer.status == status
    assert answer.headers.get("retry-after") == retry_after


async def test_a_prompt_count_is_admissions_count_and_a_request_the_tenant_makes(
    server: KvgateServer,
) -> None:
    snapshot = server.snapshots.current
    question = {"model": MODEL, "messages": [{"role": "user", "content": "How long is this?"}]}

    def count(n: int) -> PromptCount:
        return PromptCount(
            server.services,
            snapshot,
            ANTHROPIC_COUNT_TOKENS,
            snapshot.tenants["acme"],
            admission_id=f"count-{n}",
        )

    answer = json.loads(await count(1).answer(json.dumps(question).encode()))
    message = Exchange(
        server.services,
        snapshot,
        ANTHROPIC_MESSAGES,
        snapshot.tenants["acme"],
        request_id="m",
        admission_id="m/adm",
    )
    forward = await message.decide(json.dumps({**question, "max_tokens": 8}).encode())
    assert isinstance(forward, Forward)
    assert answer == {
        "input_tokens": forward.ticket.prompt_tokens,
        "context_management": {"original_input_tokens": forward.ticket.prompt_tokens},
    }
    message.close(SettleCause.DISCONNECTED)
    # The tenant's RPM (2) is spent by the count and the message.
    with pytest.raises(Refused) as refused:
        await count(2).answer(json.dumps(question).encode())
    assert refused.value.label is Reason.RPM_EXCEEDED
    assert json.loads(refused.value.answer.to_body())["error"]["type"] == "rate_limit_error"
    assert await in_flight(server) == (0, 0)
