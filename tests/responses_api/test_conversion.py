"""A Responses body converted into the chat request vLLM 0.34 renders for it (against
vLLM's own conversion, loaded from the wheel, when it is present), and the bodies refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.openai import ApiError
from kvgate.responses_api import RESPONSES_PATH, parse_responses_request, rewrite_responses_body
from kvgate.tokenize.request_fields import engine_kwargs

from .vllm_oracle import ORACLE, vllm_conversion

needs_oracle = pytest.mark.skipif(ORACLE is None, reason="the vLLM 0.34 wheel is not present")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def parse(body: dict[str, Any]) -> Any:
    return parse_responses_request(json.dumps(body).encode())


def refused(body: dict[str, Any] | bytes) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as error:
        parse_responses_request(raw)
    assert error.value.status == 400
    return error.value


# Bodies vLLM accepts, each a feature of the conversion.
BODIES: dict[str, dict[str, Any]] = {
    "string input": {"model": "m", "input": "Hello"},
    "empty string input": {"model": "m", "input": ""},
    "instructions": {"model": "m", "instructions": "Be terse.", "input": "Hello"},
    "empty instructions": {"model": "m", "instructions": "", "input": "Hello"},
    "easy messages": {
        "model": "m",
        "input": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Weather?"},
        ],
    },
    "typed messages with parts": {
        "model": "m",
        "input": [
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "one"},
                    {"type": "input_text", "text": "two"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "first", "annotations": []},
                    {"type": "output_text", "text": "second (vLLM drops it)", "annotations": []},
                ],
            },
            {"role": "user", "content": "more"},
        ],
    },
    "assistant output parts without ids": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"role": "user", "content": "Again"},
        ],
    },
    "assistant input parts": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "input_text", "text": "Hello"}]},
            {"role": "user", "content": "Again"},
        ],
    },
    "tool round trip": {
        "model": "m",
        "instructions": "Use tools.",
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "summary"}],
                "content": [{"type": "reasoning_text", "text": "Two cities."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "Rain"}],
            },
        ],
        "tools": [WEATHER],
    },
    "reasoning from its summary, then text into the same message": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S1"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
            {"type": "reasoning", "summary": []},
            {"role": "user", "content": "Q2"},
        ],
    },
    "a message after tool calls starts a new one": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Q"},
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
            {"role": "assistant", "content": "text after the call fills the call's message"},
            {"role": "assistant", "content": "and then a new one"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "R"}],
            },
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "R2"}],
            },
        ],
        "tools": [WEATHER],
    },
    "custom tools and calls": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Run it"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "shell", "input": "ls -la ü"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "file"},
        ],
        "tools": [
            {"type": "custom", "name": "shell", "description": "Runs a command."},
            {**WEATHER, "strict": True},
            {"type": "function", "name": "bare"},
        ],
        "tool_choice": {"type": "custom", "name": "shell"},
    },
    "a partial assistant message is continued": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Count to five"},
            {
                "type": "message",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "1, 2,"}],
            },
        ],
    },
    "a partial reasoning item is continued": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Think"},
            {
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Hmm"}],
            },
        ],
    },
    "a partial user message is continued too": {
        "model": "m",
        "input": [{"type": "message", "role": "user", "content": "Hi", "status": "incomplete"}],
    },
    "a string assistant message is continued": {
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hel", "status": "incomplete"},
        ],
    },
    "effort and tool choice none": {
        "model": "m",
        "input": "Hi",
        "reasoning": {"effort": "high", "summary": "auto"},
        "tools": [WEATHER],
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False, "custom": 1},
    },
    "effort none": {"model": "m", "input": "Hi", "reasoning": {"effort": "none"}},
    "required with tools, text format, sampling": {
        "model": "m",
        "input": "Hi",
        "tools": [WEATHER],
        "tool_choice": "required",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "temperature": 0.2,
        "top_p": 0.9,
        "max_output_tokens": 50,
        "stream": True,
        "store": False,
        "include": ["message.output_text.logprobs"],
        "truncation": "disabled",
        "metadata": {"k": "v"},
    },
}


def _comparable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A validated input message keeps its "type" and "status"; the chat parser reads
    # neither (it keeps role, content, tool calls, reasoning and tool_call_id).
    return [{k: v for k, v in m.items() if k not in ("type", "status")} for m in messages]


@needs_oracle
@pytest.mark.parametrize("name", list(BODIES))
def test_the_chat_request_is_what_vllm_renders(name: str) -> None:
    body = BODIES[name]
    expected = vllm_conversion(body)
    request = parse(body)
    assert request.kind == "chat" and request.path == RESPONSES_PATH
    assert _comparable(request.messages) == _comparable(expected["messages"])
    assert (request.tools or None) == (expected["tools"] or None)
    assert request.continue_final_message is expected["continue_final"]
    assert request.add_generation_prompt is not expected["continue_final"]
    # The template keywords, as kvgate hands them to the template and vLLM merges them.
    vllm_kwargs = {
        k: v
        for k, v in expected["chat_template_kwargs"].items()
        if k not in ("add_generation_prompt", "continue_final_message")
    }
    assert engine_kwargs(request.chat_template_kwargs) == vllm_kwargs
    # "none" leaves the tools out on a server that excludes them for it.
    assert (request.body["tool_choice"] == "none") is (expected["tool_choice"] == "none")


def test_the_request_carries_the_cap_and_the_clients_body() -> None:
    body = BODIES["required with tools, text format, sampling"]
    request = parse(body)
    assert request.max_new_tokens == 50 and request.max_tokens_param is not None
    assert request.stream and request.n == 1 and request.num_sequences == 1
    assert request.wire_body == body
    assert request.body["tool_choice"] == "required"
    uncapped = parse(BODIES["string input"])
    assert uncapped.max_new_tokens is None and uncapped.max_tokens_param is None
    assert not uncapped.stream


def test_the_forwarded_body_is_the_clients_with_the_rewrites() -> None:
    body = {"model": "m", "input": "Hi", "stream": True, "extra": {"ü": 1}}
    assert json.loads(rewrite_responses_body(body)) == body
    out = json.loads(rewrite_responses_body(body, model="small", max_output_tokens=7))
    assert out == {**body, "model": "small", "max_output_tokens": 7}
    assert body == {"model": "m", "input": "Hi", "stream": True, "extra": {"ü": 1}}
    assert "ü" in rewrite_responses_body(body).decode()
    with pytest.raises(ValueError):
        rewrite_responses_body(body, max_output_tokens=0)


# Refused by kvgate: stateful, uncountable, or malformed. (field, body)
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("previous_response_id", {"model": "m", "input": "Hi", "previous_response_id": "resp_1"}),
    ("conversation", {"model": "m", "input": "Hi", "conversation": "conv_1"}),
    ("conversation", {"model": "m", "input": "Hi", "conversation": {"id": "conv_1"}}),
    ("previous_input_messages", {"model": "m", "input": "Hi", "previous_input_messages": []}),
    ("background", {"model": "m", "input": "Hi", "background": True}),
    ("prompt", {"model": "m", "input": "Hi", "prompt": {"id": "pmpt_1"}}),
    ("mm_processor_kwargs", {"model": "m", "input": "Hi", "mm_processor_kwargs": {}}),
    (
        "input[0].content[1].file_id",
        {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "file_id": "file-1"},
                    ],
                }
            ],
        },
    ),
    (
        "input[0].content[0].image_url",
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": 7}]}],
        },
    ),
    (
        "input[0].content[0].type",
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
        },
    ),
    (
        "input[1].output[0].type",
        {
            "model": "m",
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "https://x/y.png"}],
                },
            ],
        },
    ),
    ("tools[0].type", {"model": "m", "input": "Hi", "tools": [{"type": "web_search"}]}),
    ("tools[1].type", {"model": "m", "input": "Hi", "tools": [WEATHER, {"type": "file_search"}]}),
    ("tools[0].type", {"model": "m", "input": "Hi", "tools": [{"type": "code_interpreter"}]}),
    (
        "tools[0].type",
        {"model": "m", "input": "Hi", "tools": [{"type": "mcp", "server_label": "x"}]},
    ),
    (
        "tools[0].type",
        {"model": "m", "input": "Hi", "tools": [{"type": "namespace", "name": "ns", "tools": []}]},
    ),
    (
        "tool_choice.type",
        {"model": "m", "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "web_search"}},
    ),
    ("input[0].type", {"model": "m", "input": [{"type": "web_search_call", "id": "ws"}]}),
    ("input[0]", {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}),
    ("model", {"input": "Hi"}),
    ("model", {"model": 3, "input": "Hi"}),
    ("input", {"model": "m"}),
    ("input", {"model": "m", "input": []}),
    ("input", {"model": "m", "input": 42}),
    ("input[0]", {"model": "m", "input": ["Hi"]}),
    ("input[0].type", {"model": "m", "input": [{"content": "no role, no type"}]}),
    ("input[0].role", {"model": "m", "input": [{"role": "robot", "content": "x"}]}),
    ("input[0].content", {"model": "m", "input": [{"role": "user"}]}),
    (
        "input[0].content[0].text",
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    ),
    (
        "input[0].call_id",
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    ),
    (
        "input[0].arguments",
        {
            "model": "m",
            "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
        },
    ),
    ("max_output_tokens", {"model": "m", "input": "Hi", "max_output_tokens": 0}),
    ("max_output_tokens", {"model": "m", "input": "Hi", "max_output_tokens": "5"}),
    ("max_output_tokens", {"model": "m", "input": "Hi", "max_output_tokens": 2**31}),
    ("stream", {"model": "m", "input": "Hi", "stream": "yes"}),
    ("temperature", {"model": "m", "input": "Hi", "temperature": "hot"}),
    ("reasoning.effort", {"model": "m", "input": "Hi", "reasoning": {"effort": "extreme"}}),
    ("text.format.type", {"model": "m", "input": "Hi", "text": {"format": {"type": "xml"}}}),
    ("tool_choice", {"model": "m", "input": "Hi", "tool_choice": "required"}),
    (
        "tool_choice",
        {"model": "m", "input": "Hi", "tool_choice": {"type": "function", "name": "f"}},
    ),
    (
        "tool_choice",
        {
            "model": "m",
            "input": "Hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "other"},
        },
    ),
    ("tool_choice", {"model": "m", "input": "Hi", "tool_choice": "sometimes"}),
    ("tools[0].name", {"model": "m", "input": "Hi", "tools": [{"type": "function"}]}),
    (
        "tools",
        {
            "model": "m",
            "input": "Hi",
            "tools": [{"type": "custom", "name": "g", "format": {"type": "grammar"}}],
        },
    ),
    (
        "input",
        {
            "model": "m",
            "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}],
        },
    ),
    (
        "input[1].content[0].type",
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            ],
        },
    ),
]


@pytest.mark.parametrize(("param", "body"), REFUSED)
def test_bodies_kvgate_cannot_count_or_accept_are_refused_naming_the_field(
    param: str, body: dict[str, Any]
) -> None:
    error = refused(body)
    assert error.param == param, error.message
    payload = json.loads(error.to_body())
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == param


@pytest.mark.parametrize("field", ["previous_response_id", "conversation", "background"])
def test_stateful_requests_are_refused_with_a_message_naming_the_field(field: str) -> None:
    value: Any = True if field == "background" else "resp_1"
    error = refused({"model": "m", "input": "Hi", field: value})
    assert field in error.message and "gateway" in error.message


def test_null_and_false_stateful_fields_are_accepted() -> None:
    request = parse(
        {
            "model": "m",
            "input": "Hi",
            "previous_response_id": None,
            "conversation": None,
            "background": False,
            "prompt": None,
        }
    )
    assert request.messages == [{"role": "user", "content": "Hi"}]


@needs_oracle
@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "input": "Hi", "tool_choice": "required"},
        {
            "model": "m",
            "input": "Hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "x"},
        },
        {"model": "m", "input": "Hi", "prompt": {"id": "pmpt_1"}},
        {
            "model": "m",
            "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}],
        },
        {"model": "m", "input": [{"type": "web_search_call", "id": "ws"}]},
        {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
        {
            "model": "m",
            "input": "Hi",
            "tools": [
                {
                    "type": "custom",
                    "name": "g",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
                }
            ],
        },
    ],
)
def test_what_vllm_refuses_itself_is_refused_too(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # pydantic's ValidationError or vLLM's own
        vllm_conversion(body)
    refused(body)


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b"{", b'{"model": "m", "input": NaN}', b"\xef\xbb\xbf{}"]
)
def test_bodies_that_are_not_one_strict_json_object_are_refused(raw: bytes) -> None:
    refused(raw)
