"""The answer layer on the agent APIs through the real Envoy -> kvgate -> simulator stack,
with the official SDKs: an Idempotency-Key on Anthropic's Messages API (the `anthropic`
SDK) and the exact-match cache on OpenAI's Responses API (`openai`'s
client.responses.create), JSON and streamed.

The simulator answers as vLLM 0.34 does; each answer is kept only because it is complete by
its own API's grammar (kvgate.anthropic.completeness, kvgate.responses_api.completeness).
Whether the backend generated is read from the simulator's own request record; the replayed
or cached answer is the first one, byte for byte, and parses with the SDK.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anthropic import Anthropic
from openai import OpenAI

from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_TENANT,
    Stack,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODEL = DEFAULT_MODEL_NAME
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # The Idempotency-Key is on by default; the exact cache as tests/e2e/test_response_cache.
    with Stack(
        tenants=[{"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"}],
        kvgate_overrides={"response_cache": {"enabled": True}},
    ) as running:
        yield running


def generations(stack: Stack, path: str) -> int:
    """Requests on `path` that reached the simulator."""
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    return sum(1 for record in records["requests"] if record["path"] == path)


def nothing_in_flight(stack: Stack) -> None:
    def in_flight() -> tuple[float, float]:
        metrics = kvgate_metrics(stack)
        return (
            metrics.value("kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND),
            metrics.value("kvgate_requests_in_flight", backend=DEFAULT_BACKEND),
        )

    assert wait_until(in_flight, lambda v: v == (0.0, 0.0), timeout=TIMEOUT_S) == (0.0, 0.0)


def anthropic_sdk(stack: Stack, key: str) -> Anthropic:
    return Anthropic(
        base_url=stack.base_url,
        api_key=stack.api_key(),
        max_retries=0,
        timeout=30.0,
        default_headers={"Idempotency-Key": key},
    )


def openai_sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key(), max_retries=0)


def test_a_messages_request_with_an_idempotency_key_runs_once_and_is_replayed(
    stack: Stack,
) -> None:
    key = f"messages-{uuid.uuid4()}"
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": f"Name three rivers. {key}"}],
    }
    before = generations(stack, "/v1/messages")
    with anthropic_sdk(stack, key) as client:
        first = client.messages.with_raw_response.create(**request)
        replay = client.messages.with_raw_response.create(**request)
    assert "idempotent-replayed" not in first.headers
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.http_response.content == first.http_response.content
    message = replay.parse()
    assert message.type == "message" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.usage.output_tokens > 0
    assert generations(stack, "/v1/messages") == before + 1  # one generation
    nothing_in_flight(stack)


def test_a_streamed_messages_request_is_replayed_as_the_sdk_reads_it(stack: Stack) -> None:
    key = f"messages-stream-{uuid.uuid4()}"
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": f"Count to five. {key}"}],
    }

    def text_of(client: Anthropic) -> tuple[str, str | None, httpx.Headers]:
        with client.messages.stream(**request) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            return text, final.stop_reason, stream.response.headers

    before = generations(stack, "/v1/messages")
    with anthropic_sdk(stack, key) as client:
        first_text, first_stop, first_headers = text_of(client)
        replay_text, replay_stop, replay_headers = text_of(client)
    assert "idempotent-replayed" not in first_headers
    assert replay_headers["idempotent-replayed"] == "true"
    assert first_text and (replay_text, replay_stop) == (first_text, first_stop)
    assert generations(stack, "/v1/messages") == before + 1
    nothing_in_flight(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_request_is_cached_and_hit(stack: Stack, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "input": f"What is the capital of France? {uuid.uuid4()}",
        "max_output_tokens": 24,
        "temperature": 0,  # deterministic: cacheable
        "stream": stream,
    }
    before = generations(stack, "/v1/responses")
    totals = tenant_totals(stack, cache=True)
    client = openai_sdk(stack)
    first = client.responses.with_raw_response.create(**request)
    first_body = first.http_response.read()
    assert first.headers["x-kvgate-cache"] == "miss"
    # Kept when the first answer settles: a moment after its last byte.
    wait_until(
        lambda: tenant_totals(stack, cache=True),
        lambda t: t["requests"] > totals["requests"],
        timeout=TIMEOUT_S,
    )
    hit = wait_until(
        lambda: client.responses.with_raw_response.create(**request),
        lambda raw: raw.headers.get("x-kvgate-cache") == "hit",
        timeout=5,
        interval=0.1,
    )
    assert hit.headers["x-kvgate-cache"] == "hit"
    assert hit.http_response.read() == first_body
    if stream:
        events = list(hit.parse())
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        final = events[-1].response  # type: ignore[union-attr]
    else:
        final = hit.parse()
    assert final.object == "response" and final.output_text
    assert generations(stack, "/v1/responses") == before + 1  # one generation
    after = wait_until(
        lambda: tenant_totals(stack, cache=True),
        lambda t: t["cache_hits"] > totals["cache_hits"],
        timeout=TIMEOUT_S,
    )
    # hit_charge free: the hit is booked, not charged.
    assert after["cache_hits"] == totals["cache_hits"] + 1
    assert after["requests"] == totals["requests"] + 1
    nothing_in_flight(stack)
