"""OpenAI's Responses API through the real Envoy -> kvgate -> simulator stack, with the
official `openai` SDK (`client.responses.create`).

The simulator serves /v1/responses as vLLM 0.34 does for a chat-template model (it renders
the input items as chat messages on its chat path). kvgate counts the same converted chat
request, so on every request the prompt kvgate counted and reserved equals the engine's
usage.input_tokens, and the ledger books exactly the engine's usage, streamed or not. A
tenant over its RPM is refused in OpenAI's shape, which the SDK raises as RateLimitError;
a request that continues a stored response is refused with a 400 naming the field;
nothing stays in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

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
TIMEOUT_S = 10.0

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
# A conversation with every kind of item vLLM renders: messages, reasoning, a tool call
# and its output.
ITEMS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "I should call the tool."}],
    },
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees."},
    {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Thanks."},
            {"type": "input_text", "text": "Summarise it for me."},
        ],
    },
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"},
            {"name": LIMITED, "api_key": "sk-one-a-minute", "limits": {"rpm": 1}},
        ]
    ) as running:
        yield running


def sdk(stack: Stack, tenant: str = DEMO_TENANT) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=stack.api_key(tenant),
        max_retries=0,
        timeout=30.0,
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


def nothing_in_flight(stack: Stack) -> None:
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def test_a_response_is_counted_and_billed_as_the_engine_counts_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            instructions="You are a weather assistant. Answer in one sentence.",
            input=ITEMS,
            tools=TOOLS,
            max_output_tokens=24,
        )
    response = raw.parse()
    assert response.object == "response" and response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    # Metered by kvgate (this stack runs without the response cache).
    assert raw.headers["x-kvgate-cache"] == "bypass"
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    nothing_in_flight(stack)


def test_a_stream_is_counted_and_billed_as_the_engine_counts_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=ITEMS, tools=TOOLS, max_output_tokens=32, stream=True
        )
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_text.delta" in kinds
    final = events[-1].response  # type: ignore[union-attr]
    usage = final.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert kvgate_count(stack, request_id) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    nothing_in_flight(stack)


def test_without_max_output_tokens_the_reserved_cap_bounds_the_answer(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(model=MODEL, input="Say hello.")
    response = raw.parse()
    usage = response.usage
    assert usage is not None
    # kvgate wrote the cap it reserved into the forwarded body: the engine echoes it.
    assert response.max_output_tokens is not None and response.max_output_tokens > 0
    assert usage.output_tokens <= response.max_output_tokens
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert billed["output_tokens"] == usage.output_tokens
    nothing_in_flight(stack)


# More of what vLLM renders: a string input with instructions, a continued assistant
# message, the effort, tool_choice none, a developer message.
PARITY_BODIES: dict[str, dict[str, Any]] = {
    "string input": {"instructions": "Be terse.", "input": "Hello there."},
    "developer and assistant turns": {
        "input": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}],
            },
            {"role": "user", "content": "And the weather?"},
        ],
        "tools": TOOLS,
        "tool_choice": "none",
        "reasoning": {"effort": "low"},
    },
    "a partial answer continued": {
        "input": [
            {"role": "user", "content": "Count to five."},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_2",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "1, 2,", "annotations": []}],
            },
        ],
    },
}


@pytest.mark.parametrize("name", list(PARITY_BODIES))
def test_kvgates_count_is_the_engines_input_tokens(stack: Stack, name: str) -> None:
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, max_output_tokens=8, **PARITY_BODIES[name]
        )
    usage = raw.parse().usage
    assert usage is not None
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens, name


def test_a_continuation_of_a_stored_response_is_refused_naming_the_field(stack: Stack) -> None:
    with sdk(stack) as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL, input="And then?", previous_response_id="resp_123", max_output_tokens=8
        )
    error = caught.value
    assert error.status_code == 400
    assert error.param == "previous_response_id"
    assert "previous_response_id" in error.message
    with sdk(stack) as client, pytest.raises(openai.BadRequestError) as uncountable:
        client.responses.create(
            model=MODEL, input="Search it.", tools=[{"type": "web_search"}], max_output_tokens=8
        )
    assert uncountable.value.param == "tools[0].type"
    nothing_in_flight(stack)


def test_a_tenant_over_its_rpm_gets_a_rate_limit_error(stack: Stack) -> None:
    with sdk(stack, LIMITED) as client:
        first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=8)
        assert first.usage is not None and first.usage.output_tokens > 0
        with pytest.raises(openai.RateLimitError) as caught:
            client.responses.create(model=MODEL, input="Again.", max_output_tokens=8)
    error = caught.value
    assert error.status_code == 429
    assert error.code == "rpm_exceeded"
    assert int(error.response.headers["retry-after"]) >= 1
    nothing_in_flight(stack)


def test_the_split_layout_meters_a_stream_from_the_observed_answer() -> None:
    """envoy-observability.yaml: admitted on the request path, the answer metered by the
    observing stream, which reads the Responses events as the inline layout does."""
    with Stack(envoy_config=REPO_ROOT / "envoy" / "envoy-observability.yaml") as split:
        before = tenant_totals(split)
        with sdk(split) as client:
            raw = client.responses.with_raw_response.create(
                model=MODEL, input=ITEMS, tools=TOOLS, max_output_tokens=16, stream=True
            )
            request_id = raw.headers["x-request-id"]
            events = list(raw.parse())
        usage = events[-1].response.usage  # type: ignore[union-attr]
        assert usage is not None
        assert kvgate_count(split, request_id) == usage.input_tokens
        billed = settled(split, before, 1)
        assert (billed["prompt_tokens"], billed["output_tokens"]) == (
            usage.input_tokens,
            usage.output_tokens,
        )
        nothing_in_flight(split)
