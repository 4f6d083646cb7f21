"""Prompt counting and output-token generation with the model's own tokenizer.

This is deliberately independent of kvgate's counter: it goes through
``transformers.AutoTokenizer`` and ``apply_chat_template`` the way vLLM's chat path
does (render to text, then encode without special tokens), and preprocesses the
messages the way vLLM's ``parse_chat_messages`` does.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# Common English words; each one that the vocabulary holds as a single token (with
# its leading space) becomes a candidate output token. Concatenations of such
# " word" pieces re-tokenize to exactly one token per piece under byte-level BPE,
# because the pre-tokenizer splits before every space+letters run.
_WORDS: tuple[str, ...] = (
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "dog",
    "ran",
    "to",
    "park",
    "while",
    "it",
    "was",
    "sunny",
    "out",
    "there",
    "people",
    "like",
    "walk",
    "in",
    "evening",
    "when",
    "water",
    "is",
    "calm",
    "near",
    "old",
    "town",
    "each",
    "day",
    "we",
    "find",
    "more",
    "time",
    "for",
    "good",
    "work",
    "with",
    "friends",
    "who",
    "make",
    "things",
    "better",
)
# Public: tools that build prompts of known token counts use the same words.
SINGLE_TOKEN_WORDS = _WORDS

_CONTENT_LOOP = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+(?:message|msg|m)\s*(?:\.\s*content|\[\s*['\"]content['\"]\s*\])"
)


class PromptError(ValueError):
    """A request's prompt could not be rendered (bad template input, bad arguments)."""


def detect_content_format(chat_template: str | None) -> ContentFormat:
    """Guess vLLM's "auto" content format: "openai" when the template loops over a
    message's content parts, else "string" (parts joined with newlines)."""
    if chat_template and _CONTENT_LOOP.search(chat_template):
        return "openai"
    return "string"


def _text_of_part(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            value = part.get("text", part.get("refusal"))
            return value if isinstance(value, str) else None
    return None


def preprocess_messages(
    messages: Sequence[dict[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """Turn OpenAI-style messages into the conversation vLLM hands to the template."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = content
        else:
            raise PromptError(f"Unsupported content type for role {role!r}")

        texts: list[str] = []
        for part in parts:
            text = _text_of_part(part)
            if text is None:
                raise PromptError(f"Unsupported content part: {part!r} (vllm-sim serves text only)")
            # vLLM drops empty strings before joining, but keeps an empty part once
            # it is wrapped as a dict (the "openai" format).
            if text or content_format == "openai":
                texts.append(text)

        out: dict[str, Any] = {"role": role}
        if content_format == "openai":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)

        if role == "assistant" and message.get("tool_calls") is not None:
            out["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)

    # Chat templates expect tool-call arguments as objects, not the JSON strings
    # the OpenAI API carries; empty or missing arguments become {}.
    for out in conversation:
        if out["role"] != "assistant" or not isinstance(out.get("tool_calls"), list):
            continue
        for call in out["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if arguments:
                if not isinstance(arguments, (dict, list)):
                    try:
                        function["arguments"] = json.loads(arguments)
                    except (TypeError, ValueError) as exc:
                        raise PromptError(str(exc)) from exc
            else:
                function["arguments"] = {}
    return conversation


def normalize_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool dicts vLLM passes to the template (its pydantic ``model_dump``):
    declared keys first, missing optional ones as None, extra keys kept after."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise PromptError("each tool needs a 'function' object")
        if not isinstance(function.get("name"), str):
            raise PromptError("each tool function needs a 'name'")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        fn.update({k: v for k, v in function.items() if k not in fn})
        item: dict[str, Any] = {"type": tool.get("type", "function"), "function": fn}
        item.update({k: v for k, v in tool.items() if k not in item})
        out.append(item)
    return out


class SimTokenizer:
    """The served model's tokenizer plus the simulator's output vocabulary."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a server starts

        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)
        self.content_format = detect_content_format(self.chat_template)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.word_ids, self.word_texts = self._pick_word_tokens()

    def _pick_word_tokens(self) -> tuple[list[int], list[str]]:
        ids: list[int] = []
        texts: list[str] = []
        seen: set[int] = set()
        for word in _WORDS:
            piece = " " + word
            encoded = self._tok.encode(piece, add_special_tokens=False)
            if len(encoded) != 1 or encoded[0] in seen:
                continue
            if self._tok.decode(encoded) != piece:
                continue
            seen.add(encoded[0])
            ids.append(encoded[0])
            texts.append(piece)
        if len(ids) < 4:
            raise RuntimeError(
                f"vocabulary of {self.model_dir} has too few single-token words for output"
            )
        return ids, texts

    # --- prompt side -------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render like vLLM's ``apply_hf_chat_template`` (chat_template_kwargs win)."""
        conversation = preprocess_messages(messages, self.content_format)
        kwargs: dict[str, Any] = {
            "chat_template": chat_template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": normalize_tools(tools) if tools is not None else None,
            "documents": documents,
        }
        kwargs.update(chat_template_kwargs or {})
        try:
            rendered = self._tok.apply_chat_template(conversation, tokenize=False, **kwargs)
        except Exception as exc:
            # vLLM re-raises template failures as ValueError(str(e)) from e.
            raise PromptError(str(exc)) from exc
        if not isinstance(rendered, str):
            raise PromptError("chat template did not render to text")
        return rendered

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        add_special_tokens = bool(kwargs.pop("add_special_tokens", False))
        text = self.render_chat(messages, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_token(self, token_id: int) -> str:
        """One token as vLLM's logprobs show it: ``decode([id])``, special tokens kept."""
        return self._tok.decode([token_id])

    @property
    def special_ids(self) -> list[int]:
        return list(self._tok.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def count_text(self, text: str) -> int:
        """Tokens in plain text, as a gateway counting streamed output would."""
        return len(self._tok.encode(text, add_special_tokens=False))

    # --- output side -------------------------------------------------------------

    def output_token(self, index: int) -> tuple[int, str]:
        """The i-th visible output token (id, text) of every simulated generation."""
        k = index % len(self.word_ids)
        return self.word_ids[k], self.word_texts[k]
