"""PromptCounter counts what vLLM counts; transformers is the reference renderer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvgate.tokenize import PromptCounter, PromptRenderError, normalize_tools, parse_messages
from tests.tokenize.conftest import input_ids


def _flags(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }


def test_corpus_is_varied(chat_corpus: list[dict[str, Any]]) -> None:
    assert len(chat_corpus) >= 20
    assert sum("tools" in body for body in chat_corpus) >= 5
    roles = {m["role"] for body in chat_corpus for m in body["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert any(isinstance(m.get("content"), list) for body in chat_corpus for m in body["messages"])
    assert any(
        isinstance(c["function"]["arguments"], str)
        for body in chat_corpus
        for m in body["messages"]
        for c in m.get("tool_calls") or []
    )


def test_chat_parity_with_transformers(
    counter: PromptCounter, hf_tokenizer: Any, chat_corpus: list[dict[str, Any]]
) -> None:
    """vLLM = preprocess messages/tools, then transformers' apply_chat_template."""
    for i, body in enumerate(chat_corpus):
        messages, tools, flags = body["messages"], body.get("tools"), _flags(body)
        # What vLLM hands to transformers (our preprocessing is tested on its own below).
        conversation = parse_messages(messages, "string")
        shaped_tools = normalize_tools(tools)
        reference_text = hf_tokenizer.apply_chat_template(
            conversation, tools=shaped_tools, tokenize=False, **flags
        )
        reference_ids = input_ids(
            hf_tokenizer.apply_chat_template(
                conversation, tools=shaped_tools, tokenize=True, **flags
            )
        )
        assert counter.render_chat(messages, tools, **flags) == reference_text, i
        assert counter.count_chat(messages, tools, **flags) == len(reference_ids), i
        # vLLM encodes the rendered prompt without special tokens: same ids.
        assert counter.encode(reference_text, add_special_tokens=False) == reference_ids, i


def test_chat_does_not_mutate_request(counter: PromptCounter, chat_corpus: list[dict]) -> None:
    before = json.dumps(chat_corpus)
    for body in chat_corpus:
        counter.count_chat(body["messages"], body.get("tools"), **_flags(body))
    assert json.dumps(chat_corpus) == before


def test_rendered_shape(counter: PromptCounter) -> None:
    text = counter.render_chat(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x":1,  "y": "é"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ],
        [{"type": "function", "function": {"name": "f"}}],
    )
    assert "<|im_start|>user\na\nb<|im_end|>" in text
    # String arguments were parsed and re-serialised by tojson (vLLM's behaviour).
    assert '{"name": "f", "arguments": {"x": 1, "y": "é"}}' in text
    # A tool without description/parameters is shown the way vLLM's model_dump shows it.
    assert '{"type": "function", "function": {"name": "f", "description": null, ' in text
    assert text.endswith("<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n")


def test_count_chat_flags(counter: PromptCounter) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with_prompt = counter.count_chat(msgs)
    without = counter.count_chat(msgs, add_generation_prompt=False)
    assert with_prompt - without == 3  # "<|im_start|>", "assistant", "\n"
    # Qwen adds no BOS, so add_special_tokens=True changes nothing here.
    assert counter.count_chat(msgs, add_special_tokens=True) == with_prompt


def test_continue_final_message(counter: PromptCounter) -> None:
    msgs = [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1, 2, 3,"},
    ]
    text = counter.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2, 3,")
    with pytest.raises(PromptRenderError):
        counter.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)


def test_count_completion(counter: PromptCounter, hf_tokenizer: Any) -> None:
    text = "Once upon a time, in a land far away — 很久很久以前 🏰"
    expected = len(hf_tokenizer(text, add_special_tokens=True)["input_ids"])
    assert counter.count_completion(text) == expected
    assert counter.count_completion([1, 2, 3, 4]) == 4
    # A batch: vLLM runs one generation per prompt; the count is the total.
    assert counter.count_completion([text, "hello"]) == expected + counter.count_text("hello")
    assert counter.count_completion([[1, 2], [3, 4, 5]]) == 5
    assert counter.count_completion("") == 0
    for bad in ([], [1, "a"], [[1], []], [-1], [True], 5, None, [{"text": "x"}]):
        with pytest.raises(PromptRenderError):
            counter.count_completion(bad)  # type: ignore[arg-type]


def test_count_text(counter: PromptCounter, hf_tokenizer: Any) -> None:
    text = "The answer is 42.\n\n```py\nprint('hi')\n```<|im_end|>"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert counter.count_text(text) == len(ids)
    assert counter.count_text("<|im_end|>") == 1  # special tokens in text count once
    assert counter.count_text("") == 0
    with pytest.raises(PromptRenderError):
        counter.count_text(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("messages", "tools", "fragment"),
    [
        ("hello", None, "messages must be a list"),
        ([], None, "at least one message"),
        (["hi"], None, "must be an object"),
        ([{"content": "no role"}], None, "'role'"),
        ([{"role": "user", "content": 5}], None, "content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            None,
            "takes no images",
        ),
        ([{"role": "user", "content": [{"image_url": "x"}]}], None, "only text"),
        ([{"role": "user", "content": [{"foo": 1}]}], None, "no 'type'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None, "string"),
        ([{"role": "wizard", "content": "hi"}], None, "Unsupported message role"),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
            None,
            "only allowed as the first",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
            None,
            "'function'",
        ),
        ([{"role": "user", "content": "hi"}], [{"type": "function"}], "string 'name'"),
        ([{"role": "user", "content": "hi"}], [{"type": "retrieval"}], "type 'function'"),
        ([{"role": "user", "content": "hi"}], {"a": 1}, "tools must be a list"),
    ],
)
def test_bad_requests_raise_prompt_render_error(
    counter: PromptCounter, messages: Any, tools: Any, fragment: str
) -> None:
    with pytest.raises(PromptRenderError) as info:
        counter.count_chat(messages, tools)
    assert fragment in info.value.client_message
    assert isinstance(info.value, ValueError)


def test_bad_chat_template_kwargs(counter: PromptCounter) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(PromptRenderError):
        counter.count_chat(msgs, chat_template_kwargs={"tokenize": True})
    # Unknown kwargs are dropped (vLLM forwards only variables the template reads).
    assert counter.count_chat(msgs, chat_template_kwargs={"enable_thinking": False}) == (
        counter.count_chat(msgs)
    )


# --- special tokens for other tokenizer families ---------------------------------------


def _tiny_model(tmp_path: Path, *, post_processor: bool, **config: Any) -> Path:
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor:
        # Llama-style: the tokenizer.json itself adds BOS.
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
        **config,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_bos_from_post_processor(tmp_path: Path) -> None:
    counter = PromptCounter.from_model_dir(_tiny_model(tmp_path, post_processor=True))
    assert counter.special_tokens_added == 1
    assert counter.count_completion("hello world") == 3
    assert counter.encode("hello", add_special_tokens=True) == [0, 3]
    # Chat: the template writes BOS itself and vLLM encodes without specials.
    assert counter.count_chat([{"role": "user", "content": "hello"}]) == 2


def test_add_bos_token_flags_override(tmp_path: Path) -> None:
    off = PromptCounter.from_model_dir(
        _tiny_model(tmp_path, post_processor=True, add_bos_token=False)
    )
    assert off.special_tokens_added == 0
    both = tmp_path / "both"
    both.mkdir()
    on = PromptCounter.from_model_dir(
        _tiny_model(both, post_processor=False, add_bos_token=True, add_eos_token=True)
    )
    assert on.encode("hello", add_special_tokens=True) == [0, 3, 1]
    assert on.count_completion("hello world") == 4


def test_model_without_chat_template(tmp_path: Path) -> None:
    path = _tiny_model(tmp_path, post_processor=False, chat_template=None)
    counter = PromptCounter.from_model_dir(path)
    assert not counter.has_chat_template
    with pytest.raises(PromptRenderError):
        counter.count_chat([{"role": "user", "content": "hello"}])
    assert counter.count_completion("hello") == 1
