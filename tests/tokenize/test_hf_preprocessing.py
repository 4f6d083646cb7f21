"""vLLM 0.34's request preprocessing for Hugging Face chat templates, one rule per test.

Each rule is where kvgate had drifted from the engine; the parity suite
(test_hf_template_parity.py) checks the same rules against the simulator on real templates.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.openai.errors import ApiError
from kvgate.openai.requests import parse_request
from kvgate.tokenize import PromptCounter
from kvgate.tokenize.chat_template import ChatTemplate, detect_content_format, make_environment
from kvgate.tokenize.errors import PromptRenderError
from kvgate.tokenize.messages import developer_as_system, normalize_tools, parse_messages
from kvgate.tokenize.request_fields import (
    ChatTemplateKwargs,
    engine_kwargs,
    sent_by_client,
    with_request_fields,
)

# A template that only knows system/user/assistant and wants the system message first, as
# Qwen 3.6's does.
STRICT_ROLES = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and not loop.first -%}"
    "{{ raise_exception('System message must be at the beginning.') }}"
    "{%- elif m.role not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unexpected role ' + m.role) }}"
    "{%- endif -%}"
    "<|{{ m.role }}|>{{ m.content }}\n"
    "{%- endfor -%}"
)
THINKING_SWITCH = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n"
    "{%- else %}<think></think>{% endif %}"
    "{%- if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
    "{%- endif %}"
)


def _counter_with(counter: PromptCounter, source: str) -> PromptCounter:
    return PromptCounter(counter._tokenizer, {}, ChatTemplate(source), name="t")


def _chat_body(**fields: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


# --- tools ------------------------------------------------------------------------------


def test_tool_definitions_keep_only_the_fields_vllm_declares() -> None:
    tools = [
        {
            "type": "function",
            "x-vendor": {"a": 1},
            "defer_loading": True,
            "function": {
                "name": "lookup",
                "parameters": {"type": "object"},
                "strict": "true",  # pydantic's lax bool
                "cache_control": {"type": "ephemeral"},
            },
        },
        {"type": "function", "function": {"name": "t", "description": "d", "strict": None}},
    ]
    assert normalize_tools(tools) == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": None,
                "parameters": {"type": "object"},
                "strict": True,
                "defer_loading": True,  # the tool's flag reaches the function
            },
            "defer_loading": True,
        },
        {"type": "function", "function": {"name": "t", "description": "d", "parameters": None}},
    ]
    with pytest.raises(PromptRenderError, match="strict"):
        normalize_tools([{"function": {"name": "f", "strict": "maybe"}}])


def test_unknown_tool_keys_do_not_reach_the_prompt(counter: PromptCounter) -> None:
    plain = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    padded = [{**plain[0], "x-notes": "x " * 500}]
    messages = [{"role": "user", "content": "hi"}]
    assert counter.count_chat(messages, padded) == counter.count_chat(messages, plain)


# --- tool-call arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "Paris"}', {"city": "Paris"}),
        ({"city": "Paris"}, {"city": "Paris"}),
        ("[1, 2]", {}),  # valid JSON, not an object
        ("42", {}),
        ('"text"', {}),
        ("null", {}),
        ("{not json", {}),
        ("", {}),
        (None, {}),
        ([1, 2], {}),  # a list given as is
        (7, {}),
    ],
)
def test_tool_call_arguments_become_objects(arguments: Any, expected: dict[str, Any]) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    (message,) = parse_messages([{"role": "assistant", "tool_calls": [call]}], "string")
    assert message["tool_calls"][0]["function"]["arguments"] == expected


def test_tool_calls_must_be_function_calls() -> None:
    call = {"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(PromptRenderError, match="function call"):
        parse_messages([{"role": "assistant", "tool_calls": [call]}], "string")


# --- developer role and system messages -----------------------------------------------


def test_developer_becomes_system_and_system_messages_merge() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Answer in French.", "tools": None},
        {
            "role": "system",
            "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        },
        {"role": "system", "content": ""},
    ]
    assert developer_as_system(conversation, STRICT_ROLES) == [
        {"role": "system", "content": "Be brief.\n\nAnswer in French.\n\nA\nB"},
        {"role": "user", "content": "hi"},
    ]
    # A template that names the role gets the messages as they are.
    knows = STRICT_ROLES + "{% if m.role == 'developer' %}{% endif %}"
    assert developer_as_system(conversation, knows) is conversation
    # Without a developer message nothing changes, however many system messages.
    no_developer = [m for m in conversation if m["role"] != "developer"]
    assert developer_as_system(no_developer, STRICT_ROLES) is no_developer
    # A single leading system message after conversion keeps its own shape.
    leading = [{"role": "developer", "content": "d", "name": "x"}, {"role": "user", "content": "u"}]
    assert developer_as_system(leading, STRICT_ROLES) == [
        {"role": "system", "content": "d", "name": "x"},
        {"role": "user", "content": "u"},
    ]


def test_developer_message_renders_where_the_template_would_refuse_it(
    counter: PromptCounter,
) -> None:
    strict = _counter_with(counter, STRICT_ROLES)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Answer in French."},
    ]
    assert strict.render_chat(messages) == "<|system|>Answer in French.<|user|>hi"


# --- reasoning_effort -----------------------------------------------------------------


def test_reasoning_effort_sets_the_thinking_switch() -> None:
    assert engine_kwargs(with_request_fields(None, reasoning_effort="low")) == {
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
    assert engine_kwargs(with_request_fields({}, reasoning_effort="none")) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    # The client's own switch wins; the request's effort wins over the client's effort.
    client = {"enable_thinking": False, "reasoning_effort": "high", "x": None, "y": "auto"}
    assert engine_kwargs(with_request_fields(client, reasoning_effort="medium")) == {
        "enable_thinking": False,
        "reasoning_effort": "medium",
    }
    # None and "auto" count as unset, with or without a request effort.
    assert engine_kwargs({"enable_thinking": None, "z": 1}) == {"z": 1}


def test_reasoning_effort_changes_the_count(counter: PromptCounter) -> None:
    thinking = _counter_with(counter, THINKING_SWITCH)
    messages = [{"role": "user", "content": "hi"}]
    assert thinking.render_chat(messages).endswith("<|assistant|><think></think>")
    high = with_request_fields(None, reasoning_effort="high")
    assert thinking.render_chat(messages, chat_template_kwargs=high).endswith(
        "<|assistant|><think>[high]"
    )
    off = with_request_fields(None, reasoning_effort="none")
    assert thinking.render_chat(messages, chat_template_kwargs=off).endswith(
        "<|assistant|><think></think>[none]"
    )


def test_requests_carry_reasoning_effort_to_the_counter() -> None:
    parsed = parse_request("/v1/chat/completions", _chat_body(reasoning_effort="low"))
    kwargs = parsed.chat_template_kwargs
    assert isinstance(kwargs, ChatTemplateKwargs) and kwargs.reasoning_effort == "low"
    assert dict(kwargs) == {} and not sent_by_client(kwargs)  # Mistral mode: nothing sent
    sent = parse_request(
        "/v1/chat/completions",
        _chat_body(reasoning_effort="max", chat_template_kwargs={"a": 1}),
    ).chat_template_kwargs
    assert dict(sent or {}) == {"a": 1} and sent_by_client(sent)
    plain = parse_request("/v1/chat/completions", _chat_body()).chat_template_kwargs
    assert plain is None
    for bad in ("extreme", 3):
        with pytest.raises(ApiError) as caught:
            parse_request("/v1/chat/completions", _chat_body(reasoning_effort=bad))
        assert caught.value.param == "reasoning_effort"


def test_chat_template_kwargs_tools_and_documents_are_rendered(counter: PromptCounter) -> None:
    source = (
        "{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    template = _counter_with(counter, source)
    kwargs = {"documents": [{"title": "a", "text": "b"}], "tools": [{"function": {"name": "k"}}]}
    request_tools = [{"type": "function", "function": {"name": "r"}}]
    rendered = template.render_chat(
        [{"role": "user", "content": "u"}], request_tools, chat_template_kwargs=kwargs
    )
    # vLLM merges the client's kwargs over its defaults: their tools replace the request's.
    assert rendered == "[doc a][tool k]u"


# --- content format -------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        # A macro looping over a parameter that a call passes a message's content.
        "{% macro render(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
        "{% macro render(x, parts=none) %}{% for p in parts %}{{ p.text }}{% endfor %}"
        "{% endmacro %}{% for m in messages %}{{ render(1, parts=m['content']) }}{% endfor %}",
        # A loop over a bare `content` outside any macro.
        "{% for m in messages %}{% set content = m.content %}"
        "{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
        # Messages reached through a namespace attribute.
        "{% set ns = namespace(rest=messages[1:]) %}"
        "{% for m in ns.rest %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
        "{% set ns = namespace(rest=[]) %}{% set ns.rest = messages %}"
        "{% for m in ns.rest %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    ],
)
def test_content_loops_vllm_finds(source: str) -> None:
    assert detect_content_format(make_environment(), source) == "openai"


@pytest.mark.parametrize(
    "source",
    [
        # A macro whose loop is over something that is not a message's content.
        "{% macro render(parts) %}{% for p in parts %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m.tool_calls) }}{% endfor %}",
        # `content` inside a macro that nobody hands a message's content.
        "{% macro render(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        # A tuple target over messages: vLLM's walk gives up and says "string".
        "{% for i, m in messages|enumerate %}{% for p in m.content %}{% endfor %}{% endfor %}",
    ],
)
def test_loops_vllm_does_not_count_as_content(source: str) -> None:
    assert detect_content_format(make_environment(), source) == "string"


# --- billing header -------------------------------------------------------------------


def test_billing_header_line_is_dropped_from_system_prompts() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1; cch=5f3a9;"
    messages = [
        {"role": "system", "content": f"{header}\nYou are Claude Code."},
        {"role": "system", "content": [{"type": "text", "text": header}, "Rules.", f"{header}\nA"]},
        {"role": "user", "content": f"{header}\nnot a system prompt"},
    ]
    system, parts, user = parse_messages(messages, "string")
    assert system["content"] == "You are Claude Code."
    assert parts["content"] == "Rules.\nA"
    assert user["content"] == f"{header}\nnot a system prompt"
    (wrapped, *_) = parse_messages(messages, "openai")
    assert wrapped["content"] == [{"type": "text", "text": "You are Claude Code."}]


def test_empty_text_parts_are_dropped_before_joining() -> None:
    parts = ["a", {"type": "text", "text": ""}, "", "b"]
    (joined,) = parse_messages([{"role": "user", "content": parts}], "string")
    assert joined["content"] == "a\nb"
    (wrapped,) = parse_messages([{"role": "user", "content": parts}], "openai")
    assert [p["text"] for p in wrapped["content"]] == ["a", "", "", "b"]


def test_openai_text_parts_keep_undeclared_keys() -> None:
    parts = [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}, "uuid": "u"},
        {"type": "input_text", "text": "b"},
        {"type": "tool_reference", "name": "search", "extra": 1},
        {"tool_reference": "ignored", "name": "lookup"},  # typeless: the name key counts
    ]
    (message,) = parse_messages([{"role": "user", "content": parts}], "openai")
    assert message["content"] == [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "b"},
        {"type": "tool_reference", "name": "search"},
        {"type": "tool_reference", "name": "lookup"},
    ]
