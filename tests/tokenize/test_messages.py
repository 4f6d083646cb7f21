"""Message and tool preprocessing follows vLLM's chat_utils."""

from __future__ import annotations

import copy

import pytest

from kvgate.tokenize import PromptRenderError, normalize_tools, parse_messages


def test_string_format_joins_text_parts() -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one"},
                "two",
                {"type": "input_text", "text": "three"},
                {"type": "text"},  # no text: skipped, as vLLM does
                {"type": "refusal", "refusal": "four"},
            ],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": []},
    ]
    conv = parse_messages(msgs, "string")
    assert conv == [
        {"role": "user", "content": "one\ntwo\nthree\nfour"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]


def test_openai_format_wraps_text_parts() -> None:
    conv = parse_messages(
        [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": ["a", {"type": "text", "text": "b"}]},
        ],
        "openai",
    )
    assert conv[0]["content"] == [{"type": "text", "text": "hi"}]
    assert conv[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_only_known_keys_survive() -> None:
    msgs = [
        {"role": "user", "content": "x", "name": "alice", "metadata": {"a": 1}, "task": "t"},
        {"role": "tool", "content": "r", "tool_call_id": "c1", "name": 7},
        {"role": "assistant", "content": "y", "reasoning_content": "think", "refusal": None},
        {"role": "developer", "content": "d", "tools": [{"type": "function"}]},
    ]
    conv = parse_messages(msgs, "string")
    assert conv[0] == {"role": "user", "content": "x", "name": "alice", "task": "t"}
    assert conv[1] == {"role": "tool", "content": "r", "tool_call_id": "c1"}
    assert conv[2] == {
        "role": "assistant",
        "content": "y",
        "reasoning": "think",
        "reasoning_content": "think",
    }
    assert conv[3]["tools"] == [{"type": "function"}]


def test_tool_call_arguments_parsed_like_vllm() -> None:
    calls = [
        {"id": "1", "type": "function", "function": {"name": "a", "arguments": '{"k": [1, "é"]}'}},
        {"id": "2", "type": "function", "function": {"name": "b", "arguments": ""}},
        {"id": "3", "type": "function", "function": {"name": "c", "arguments": "{not json"}},
        {"id": "4", "type": "function", "function": {"name": "d", "arguments": {"x": 1}}},
        {"id": "5", "type": "function", "function": {"name": "e"}},
        {"id": "6", "type": "function", "function": {"name": "f", "arguments": 3}},
    ]
    msgs = [{"role": "assistant", "content": None, "tool_calls": calls}]
    original = copy.deepcopy(msgs)
    conv = parse_messages(msgs, "string")
    args = [c["function"]["arguments"] for c in conv[0]["tool_calls"]]
    assert args == [{"k": [1, "é"]}, {}, {}, {"x": 1}, {}, {}]
    assert msgs == original  # the request is never mutated


def test_empty_tool_calls_dropped() -> None:
    conv = parse_messages([{"role": "assistant", "content": "x", "tool_calls": []}], "string")
    assert conv == [{"role": "assistant", "content": "x"}]
    conv = parse_messages([{"role": "assistant", "content": "x", "tool_calls": None}], "string")
    assert conv == [{"role": "assistant", "content": "x"}]


def test_tool_role_list_content_joined_in_openai_format() -> None:
    conv = parse_messages(
        [{"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "a"}, "b"]}],
        "openai",
    )
    assert conv[0]["content"] == "a\nb"


def test_media_parts_rejected() -> None:
    for part in (
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"image_url": "https://example.com/cat.png"},
    ):
        # Images too: without a collector (a text model) they are refused.
        with pytest.raises(PromptRenderError, match=r"only text|takes no images"):
            parse_messages([{"role": "user", "content": [part]}], "string")


def test_tools_shaped_like_model_dump() -> None:
    tools = [
        {"function": {"parameters": {"type": "object"}, "name": "calc", "strict": True}},
        {"type": "function", "function": {"name": "t", "description": "d"}, "x-extra": 1},
    ]
    shaped = normalize_tools(tools)
    assert shaped == [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
            },
        },
        # vLLM's model_dump() keeps declared fields only: the unknown key is gone.
        {"type": "function", "function": {"name": "t", "description": "d", "parameters": None}},
    ]
    # Declared fields come first, in the model's order.
    assert list(shaped[0]) == ["type", "function"]
    assert list(shaped[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert normalize_tools(None) is None
    assert normalize_tools([]) == []
