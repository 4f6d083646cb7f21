"""A Messages body into kvgate's canonical request: the chat request vLLM 0.34 builds.

The expected chat requests are written out for the turns that matter (system, tool_use,
tool_result, thinking); with the vLLM wheel present (var/wheels) they are also checked
against vLLM's own conversion code, and generated bodies are compared with it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.anthropic import AnthropicError, MessagesRequest, parse_messages_request
from kvgate.tokenize.request_fields import ChatTemplateKwargs, engine_kwargs

from .vllm_oracle import ORACLE, plain, vllm_chat_request

needs_vllm = pytest.mark.skipif(ORACLE is None, reason="the vLLM 0.34 wheel is not in var/wheels")

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def parse(body: dict[str, Any]) -> MessagesRequest:
    return parse_messages_request(json.dumps(body).encode())


def refusal(body: dict[str, Any] | bytes) -> AnthropicError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(AnthropicError) as caught:
        parse_messages_request(raw)
    error = caught.value
    assert error.status == 400 and error.type == "invalid_request_error"
    return error


def same_as_vllm(body: dict[str, Any]) -> None:
    """kvgate's canonical chat body is vLLM's, key order of every nested value included
    (the chat template prints tool schemas and arguments in that order)."""
    ours = plain(parse(body).body)
    theirs = vllm_chat_request(body)
    assert ours == theirs
    for key in ("messages", "tools"):
        assert json.dumps(ours.get(key)) == json.dumps(theirs.get(key))


# --------------------------------------------------------------------------- written out

SYSTEM_AND_TOOLS = {
    "model": "qwen2.5-demo",
    "max_tokens": 300,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; hash=abc"},
        {"type": "text", "text": "You are terse."},
        {"type": "text", "text": " Answer in French.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                {"type": "text", "text": "Checking both."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_weather",
                    "input": {"city": "Lyon"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [
                        {"type": "text", "text": "Rain"},
                        {"type": "text", "text": "14C"},
                        {"type": "tool_reference", "tool_name": "get_weather"},
                    ],
                    "is_error": False,
                },
                {"type": "text", "text": "Summarise."},
                {"type": "text", "text": "Briefly."},
            ],
        },
    ],
    "tools": [WEATHER_TOOL],
    "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\nHuman:"],
    "temperature": 0.2,
    "stream": True,
}

SYSTEM_AND_TOOLS_CHAT = {
    "model": "qwen2.5-demo",
    "messages": [
        {"role": "system", "content": "You are terse. Answer in French."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "reasoning": "Two cities.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                },
            ],
            "content": "Checking both.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21C"},
        {
            "role": "tool",
            "tool_call_id": "toolu_2",
            "content": [
                {"type": "tool_reference", "name": "get_weather"},
                {"type": "text", "text": "Rain\n14C"},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Summarise."},
                {"type": "text", "text": "Briefly."},
            ],
        },
    ],
    "max_tokens": 300,
    "max_completion_tokens": 300,
    "stop": ["\n\nHuman:"],
    "temperature": 0.2,
    "min_tokens": 0,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "parallel_tool_calls": False,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": {
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "type": "object",
                },
            },
        }
    ],
}


def test_system_tool_use_and_tool_result_turns_become_vllms_chat_request() -> None:
    request = parse(SYSTEM_AND_TOOLS)
    assert request.body == SYSTEM_AND_TOOLS_CHAT
    # The schema's "type" is appended after the client's keys, as vLLM's validator does.
    parameters = request.body["tools"][0]["function"]["parameters"]
    assert list(parameters) == ["properties", "required", "type"]
    # What admission counts is that chat request.
    assert request.kind == "chat" and request.path == "/v1/messages"
    assert request.messages == SYSTEM_AND_TOOLS_CHAT["messages"]
    assert request.tools == SYSTEM_AND_TOOLS_CHAT["tools"]
    assert request.stream and request.max_new_tokens == 300
    assert request.max_tokens_param == "max_tokens" and request.n == 1
    # The client's body is kept as sent, for forwarding.
    assert request.wire_body == SYSTEM_AND_TOOLS


@needs_vllm
def test_the_written_out_request_is_what_vllm_builds() -> None:
    same_as_vllm(SYSTEM_AND_TOOLS)


ASSISTANT_SIDE = {
    "model": "m",
    "max_tokens": 2048,
    "system": "Plain system text.",
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Only part"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "content": [{"type": "text", "text": "r"}],
                },
                {"type": "tool_use", "id": "toolu_9", "name": "noop"},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]},
        {"role": "assistant", "content": []},
    ],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "output_config": {
        "effort": "high",
        "format": {"type": "json_schema", "schema": {"type": "object"}},
    },
    "chat_template_kwargs": {"custom": 1},
}


def test_tool_results_in_assistant_turns_and_empty_turns() -> None:
    request = parse(ASSISTANT_SIDE)
    assert request.body["messages"] == [
        {"role": "system", "content": "Plain system text."},
        {"role": "user", "content": "Only part"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "toolu_9",
                    "type": "function",
                    "function": {"name": "noop", "arguments": "{}"},
                }
            ],
            # Python's str() of the content list, as vLLM writes it.
            "content": "Tool result: [{'type': 'text', 'text': 'r'}]",
        },
        {"role": "tool", "tool_call_id": "toolu_9", "content": ""},
        {"role": "assistant"},
    ]
    assert request.body["reasoning_effort"] == "high"
    assert request.body["thinking_token_budget"] == 1024
    assert request.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "json_schema", "schema": {"type": "object"}},
    }
    assert "stream" not in request.body and not request.stream
    # The template gets the effort (and the thinking switch) with the client's keywords.
    kwargs = request.chat_template_kwargs
    assert isinstance(kwargs, ChatTemplateKwargs)
    assert engine_kwargs(kwargs) == {
        "custom": 1,
        "reasoning_effort": "high",
        "enable_thinking": True,
    }


@needs_vllm
def test_assistant_side_conversion_is_what_vllm_builds() -> None:
    same_as_vllm(ASSISTANT_SIDE)


@pytest.mark.parametrize("kind", ["disabled", "between_tools"])
def test_disabled_thinking_sets_the_none_effort_over_output_config(kind: str) -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "output_config": {"effort": "max"},
        "thinking": {"type": kind},
    }
    request = parse(body)
    assert request.body["reasoning_effort"] == "none"
    assert engine_kwargs(request.chat_template_kwargs) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    if ORACLE is not None:
        same_as_vllm(body)


def test_tools_without_a_choice_are_auto_and_a_choice_without_tools_stays() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
    }
    assert parse({**body, "tools": []}).body["tool_choice"] == "auto"
    assert parse({**body, "tools": []}).tools == []
    none_choice = parse({**body, "tool_choice": {"type": "none"}}).body
    assert (none_choice["tool_choice"], none_choice["parallel_tool_calls"]) == ("none", True)
    assert "tools" not in none_choice
    plain_request = parse(body)
    assert plain_request.tools is None and "tool_choice" not in plain_request.body
    assert plain_request.chat_template_kwargs is None
    if ORACLE is not None:
        for variant in ({**body, "tools": []}, {**body, "tool_choice": {"type": "none"}}, body):
            same_as_vllm(variant)


# --------------------------------------------------------------------------- refusals


BASE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": "16"}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 2**31}, "max_tokens: Input should be less than or equal to"),
        ({"model": None}, "model: Field required"),
        ({"model": ""}, "model: String should have at least 1 character"),
        ({"messages": []}, "messages: at least one message is required"),
        ({"messages": "hi"}, "messages: Input should be a valid list"),
        ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role: Input should be"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: system messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0.text: Input should be a valid string",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "data": 5}},
                        ],
                    }
                ]
            },
            "messages.0.content.0.source.data: Input should be a valid string",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
            "messages.0.content.0.id: Field required",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}],
                    }
                ]
            },
            "messages.0.content.0.input: Input should be a valid dictionary",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {}}]}]},
            "tool_addition blocks are only allowed",
        ),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema: Field required"),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools.0.type: tool type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name: required"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type: Input should be one of"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: Field required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "greater than or equal to 1024"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            "thinking.budget_tokens: must be less than max_tokens",
        ),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort: Input should be one of"),
        ({"stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"stop_sequences": ["a", 1]}, "stop_sequences.1: Input should be a valid string"),
        ({"temperature": "hot"}, "temperature: Input should be a valid number"),
        (
            {"system": [{"type": "text", "text": 1}]},
            "system.0.text: Input should be a valid string",
        ),
    ],
)
def test_hostile_or_unsupported_bodies_are_refused_in_anthropics_shape(
    change: dict[str, Any], says: str
) -> None:
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    error = refusal(body)
    assert says in error.message
    payload = json.loads(error.to_body())
    assert payload == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error.message},
    }


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b"{",
        b"\xef\xbb\xbf{}",
        b'{"a": NaN}',
        b'{"x": "\\ud800"}',
        b"[" * 100 + b"]" * 100,
    ],
)
def test_bodies_that_are_not_one_strict_json_object_are_refused(raw: bytes) -> None:
    refusal(raw)


def test_images_in_the_system_prompt_are_dropped_as_vllm_drops_them() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    body = {**BASE, "system": [image, {"type": "text", "text": "S"}]}
    assert parse(body).messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
    ]
    if ORACLE is not None:
        same_as_vllm(body)


IMAGES = {
    **BASE,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "snap", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [
                        {"type": "text", "text": "taken"},
                        {"type": "image", "source": {"type": "base64", "data": "BB=="}},
                    ],
                },
                {"type": "image", "source": {"type": "base64", "media_type": "image/gif"}},
            ],
        },
    ],
}


def test_images_become_the_image_parts_vllm_builds() -> None:
    """Image blocks become chat image_url parts (a tool result's in a user message after the
    tool message): the chat path's image rule counts them, or refuses them on a model
    without one."""
    messages = parse(IMAGES).messages or []
    assert messages[0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA=="},
    }
    assert messages[2]["role"] == "tool" and messages[3]["role"] == "user"
    assert messages[3]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BB=="}}
    ]
    if ORACLE is not None:
        same_as_vllm(IMAGES)


def test_a_conversion_left_without_messages_is_refused() -> None:
    error = refusal(
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}
    )
    assert "no message has any content" in error.message


# --------------------------------------------------------------------------- against vLLM

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_ids = st.sampled_from(["toolu_1", "toolu_2", "call_x"])
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_result_items = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("tool_reference"), "tool_name": _text}),
    st.fixed_dictionaries({"type": st.just("document"), "title": _text}),
)
_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _text, "signature": _text}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": _text}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": _ids, "name": _text},
        optional={"input": st.dictionaries(_text, _json_values, max_size=3)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": _ids},
        optional={
            "content": _text | st.lists(_result_items, max_size=3),
            "is_error": st.booleans(),
        },
    ),
    st.fixed_dictionaries({"type": st.just("tool_reference"), "tool_name": _text}),
    st.fixed_dictionaries({"type": st.just("image")}),  # no source: vLLM drops it
)
_turns = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": _text | st.lists(_blocks, max_size=4),
    }
)
_tools = st.fixed_dictionaries(
    {
        "name": _text,
        "input_schema": st.dictionaries(
            st.sampled_from(["type", "properties", "required", "title"]), _json_values, max_size=3
        ),
    },
    optional={
        "description": _text,
        "strict": st.booleans(),
        "defer_loading": st.booleans(),
        "type": st.just("custom"),
    },
)
_bodies = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "max_tokens": st.integers(1, 5000),
        "messages": st.lists(_turns, min_size=1, max_size=5),
    },
    optional={
        "system": _text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": _text})
            | st.just({"type": "text", "text": "x-anthropic-billing-header: a"}),
            max_size=3,
        ),
        "tools": st.lists(_tools, max_size=3),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "none", "tool"])},
            optional={"name": _text, "disable_parallel_tool_use": st.booleans()},
        ),
        "thinking": st.sampled_from(
            [
                {"type": "disabled"},
                {"type": "adaptive"},
                {"type": "between_tools"},
                {"type": "enabled", "budget_tokens": 1024},
            ]
        ),
        "output_config": st.fixed_dictionaries(
            {}, optional={"effort": st.sampled_from(["low", "max"])}
        ),
        "stream": st.booleans(),
        "stop_sequences": st.lists(_text, max_size=3),
        "top_k": st.integers(1, 50),
        "min_tokens": st.integers(0, 3),
        "metadata": st.just({"user_id": "u"}),
    },
)


@needs_vllm
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies)
def test_generated_bodies_convert_as_vllm_converts_them(body: dict[str, Any]) -> None:
    try:
        theirs = vllm_chat_request(body)
    except ValueError:  # pydantic's ValidationError too: vLLM refuses the body
        refusal(body)
        return
    try:
        ours = parse(body)
    except AnthropicError as error:
        # kvgate refuses only what it cannot count as the engine will.
        assert "no message has any content" in error.message, error.message
        assert theirs["messages"] == []
        return
    assert plain(ours.body) == theirs
    for key in ("messages", "tools"):
        assert json.dumps(plain(ours.body).get(key)) == json.dumps(theirs.get(key))
