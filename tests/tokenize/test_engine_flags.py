"""The vLLM server options that shape chat prompts (``models[].engine_flags``).

Each option is checked on the prompt kvgate renders, the way vLLM 0.34 applies it: the
server's --default-chat-template-kwargs under the request's keywords, --reasoning-effort-map
before the template sees the effort, --chat-template in place of the directory's template,
--chat-template-content-format over the detected format, and
--exclude-tools-when-tool-choice-none.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.config.model import ModelConfig
from kvgate.openai.requests import parse_request
from kvgate.tokenize import PromptCounter, TokenizerService
from kvgate.tokenize.engine_counting import EngineCounter, EngineEndpoint, engine_flags_of
from kvgate.tokenize.engine_flags import EngineFlags
from kvgate.tokenize.errors import TokenizerLoadError
from kvgate.tokenize.modes import load_counter
from kvgate.tokenize.request_fields import with_request_fields
from testbed.engine_models import deepseek_v32_model_dir

# Prints what a chat template is handed, so each test reads the keywords off the prompt.
SHOW_KWARGS = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor -%}"
    "{%- if tools %}[tools:{{ tools | length }}]{% endif -%}"
    "{%- if enable_thinking is defined %}[thinking:{{ enable_thinking }}]{% endif -%}"
    "{%- if reasoning_effort is defined %}[effort:{{ reasoning_effort }}]{% endif -%}"
    "{%- if style is defined %}[style:{{ style }}]{% endif -%}"
)
# Loops over content parts: the "openai" format when detected.
PART_LOOP = (
    "{%- for m in messages %}{%- if m.content is string %}{{ m.content }}"
    "{%- else %}{%- for p in m.content %}<{{ p.text }}>{%- endfor %}{%- endif %}"
    "{%- endfor %}"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _model(**engine_flags: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "m",
            "tokenizer": "unused",
            "max_context": 4096,
            "default_max_new_tokens": 16,
            "backend": "b",
            "engine_flags": {"chat_template": SHOW_KWARGS, **engine_flags},
        }
    )


def _counter(model_dir: Path, model: ModelConfig) -> PromptCounter:
    counter = load_counter(model_dir, name="m", engine_flags=engine_flags_of(model))
    assert isinstance(counter, PromptCounter)
    return counter


def _render(counter: PromptCounter, body: dict[str, Any]) -> str:
    """The prompt for a chat body, with the engine flags applied as the service does."""
    request = parse_request("/v1/chat/completions", json.dumps({"model": "m", **body}).encode())
    flags = counter.engine_flags
    return counter.render_chat(
        request.messages or [],
        flags.tools_for(request.tools, request.body.get("tool_choice")),
        chat_template_kwargs=flags.template_kwargs(request.chat_template_kwargs),
    )


USER = {"messages": [{"role": "user", "content": "hi"}]}


def test_server_defaults_go_under_the_request_keywords(model_dir: Path) -> None:
    counter = _counter(
        model_dir, _model(default_chat_template_kwargs={"enable_thinking": False, "style": "x"})
    )
    assert _render(counter, USER).endswith("[thinking:False][style:x]")
    # The request's own keyword wins; its null or "auto" leaves the default in place.
    assert "[thinking:True]" in _render(
        counter, {**USER, "chat_template_kwargs": {"enable_thinking": True}}
    )
    assert "[thinking:False]" in _render(
        counter, {**USER, "chat_template_kwargs": {"enable_thinking": None}}
    )
    assert "[style:x]" in _render(counter, {**USER, "chat_template_kwargs": {"style": "auto"}})
    # The request's reasoning_effort switches thinking on over the server's default.
    assert "[thinking:True][effort:high]" in _render(counter, {**USER, "reasoning_effort": "high"})
    # ... unless the request names enable_thinking itself, even as null (vLLM checks the
    # client's keys): then the server's default stays.
    assert "[thinking:False][effort:high]" in _render(
        counter,
        {**USER, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": None}},
    )


def test_without_flags_the_prompt_is_the_request_alone(model_dir: Path) -> None:
    counter = _counter(model_dir, _model())
    assert _render(counter, USER) == "<|user|>hi\n"
    # The default set makes a longer prompt: counting without it would count low.
    with_default = _counter(model_dir, _model(default_chat_template_kwargs={"style": "long"}))
    assert with_default.count_chat(
        USER["messages"], chat_template_kwargs=with_default.engine_flags.template_kwargs(None)
    ) > counter.count_chat(USER["messages"])


def test_reasoning_effort_map_rewrites_the_effort(model_dir: Path) -> None:
    counter = _counter(model_dir, _model(reasoning_effort_map={"xhigh": "max", "none": "low"}))
    assert "[effort:max]" in _render(counter, {**USER, "reasoning_effort": "xhigh"})
    assert "[effort:medium]" in _render(counter, {**USER, "reasoning_effort": "medium"})
    # enable_thinking follows the mapped effort, as vLLM derives it after the map.
    assert "[thinking:True][effort:low]" in _render(counter, {**USER, "reasoning_effort": "none"})


def test_effort_map_keys_are_vllm_efforts() -> None:
    with pytest.raises(ValidationError, match="reasoning_effort_map"):
        _model(reasoning_effort_map={"extreme": "max"})


def test_chat_template_from_a_file_or_inline(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "tool_chat.jinja"
    template.write_text("{% for m in messages %}FILE:{{ m.content }}{% endfor %}")
    counter = _counter(model_dir, _model(chat_template=str(template)))
    assert _render(counter, USER) == "FILE:hi"
    assert _render(_counter(model_dir, _model()), USER) == "<|user|>hi\n"
    missing = _model(chat_template=str(tmp_path / "absent.jinja"))
    with pytest.raises(TokenizerLoadError, match=r"absent\.jinja"):
        engine_flags_of(missing)


def test_content_format_given_over_detected(model_dir: Path) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    detected = _counter(model_dir, _model(chat_template=PART_LOOP))
    assert _render(detected, parts) == "<a>"
    as_string = _counter(
        model_dir, _model(chat_template=PART_LOOP, chat_template_content_format="string")
    )
    assert _render(as_string, parts) == "a"


def test_tools_left_out_for_tool_choice_none_only_when_the_engine_does(
    model_dir: Path,
) -> None:
    body = {**USER, "tools": [TOOL], "tool_choice": "none"}
    assert "[tools:1]" in _render(_counter(model_dir, _model()), body)
    excluding = _counter(model_dir, _model(exclude_tools_when_tool_choice_none=True))
    assert "[tools:" not in _render(excluding, body)
    assert "[tools:1]" in _render(excluding, {**body, "tool_choice": "auto"})


def test_service_applies_the_flags(model_dir: Path) -> None:
    flags = _model(
        exclude_tools_when_tool_choice_none=True,
        default_chat_template_kwargs={"style": "a long default style"},
    )
    counter = _counter(model_dir, flags)
    plain = PromptCounter.from_model_dir(
        model_dir, name="m", engine_flags=EngineFlags(chat_template=SHOW_KWARGS)
    )
    service = TokenizerService(max_workers=1, cache_size=8)
    service.register("flagged", counter)
    service.register("plain", plain)
    messages = USER["messages"]

    async def count(model: str, tool_choice: str) -> int:
        return await service.count_chat(model, messages, [TOOL], tool_choice=tool_choice)

    try:
        assert asyncio.run(count("flagged", "none")) == counter.count_chat(
            messages, None, chat_template_kwargs=counter.engine_flags.template_kwargs(None)
        )
        assert asyncio.run(count("plain", "none")) == plain.count_chat(messages, [TOOL])
    finally:
        service.close()


def test_engine_counting_sends_the_mapped_effort_without_the_defaults() -> None:
    """/tokenize applies the server's defaults itself but has no reasoning_effort: the
    effort goes in as mapped, the defaults stay the engine's."""
    engine = EngineCounter(
        EngineEndpoint("http://127.0.0.1:1/tokenize", None),
        name="m",
        timeout_s=0.5,
        max_concurrency=1,
        reserve_upper_bound=False,
    )
    engine.engine_flags = EngineFlags(
        default_chat_template_kwargs={"enable_thinking": False},
        reasoning_effort_map={"xhigh": "max"},
    )
    kwargs = engine.engine_flags.template_kwargs(
        with_request_fields(None, reasoning_effort="xhigh")
    )
    call = engine.chat_call(
        [{"role": "user", "content": "hi"}],
        None,
        add_generation_prompt=True,
        continue_final_message=False,
        chat_template_kwargs=kwargs,
        add_special_tokens=False,
        response_format=None,
    )
    sent = json.loads(call.body)
    assert sent["chat_template_kwargs"] == {"reasoning_effort": "max", "enable_thinking": True}


def test_deepseek_encoders_take_the_server_defaults() -> None:
    model_dir = deepseek_v32_model_dir()
    plain = load_counter(model_dir, name="d")
    thinking = load_counter(
        model_dir,
        name="d",
        engine_flags=EngineFlags(default_chat_template_kwargs={"thinking": True}),
    )
    messages = [{"role": "user", "content": "hi"}]

    def render(counter: Any, kwargs: dict[str, Any] | None) -> str:
        prompt: str = counter.render_chat(
            messages, chat_template_kwargs=counter.engine_flags.template_kwargs(kwargs)
        )
        return prompt

    assert render(plain, None) != render(thinking, None)
    assert render(thinking, None) == render(plain, {"thinking": True})
    # The request's own keyword still wins over the server's.
    assert render(thinking, {"thinking": False}) == render(plain, None)
