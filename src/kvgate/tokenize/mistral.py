"""Counting for models vLLM serves in its ``mistral`` tokenizer mode, with ``mistral_common``.

In that mode vLLM never renders a chat template: the OpenAI messages go, nearly as sent, to
``mistral_common``'s ``ChatCompletionRequest.from_openai`` and its ``encode_chat_completion``
(through transformers' MistralCommonBackend), which emits the control tokens itself and
encodes every text, special-token look-alikes included, as plain text. A completions prompt
is ``[BOS]`` + the text encoded the same way. So this counter calls the same library the
same way, on the same tokenizer file (``tekken.json`` or a SentencePiece
``tokenizer.model.v*``), and reproduces the request shaping vLLM does before the call:

* an assistant message without ``tool_calls`` gets an empty list;
* tool-call ids (and ``tool_call_id``) longer than 9 characters keep their last 9;
* ``chat_template_kwargs`` is refused, as is ``add_generation_prompt`` after a final
  assistant message and ``continue_final_message`` after any other;
* content parts without a ``type`` are dropped (transformers' adaptation), the rest go to
  mistral_common unchanged; tools are shaped like vLLM's ``model_dump()`` of them.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.tokenize.counter import CountingApi, CountPlan
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError
from kvgate.tokenize.messages import parse_messages
from kvgate.tokenize.request_fields import sent_by_client
from kvgate.tokenize.segments import MIN_CACHED_CHARS, SegmentCountCache, segment_key

if TYPE_CHECKING:
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        ChatMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.base import Tokenized
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

# vLLM's Mistral tool-call ids are 9 characters: longer ones keep their tail.
_TOOL_CALL_ID_CHARS = 9
_TOOL_FUNCTION_FIELDS = ("name", "description", "parameters")


def mistral_tokenizer_file(model_dir: Path) -> Path | None:
    """The file mistral_common would load from ``model_dir`` (tekken.json first), or None."""
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file

    try:
        name = get_one_valid_tokenizer_file(sorted(os.listdir(model_dir)))
    except (ValueError, OSError):
        return None
    return model_dir / name


class MistralPromptCounter(CountingApi):
    """Counts tokens for one Mistral-format model. Thread-safe: no per-call state."""

    engine = "mistral-common"
    engine_reason = "the model is served in vLLM's mistral tokenizer mode"
    # mistral_common builds every chat prompt itself (no template file, none needed).
    has_chat_template = True

    def __init__(
        self,
        tokenizer: MistralTokenizer[
            UserMessage, AssistantMessage, ToolMessage, SystemMessage, Tokenized
        ],
        *,
        name: str = "",
    ) -> None:
        self.name = name
        self._mistral = tokenizer
        self._text = tokenizer.instruct_tokenizer.tokenizer
        self._cache: SegmentCountCache | None = None
        self._cache_scope = os.urandom(16)
        # A chat's characters weighed against the compiled BPE's (what the service's inline
        # bound is set in): a whole mistral_common encode costs about 4x that per character
        # with tekken, 8x with SentencePiece (measured on 52k-character chats).
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._chat_cost_per_char = 4 if isinstance(self._text, Tekkenizer) else 8

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, *, name: str = "") -> MistralPromptCounter:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = Path(model_dir)
        file = mistral_tokenizer_file(path)
        if file is None:
            raise TokenizerLoadError(
                str(path), "no tekken.json or SentencePiece tokenizer.model.v* to load"
            )
        try:
            # vLLM loads Mistral tokenizers in test mode (it refuses any other).
            tokenizer = MistralTokenizer.from_file(str(file), mode=ValidationMode.test)
        except Exception as exc:  # a broken file or a missing optional backend is fatal
            raise TokenizerLoadError(str(file), str(exc)) from exc
        if getattr(tokenizer.instruct_tokenizer.tokenizer, "model_settings_builder", None):
            # Such tokenizers write the request's reasoning_effort and response_format (a
            # JSON schema of any size) into the prompt; the counter is not given them, so it
            # would count low: refuse to start rather than admit on a short count.
            raise TokenizerLoadError(
                str(file),
                "this tokenizer encodes model settings (reasoning_effort, response_format) "
                "into the prompt, which kvgate does not count yet",
            )
        return cls(tokenizer, name=name or path.name)

    def use_cache(self, cache: SegmentCountCache | None) -> None:
        self._cache = cache

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in UTF-8 bytes: no token covers more characters."""
        return max(1, max(len(piece.encode("utf-8", "replace")) for piece in self._text.vocab()))

    @property
    def special_tokens_added(self) -> int:
        return 1  # vLLM's encode: BOS when add_special_tokens, never EOS

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._text.encode(text, bos=add_special_tokens, eos=False)
        return ids

    def _count_plain(self, text: str) -> int:
        return len(self._text.encode(text, bos=False, eos=False))

    # -- text: completions prompts and output ---------------------------------------------

    def plan_text(self, text: str, *, add_special_tokens: bool, cache: bool = True) -> CountPlan:
        """All of ``text`` is plain text here: one segment, cached when long."""
        known = self.special_tokens_added if add_special_tokens else 0
        if not text:
            return CountPlan(known, [], 0)
        if len(text) < MIN_CACHED_CHARS:
            return CountPlan(known + self._count_plain(text), [], 0)
        store = self._cache if cache else None
        key = segment_key(self._cache_scope, text) if store is not None else None
        cached = store.get(key) if store is not None and key is not None else None
        if cached is not None:
            return CountPlan(known + cached, [], 0)
        return CountPlan(known, [(key, text)], len(text))

    def finish(self, plan: CountPlan) -> int:
        total = plan.known
        store = self._cache
        for key, segment in plan.pending:
            n = self._count_plain(segment)
            if key is not None and store is not None:
                store.put(key, n)
            total += n
        return total + sum(job() for job in plan.deferred)

    # -- chat --------------------------------------------------------------------------------

    def plan_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> CountPlan:
        """Shape and validate the request now; encoding it is the deferred part."""
        del add_special_tokens  # vLLM takes the ids of encode_chat_completion as they are
        request = self.chat_request(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        chars = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, Mapping))
        weighted = chars * self._chat_cost_per_char
        return CountPlan(0, [], weighted, (lambda: len(self._encode_request(request)),))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids vLLM would run for this chat request."""
        return self._encode_request(
            self.chat_request(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
        )

    def chat_request(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> ChatCompletionRequest[ChatMessage]:
        """mistral_common's request for these messages, shaped as vLLM shapes it."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        if sent_by_client(chat_template_kwargs):
            raise PromptRenderError("chat_template_kwargs is not supported for Mistral tokenizers")
        # Text parts only, with the same refusals as every other model.
        parse_messages(messages, "string")
        if not messages:
            raise PromptRenderError("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise PromptRenderError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        last_role = messages[-1].get("role")
        if add_generation_prompt and last_role == "assistant":
            raise PromptRenderError(
                "add_generation_prompt cannot follow a final assistant message; "
                "use continue_final_message"
            )
        if continue_final_message and last_role != "assistant":
            raise PromptRenderError(
                "continue_final_message needs the last message to be from the assistant"
            )
        shaped = [_shape_message(m, i) for i, m in enumerate(messages)]
        try:
            return ChatCompletionRequest.from_openai(
                messages=shaped,
                tools=_shape_tools(tools),
                continue_final_message=continue_final_message,
            )
        except Exception as exc:  # pydantic and mistral_common validation errors
            raise PromptRenderError(f"the request does not fit the Mistral format: {exc}") from exc

    def _encode_request(self, request: ChatCompletionRequest[ChatMessage]) -> list[int]:
        try:
            tokens: list[int] = self._mistral.encode_chat_completion(request).tokens
        except Exception as exc:  # mistral_common asserts and raises its own exceptions
            raise PromptRenderError(f"the request does not fit the Mistral format: {exc}") from exc
        return tokens


def _shape_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    out = copy.deepcopy(dict(message))
    role = out.get("role")
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise PromptRenderError(f"messages[{index}]: content parts must be objects")
            if part.get("type"):
                parts.append(dict(part))
        out["content"] = parts
    if role == "assistant":
        calls = out.get("tool_calls")
        if calls is None:
            calls = []
        if not isinstance(calls, list):
            raise PromptRenderError(f"messages[{index}]: 'tool_calls' must be a list")
        for j, call in enumerate(calls):
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                raise PromptRenderError(f"messages[{index}].tool_calls[{j}] needs a string 'id'")
            call["id"] = call["id"][-_TOOL_CALL_ID_CHARS:]
        out["tool_calls"] = calls
    elif role in ("tool", "tool_results") and isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = out["tool_call_id"][-_TOOL_CALL_ID_CHARS:]
    return out


def _shape_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM dumps its request model: declared fields only, missing ones as None."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptRenderError("tools must be a list")
    shaped = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptRenderError(f"tools[{i}]: 'function' must be an object with a 'name'")
        if tool.get("type", "function") != "function":
            raise PromptRenderError(f"tools[{i}]: only tools of type 'function' are supported")
        fn: dict[str, Any] = {k: copy.deepcopy(function.get(k)) for k in _TOOL_FUNCTION_FIELDS}
        if function.get("strict") is not None:
            fn["strict"] = function["strict"]
        # vLLM copies the tool's defer_loading onto its function when that has none.
        defer = function.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        entry: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        shaped.append(entry)
    return shaped
