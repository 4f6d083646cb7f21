"""Anthropic's Messages API through the real Envoy -> kvgate -> simulator stack, with the
official `anthropic` SDK.

The simulator serves /v1/messages as vLLM 0.34 does (it converts the body into a chat
request and runs its chat path). kvgate counts the same converted request, so on every
request the prompt kvgate counted and reserved equals the engine's usage.input_tokens, and
the ledger books exactly the engine's usage, streamed or not. A tenant over its RPM is
refused in Anthropic's shape, which the SDK raises as RateLimitError; nothing stays in
flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import httpx
import pytest
from anthropic import Anthropic

from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_TENANT,
    REPO_ROOT,
    Stack,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

MODEL = DEFAULT_MODEL_NAME
LIMITED = "one-a-minute"
COUNTING = "counts-once-a-minute"
TIMEOUT_S = 10.0

SYSTEM = [
    {"type": "text", "text": "You are a weather assistant."},
    {"type": "text", "text": " Answer in one sentence."},
]
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
# A conversation with every kind of turn vLLM converts: text, a tool call, its result.
TURNS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look that up."},
            {
                "type": "tool_use",
                "id": "toolu_01",
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
                "tool_use_id": "toolu_01",
                "content": [{"type": "text", "text": "Sunny, 21 degrees."}],
            },
            {"type": "text", "text": "Thanks. Summarise it for me."},
        ],
    },
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"},
            {"name": LIMITED, "api_key": "sk-one-a-minute", "limits": {"rpm": 1, "tpm": 50_000}},
            {"name": COUNTING, "api_key": "sk-counts-once", "limits": {"rpm": 1}},
        ]
    ) as running:
        yield running


def sdk(stack: Stack, tenant: str = DEMO_TENANT) -> Anthropic:
    # The SDK sends its key in x-api-key, as Anthropic's API wants it.
    return Anthropic(
        base_url=stack.base_url, api_key=stack.api_key(tenant), max_retries=0, timeout=30.0
    )


def in_flight(stack: Stack) -> tuple[float, float]:
    metrics = kvgate_metrics(stack)
    return (
        metrics.value("kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND),
        metrics.value("kvgate_requests_in_flight", backend=DEFAULT_BACKEND),
    )


def settled(stack: Stack, before: dict[str, int], requests: int) -> dict[str, int]:
    """The tenant's ledger once `requests` more requests are booked (settlement lands just
    after the client's last byte)."""
    totals = wait_until(
        lambda: tenant_totals(stack),
        lambda t: t["requests"] == before["requests"] + requests,
        timeout=TIMEOUT_S,
    )
    return {key: totals[key] - before[key] for key in totals}


def kvgate_count(stack: Stack, request_id: str) -> int:
    """The prompt kvgate counted and reserved for one request (its access-log entry)."""
    entry = stack.wait_access_log(lambda e: e["request_id"] == request_id)
    return int(entry["prompt_tokens"])


def test_a_message_is_counted_and_billed_as_the_engine_counts_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=24, system=SYSTEM, messages=TURNS, tools=TOOLS
        )
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.content and message.content[0].type == "text"
    usage = message.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    # Metered by kvgate (this stack runs without the response cache).
    assert raw.headers["x-kvgate-cache"] == "bypass"
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def test_a_stream_is_counted_and_billed_as_the_engine_counts_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with (
        sdk(stack) as client,
        client.messages.stream(
            model=MODEL,
            max_tokens=32,
            system="You are terse.",
            messages=TURNS,
            tools=TOOLS,
            tool_choice={"type": "auto"},
            stop_sequences=["\n\n\n"],
        ) as stream,
    ):
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert text and final.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    usage = final.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert kvgate_count(stack, request_id) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


# More of what vLLM converts: billing headers, thinking history, tool references, a tool
# result on the assistant side, several text parts, the choice of tool, effort.
PARITY_BODIES: dict[str, dict[str, Any]] = {
    "system blocks and history": {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=42"},
            {"type": "text", "text": "You are a careful assistant."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look up Lyon."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_7",
                        "content": [
                            {"type": "tool_reference", "tool_name": "get_weather"},
                            {"type": "text", "text": "Cloudy"},
                            {"type": "text", "text": "12 degrees"},
                        ],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                    {"type": "text", "text": "Be brief."},
                ],
            },
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    },
    "a tool result on the assistant side": {
        "messages": [
            {"role": "user", "content": "Start."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Noted."},
                    {
                        "type": "tool_result",
                        "tool_use_id": "x",
                        "content": [{"type": "text", "text": "done"}],
                    },
                ],
            },
            {"role": "user", "content": "Go on."},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "none"},
        "output_config": {"effort": "high"},
        "thinking": {"type": "adaptive"},
    },
}


@pytest.mark.parametrize("name", list(PARITY_BODIES))
def test_kvgates_count_is_the_engines_input_tokens(stack: Stack, name: str) -> None:
    with sdk(stack) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, **PARITY_BODIES[name]
        )
    engine = raw.parse().usage.input_tokens
    assert kvgate_count(stack, raw.headers["x-request-id"]) == engine, name


def test_a_body_the_engine_would_refuse_is_refused_in_anthropics_shape(stack: Stack) -> None:
    with sdk(stack) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "video"}]}],  # type: ignore[list-item]
        )
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with sdk(stack) as client, pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="claude-not-here", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with (
        Anthropic(base_url=stack.base_url, api_key="sk-wrong", max_retries=0) as client,
        pytest.raises(anthropic.AuthenticationError) as denied,
    ):
        client.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_a_tenant_over_its_rpm_gets_anthropics_rate_limit_error(stack: Stack) -> None:
    with sdk(stack, LIMITED) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello."}]
        )
        assert raw.parse().usage.output_tokens > 0
        with pytest.raises(anthropic.RateLimitError) as caught:
            client.messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Again."}]
            )
    # Anthropic's rate-limit headers pass Envoy's mutation rules on the answer and the refusal.
    admitted = raw.headers
    assert admitted["anthropic-ratelimit-requests-limit"] == "1"
    assert admitted["anthropic-ratelimit-requests-remaining"] == "0"
    assert admitted["anthropic-ratelimit-tokens-limit"] == "50000"
    assert 0 < int(admitted["anthropic-ratelimit-tokens-remaining"]) < 50_000
    for name in ("requests", "tokens"):
        reset = admitted[f"anthropic-ratelimit-{name}-reset"]
        assert datetime.fromisoformat(reset) > datetime.now(UTC) - timedelta(seconds=5), reset
    error = caught.value
    assert error.status_code == 429
    assert error.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "rate_limit_error", "message": error.body["error"]["message"]},  # type: ignore[index]
    }
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert error.response.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def test_the_split_layout_meters_a_stream_from_the_observed_answer() -> None:
    """envoy-observability.yaml: admitted on the request path, the answer metered by the
    observing stream, which reads Anthropic's events as the inline layout does."""
    with Stack(envoy_config=REPO_ROOT / "envoy" / "envoy-observability.yaml") as split:
        before = tenant_totals(split)
        with (
            sdk(split) as client,
            client.messages.stream(
                model=MODEL, max_tokens=16, system=SYSTEM, messages=TURNS, tools=TOOLS
            ) as stream,
        ):
            final = stream.get_final_message()
            request_id = stream.response.headers["x-request-id"]
        assert kvgate_count(split, request_id) == final.usage.input_tokens
        billed = settled(split, before, 1)
        assert (billed["prompt_tokens"], billed["output_tokens"]) == (
            final.usage.input_tokens,
            final.usage.output_tokens,
        )
        assert wait_until(lambda: in_flight(split), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (
            0,
            0,
        )


def test_count_tokens_is_answered_by_kvgate_with_the_engines_count(stack: Stack) -> None:
    """messages.count_tokens is answered by kvgate from its own exact count: the same number
    the engine answers for the same body, and the input tokens a real message is billed;
    nothing is forwarded, reserved or billed for the count itself."""
    body: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "messages": TURNS, "tools": TOOLS}
    engine = httpx.post(f"{stack.sim_url}/v1/messages/count_tokens", json=body, timeout=TIMEOUT_S)
    assert engine.status_code == 200, engine.text
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.messages.with_raw_response.count_tokens(**body)
        counted = raw.parse()
        assert raw.headers["content-type"] == "application/json"
        assert counted.input_tokens == engine.json()["input_tokens"] > 0
        message = client.messages.create(max_tokens=8, **body)
    assert message.usage.input_tokens == counted.input_tokens
    # Only the real message is in the ledger.
    billed = settled(stack, before, 1)
    assert billed["prompt_tokens"] == message.usage.input_tokens
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def test_count_tokens_is_a_request_the_tenant_makes(stack: Stack) -> None:
    """A count takes the tenant's RPM slot: counting is work kvgate does for the tenant."""
    question = {"model": MODEL, "messages": [{"role": "user", "content": "How long is this?"}]}
    with sdk(stack, COUNTING) as client:
        assert client.messages.count_tokens(**question).input_tokens > 0
        with pytest.raises(anthropic.RateLimitError) as caught:
            client.messages.count_tokens(**question)
        with pytest.raises(anthropic.NotFoundError):
            client.messages.count_tokens(model="no-such-model", messages=question["messages"])
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(caught.value.response.headers["retry-after"]) >= 1
