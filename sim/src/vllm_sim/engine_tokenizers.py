"""The simulator's prompt paths besides the Hugging Face one, picked as vLLM picks them.

* ``mistral``: vLLM's mistral tokenizer mode. transformers' ``MistralCommonBackend`` (the
  class vLLM wraps) turns the OpenAI messages into mistral_common's request and encodes it;
  completions are ``backend(text, add_special_tokens=...)``.
* ``harmony``: gpt-oss. Chats are rendered with the harmony library (``openai_harmony``,
  from the ``oss-harmony`` distribution vLLM depends on): a system message with the
  reasoning effort, a developer message with the instructions and tools, then the
  conversation; completions use the Hugging Face tokenizer.

Independent of kvgate: written from vLLM's behaviour, sharing no code with its counter.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_sim.tokenization import (
    SINGLE_TOKEN_WORDS,
    PromptError,
    SimTokenizer,
    preprocess_messages,
)


def pick_tokenizer_mode(model_dir: Path, requested: str = "auto") -> str:
    """vLLM's choice: gpt_oss config -> harmony; a Mistral tokenizer file with
    consolidated weights (or with no tokenizer.json at all) -> mistral; else hf."""
    try:
        with open(model_dir / "config.json", encoding="utf-8") as fh:
            is_gpt_oss = json.load(fh).get("model_type") == "gpt_oss"
    except (OSError, ValueError, AttributeError):
        is_gpt_oss = False
    if requested != "auto":
        return "harmony" if is_gpt_oss else requested
    if is_gpt_oss:
        return "harmony"
    files = os.listdir(model_dir)
    mistral_file = any(
        f == "tekken.json" or fnmatch.fnmatch(f, "tokenizer.model.v*") for f in files
    )
    weights = any(fnmatch.fnmatch(f, "consolidated*.safetensors") for f in files)
    if mistral_file and (weights or "tokenizer.json" not in files):
        return "mistral"
    return "hf"


def load_sim_tokenizer(model_dir: Path, requested_mode: str = "auto") -> SimTokenizer:
    mode = pick_tokenizer_mode(Path(model_dir), requested_mode)
    if mode == "mistral":
        return MistralSimTokenizer(model_dir)
    if mode == "harmony":
        raise RuntimeError(f"{model_dir}: gpt-oss (harmony) models are not simulated")
    return SimTokenizer(model_dir)


def _vllm_tool_dump(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``tool.model_dump()``: declared fields, unset optional ones dropped."""
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PromptError("each tool needs a 'function' object with a 'name'")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            fn["strict"] = function["strict"]
        defer = function.get("defer_loading", tool.get("defer_loading"))
        if defer is not None:
            fn["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = tool["defer_loading"]
        out.append(dumped)
    return out


class MistralSimTokenizer(SimTokenizer):
    """A Mistral-format model (tekken.json or tokenizer.model.v*), as vLLM's mistral mode."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers.tokenization_mistral_common import MistralCommonBackend

        self.model_dir = Path(model_dir)
        self._tok = MistralCommonBackend.from_pretrained(str(self.model_dir), mode="test")
        self.chat_template = None
        self.content_format = "string"
        self.eos_token_id = self._tok.eos_token_id
        self.word_ids, self.word_texts = self._pick_word_tokens()

    def _pick_word_tokens(self) -> tuple[list[int], list[str]]:
        try:
            return super()._pick_word_tokens()
        except RuntimeError:
            pass
        # SentencePiece: " word" is the piece "▁word", which encodes alone from "word"
        # (the dummy prefix) and shows as " word" inside a text.
        ids: list[int] = []
        texts: list[str] = []
        for word in SINGLE_TOKEN_WORDS:
            encoded = self._tok.encode(word, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] not in ids:
                ids.append(encoded[0])
                texts.append(" " + word)
        if len(ids) < 4:
            raise RuntimeError(f"{self.model_dir}: too few single-token words for output")
        return ids, texts

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        if kwargs.get("chat_template") is not None or kwargs.get("chat_template_kwargs"):
            raise PromptError("chat_template is not supported for Mistral tokenizers.")
        add_generation_prompt = bool(kwargs.get("add_generation_prompt", True))
        continue_final_message = bool(kwargs.get("continue_final_message", False))
        preprocess_messages(messages, "string")  # text parts only, as the HF path
        if not messages:
            raise PromptError("messages must not be empty")
        if add_generation_prompt and continue_final_message:
            raise PromptError("Cannot set both add_generation_prompt and continue_final_message")
        last = messages[-1].get("role")
        if add_generation_prompt and last == "assistant":
            raise PromptError("Cannot set `add_generation_prompt` after an assistant message")
        if continue_final_message and last != "assistant":
            raise PromptError("Cannot set `continue_final_message` after a non-assistant")
        shaped = copy.deepcopy(list(messages))
        for message in shaped:
            if message.get("role") == "assistant":
                calls = message.get("tool_calls") or []
                for call in calls:
                    if len(call["id"]) > 9:
                        call["id"] = call["id"][-9:]
                message["tool_calls"] = calls
            elif message.get("role") in ("tool", "tool_results") and "tool_call_id" in message:
                message["tool_call_id"] = message["tool_call_id"][-9:]
        tools = kwargs.get("tools")
        try:
            ids = self._tok.apply_chat_template(
                shaped,
                tools=_vllm_tool_dump(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # vLLM turns mistral_common's errors into ValueError
            raise PromptError(str(exc)) from exc
        return list(ids)

    @property
    def special_ids(self) -> list[int]:
        inner = self._tok.tokenizer.instruct_tokenizer.tokenizer
        return [i for i in range(inner.n_words) if inner.is_special(i)]
