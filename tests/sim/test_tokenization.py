"""vLLM-style message preprocessing, unit by unit."""

from __future__ import annotations

import pytest

from vllm_sim.tokenization import (
    PromptError,
    detect_content_format,
    normalize_tools,
    preprocess_messages,
)


def test_string_format_joins_text_parts_and_drops_empty() -> None:
    messages = [
        {"role": "system", "content": None},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": ""},
                "b",
                {"type": "input_text", "text": "c"},
            ],
            "name": "alice",
        },
    ]
    assert preprocess_messages(messages, "string") == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a\nb\nc", "name": "alice"},
    ]


def test_openai_format_wraps_parts() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": ["x", ""]}]
    assert preprocess_messages(messages, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": ""}]},
    ]


def test_tool_call_arguments_become_objects() -> None:
    original = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}},
            {"id": "3", "type": "function", "function": {"name": "h"}},
        ],
    }
    tool = {"role": "tool", "tool_call_id": "1", "content": "ok"}
    out = preprocess_messages([original, tool], "string")
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"x": 1}, {}, {}]
    assert original["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # not mutated
    assert out[1] == {"role": "tool", "content": "ok", "tool_call_id": "1"}


def test_bad_inputs() -> None:
    with pytest.raises(PromptError):
        preprocess_messages([{"role": "user", "content": [{"type": "image_url"}]}], "string")
    # vLLM 0.34 coerces arguments that are not valid JSON to {} rather than refusing.
    (out,) = preprocess_messages(
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
        "string",
    )
    assert out["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(PromptError):
        normalize_tools(["not a tool"])  # type: ignore[list-item]


def test_normalize_tools_matches_pydantic_dump() -> None:
    tools = [{"type": "function", "function": {"name": "f", "strict": True}, "x": 1}]
    assert normalize_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "strict": True},
        }  # vLLM's model_dump() drops the unknown key
    ]


def test_detect_content_format() -> None:
    assert detect_content_format("{{ message.content }}") == "string"
    assert detect_content_format(None) == "string"
    # vLLM counts a loop over the content of a message that a loop over messages bound.
    loop = "{%- for part in message['content'] %}{{ part.text }}{% endfor %}"
    assert detect_content_format(loop) == "string"
    in_messages = "{% for message in messages %}" + loop + "{% endfor %}"
    assert detect_content_format(in_messages) == "openai"
    dotted = "{% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}"
    assert detect_content_format(dotted) == "openai"
