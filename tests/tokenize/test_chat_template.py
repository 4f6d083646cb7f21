"""The renderer behaves like transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.tokenize import ChatTemplate, PromptCounter, PromptRenderError, detect_content_format
from kvgate.tokenize.chat_template import load_template_sources, make_environment
from tests.tokenize.conftest import input_ids

USER = [{"role": "user", "content": "hi"}]


def _render(template: ChatTemplate, messages: list[dict], tools: Any = None, **kw: Any) -> str:
    chosen = template.select(tools)
    return template.render(
        chosen,
        messages,
        tools,
        add_generation_prompt=kw.pop("add_generation_prompt", False),
        continue_final_message=kw.pop("continue_final_message", False),
        chat_template_kwargs=kw or None,
    )


def test_environment_helpers() -> None:
    template = ChatTemplate(
        "{{ {'b': 'é', 'a': [1, 2]} | tojson }}|{{ {'x': 1} | tojson(indent=2) }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}|"
        "{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}"
        "{% generation %}[gen]{% endgeneration %}",
        {"eos_token": "</s>"},
    )
    out = _render(template, USER)
    # Key order kept, no HTML escaping, non-ASCII kept (transformers' tojson).
    assert out == '{"b": "é", "a": [1, 2]}|{\n  "x": 1\n}|1|{"a": 1}|4|</s>[gen]'


def test_raise_exception_and_sandbox_become_prompt_render_errors() -> None:
    boom = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(PromptRenderError, match="roles must alternate"):
        _render(boom, USER)
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(PromptRenderError):
        _render(escape, USER)
    ns = ChatTemplate("{% set ns = namespace(_x=1) %}")
    with pytest.raises(PromptRenderError):
        _render(ns, USER)
    shape = ChatTemplate("{{ messages[0]['content'][7]['text'] }}")
    with pytest.raises(PromptRenderError):
        _render(shape, USER)


def test_broken_template_fails_at_load() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_trim_blocks_and_lstrip_blocks(hf_tokenizer: Any) -> None:
    source = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
        "{% endif %}\n{% endfor %}"
    )
    template = ChatTemplate(source)
    ours = _render(template, USER)
    theirs = hf_tokenizer.apply_chat_template(USER, chat_template=source, tokenize=False)
    assert ours == theirs == "[hi]\n"


def test_none_values_dropped_and_reasoning_aliased(hf_tokenizer: Any) -> None:
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:"
        "{{ m.thinking | default('-') }}/{{ m.reasoning_content | default('-') }};{% endfor %}"
    )
    msgs = [
        {"role": "user", "content": None},
        {"role": "assistant", "content": "x", "reasoning": "because"},
    ]
    ours = _render(ChatTemplate(source), msgs)
    theirs = hf_tokenizer.apply_chat_template(msgs, chat_template=source, tokenize=False)
    assert ours == theirs == "user:False:-/-;assistant:True:because/because;"


def test_kwargs_and_special_tokens(hf_tokenizer: Any) -> None:
    source = (
        "{{ bos_token | default('no-bos') }} {{ eos_token }} {{ enable_thinking | default(true) }}"
    )
    template = ChatTemplate(source, {"eos_token": "<|im_end|>"})
    assert _render(template, USER) == "no-bos <|im_end|> True"
    assert _render(template, USER, enable_thinking=False) == "no-bos <|im_end|> False"
    # Request kwargs may override special tokens, as in transformers.
    assert _render(template, USER, eos_token="E") == "no-bos E True"
    theirs = hf_tokenizer.apply_chat_template(
        USER, chat_template=source, tokenize=False, enable_thinking=False
    )
    assert theirs == "no-bos <|im_end|> False"
    # The request's own fields win over same-named kwargs (vLLM's merge order).
    gen = ChatTemplate("{{ add_generation_prompt }}")
    assert _render(gen, USER, add_generation_prompt=True) == "True"
    assert (
        gen.render(
            gen.select(None),
            USER,
            None,
            add_generation_prompt=True,
            continue_final_message=False,
            chat_template_kwargs={"add_generation_prompt": False},
        )
        == "True"
    )


def test_continue_final_message_matches_transformers(hf_tokenizer: Any) -> None:
    msgs = [
        {"role": "user", "content": "Write a list"},
        {"role": "assistant", "content": "Sure:\n1. "},
    ]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    counter_text = hf_tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
    template = ChatTemplate(hf_tokenizer.chat_template, {"eos_token": "<|im_end|>"})
    assert _render(template, msgs, **kw) == counter_text
    assert counter_text.endswith("assistant\nSure:\n1. ")  # the demo template keeps spacing
    # A template that trims content loses the tag's space: the cut is rstripped too.
    trim = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
    theirs = hf_tokenizer.apply_chat_template(msgs, chat_template=trim, tokenize=False, **kw)
    assert (
        _render(ChatTemplate(trim), msgs, **kw)
        == theirs
        == "<user>Write a list</user><assistant>Sure:\n1."
    )


def test_content_format_detection() -> None:
    env = make_environment()
    string_style = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    openai_style = (
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
        "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
        "{{ part.text }}{% endfor %}{% endfor %}"
    )
    attr_style = (
        "{% for m in messages|reverse %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}"
    )
    unrelated = "{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}"
    assert detect_content_format(env, string_style) == "string"
    assert detect_content_format(env, openai_style) == "openai"
    assert detect_content_format(env, attr_style) == "openai"
    assert detect_content_format(env, unrelated) == "string"


def test_openai_format_template_gets_part_lists(hf_tokenizer: Any) -> None:
    source = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.select(None).content_format == "openai"
    msgs = [
        {"role": "user", "content": "plain"},
        {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    from kvgate.tokenize import parse_messages

    conversation = parse_messages(msgs, "openai")
    # Plain strings become one text part; tool results are joined back into a string.
    assert _render(template, conversation) == "<user>[text:plain]<tool>a\nb"


def test_template_selection(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "default"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    sources = load_template_sources(tmp_path)
    assert isinstance(sources, dict)
    template = ChatTemplate(sources)
    assert template.select(None).name == "default"
    assert template.select([{"type": "function"}]).name == "tool_use"
    no_default = ChatTemplate({"a": "x", "b": "y"})
    with pytest.raises(PromptRenderError):
        no_default.select(None)


def test_jinja_file_takes_precedence(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    assert load_template_sources(tmp_path) == "config"
    (tmp_path / "chat_template.jinja").write_text("file")
    assert load_template_sources(tmp_path) == "file"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools")
    assert load_template_sources(tmp_path) == {"default": "file", "tool_use": "tools"}


def test_counter_uses_jinja_file(model_dir: Path, tmp_path: Path, hf_tokenizer: Any) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).symlink_to(model_dir / name)
    source = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(source)
    counter = PromptCounter.from_model_dir(tmp_path)
    assert (
        counter.render_chat(USER, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    )
    ids = input_ids(hf_tokenizer.apply_chat_template(USER, chat_template=source, tokenize=True))
    assert counter.count_chat(USER, add_generation_prompt=False) == len(ids) == 6
