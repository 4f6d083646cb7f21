"""OpenAI's Responses API on a gpt-oss (harmony) model through the real Envoy -> kvgate ->
simulator stack, with the official `openai` SDK (`client.responses.create`).

vLLM 0.34 renders a Responses request on gpt-oss through its own harmony path (not as the
converted chat request); the simulator does the same, and kvgate counts that rendering. So
on every request the prompt kvgate counted and reserved equals the engine's
usage.input_tokens, and the ledger books the engine's usage, streamed or not. Bodies where
the chat conversion and the harmony rendering differ are among them (a leading system
message as the instructions, every part of an assistant message, a reasoning item with only
a summary, tools shown whatever tool_choice says). What the harmony path refuses is refused
by kvgate with a 400 before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from testbed.engine_models import gpt_oss_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEMO_TENANT,
    SimOptions,
    Stack,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

MODEL = "gpt-oss-demo"
TIMEOUT_S = 10.0

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c"]}},
            "required": ["city"],
        },
    }
]
ITEMS: list[Any] = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Call the tool."}],
        "content": [
            {"type": "reasoning_text", "text": "I should call the tool."},
            {"type": "reasoning_text", "text": "With the city."},
        ],
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
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [
            {"type": "output_text", "text": "It is sunny, ", "annotations": []},
            {"type": "output_text", "text": "21 degrees.", "annotations": []},
        ],
    },
    {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
    {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Thanks. "},
            {"type": "input_text", "text": "And tomorrow?"},
        ],
    },
]
PARITY_BODIES: dict[str, dict[str, Any]] = {
    "string input with instructions": {
        "instructions": "Be terse.",
        "input": "Hello there.",
        "reasoning": {"effort": "high"},
    },
    "tools with tool_choice none": {
        "input": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
        ],
        "tools": TOOLS,
        "tool_choice": "none",
        "reasoning": {"effort": "low"},
        "text": {
            "format": {
                "type": "json_schema",
                "name": "answer",
                "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
            }
        },
    },
    "empty instructions keep the system message": {
        "instructions": "",
        "input": [
            {"role": "system", "content": "Never use emoji."},
            {"role": "user", "content": "Hi"},
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


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    models = [
        {
            "name": MODEL,
            "tokenizer": str(gpt_oss_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 256,
            "backend": DEFAULT_BACKEND,
        }
    ]
    with Stack(
        models=models,
        tenants=[{"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"}],
        sim=SimOptions(num_gpu_blocks=4096),
    ) as running:
        yield running


def sdk(stack: Stack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=stack.api_key(DEMO_TENANT),
        max_retries=0,
        timeout=30.0,
    )


def kvgate_count(stack: Stack, request_id: str) -> int:
    """The prompt kvgate counted and reserved for one request (its access-log entry)."""
    entry = stack.wait_access_log(lambda e: e["request_id"] == request_id)
    return int(entry["prompt_tokens"])


def settled(stack: Stack, before: dict[str, int], requests: int) -> dict[str, int]:
    totals = wait_until(
        lambda: tenant_totals(stack),
        lambda t: t["requests"] == before["requests"] + requests,
        timeout=TIMEOUT_S,
    )
    return {key: totals[key] - before[key] for key in totals}


def nothing_in_flight(stack: Stack) -> None:
    def in_flight() -> tuple[float, float]:
        metrics = kvgate_metrics(stack)
        return (
            metrics.value("kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND),
            metrics.value("kvgate_requests_in_flight", backend=DEFAULT_BACKEND),
        )

    assert wait_until(in_flight, lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def test_a_response_is_counted_and_billed_as_the_engine_renders_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=ITEMS, tools=TOOLS, max_output_tokens=24
        )
    response = raw.parse()
    assert response.object == "response" and response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    nothing_in_flight(stack)


def test_a_stream_is_counted_and_billed_as_the_engine_renders_it(stack: Stack) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            input=ITEMS,
            tools=TOOLS,
            reasoning={"effort": "high"},
            max_output_tokens=32,
            stream=True,
        )
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
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


@pytest.mark.parametrize("name", list(PARITY_BODIES))
def test_kvgates_count_is_the_engines_input_tokens(stack: Stack, name: str) -> None:
    with sdk(stack) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, max_output_tokens=8, **PARITY_BODIES[name]
        )
    usage = raw.parse().usage
    assert usage is not None
    assert kvgate_count(stack, raw.headers["x-request-id"]) == usage.input_tokens, name


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": "x", "reasoning": {"effort": "none"}}, "reasoning.effort"),
        ({"input": "x", "tools": [{"type": "custom", "name": "free"}]}, "tools[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
            "input[0].call_id",
        ),
    ],
)
def test_what_the_harmony_path_refuses_is_refused_before_reserving(
    stack: Stack, body: dict[str, Any], named: str
) -> None:
    before = tenant_totals(stack)
    with sdk(stack) as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, max_output_tokens=8, **body)
    assert caught.value.status_code == 400
    assert caught.value.param == named
    assert named in caught.value.message
    assert tenant_totals(stack)["prompt_tokens"] == before["prompt_tokens"]
    nothing_in_flight(stack)
