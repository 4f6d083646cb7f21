"""The simulator's prompt paths besides the Hugging Face one, picked as vLLM picks them.

* ``mistral``: vLLM's mistral tokenizer mode. transformers' ``MistralCommonBackend`` (the
  class vLLM wraps) turns the OpenAI messages into mistral_common's request and encodes it;
  completions are ``backend(text, add_special_tokens=...)``.
* ``deepseek_v32`` / ``deepseek_v4``: DeepSeek's Python prompt encoders in place of the chat
  template, chosen from the architecture (``vllm_sim.deepseek_prompts``).
* ``harmony``: gpt-oss. Chats are rendered with the harmony library (``openai_harmony``,
  from the ``oss-harmony`` distribution vLLM depends on): a system message with the
  reasoning effort, a developer message with the instructions and tools, then the
  conversation; completions use the Hugging Face tokenizer.

Independent of kvgate: written from vLLM's behaviour, sharing no code with its counter.
"""

from __future__ import annotations

import copy
import datetime
import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_sim.chat_flags import (
    DEFAULT_FLAGS,
    ChatFlags,
    chat_kwargs,
    map_reasoning_effort,
    merge_kwargs,
)
from vllm_sim.deepseek_prompts import DeepseekSimTokenizer, architecture_mode
from vllm_sim.tokenization import (
    SINGLE_TOKEN_WORDS,
    PromptError,
    SimTokenizer,
    preprocess_messages,
)

# vLLM's harmony_utils.REASONING_EFFORT: the efforts a gpt-oss system message can carry.
HARMONY_EFFORTS = ("high", "medium", "low")


def pick_tokenizer_mode(model_dir: Path, requested: str = "auto") -> str:
    """vLLM's choice: gpt_oss config -> harmony; a DeepSeek V3.2 / V4 architecture -> its
    encoder mode; a Mistral tokenizer file with consolidated weights (or with no
    tokenizer.json at all) -> mistral; else hf."""
    try:
        with open(model_dir / "config.json", encoding="utf-8") as fh:
            is_gpt_oss = json.load(fh).get("model_type") == "gpt_oss"
    except (OSError, ValueError, AttributeError):
        is_gpt_oss = False
    if requested != "auto":
        return "harmony" if is_gpt_oss else requested
    if is_gpt_oss:
        return "harmony"
    encoder_mode = architecture_mode(model_dir)
    if encoder_mode is not None:
        return encoder_mode
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
        return HarmonySimTokenizer(model_dir)
    if mode in ("deepseek_v32", "deepseek_v4"):
        return DeepseekSimTokenizer(model_dir, mode)
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
        if (
            kwargs.get("chat_template") is not None
            or kwargs.get("chat_template_kwargs") is not None
        ):
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
        # vLLM's keywords (chat_kwargs: the server's defaults and tools under the request's
        # fields, the effort mapped), as MistralTokenizer.apply_chat_template takes them: it
        # pops the generation switches and tokenizer options and hands the rest
        # (reasoning_effort, the defaults, ...) to mistral_common's
        # ChatCompletionRequest.from_openai, which keeps the fields it knows (a
        # reasoning_effort its tokenizer version does not support is refused) and drops the
        # others. A --chat-template travels along unused.
        flags = kwargs.get("flags") or DEFAULT_FLAGS
        tools = kwargs.get("tools")
        options = chat_kwargs(
            None,
            tools=_vllm_tool_dump(tools) if tools is not None else None,
            documents=kwargs.get("documents"),
            reasoning_effort=getattr(messages, "reasoning_effort", None),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            flags=flags,
            tokenize=True,
        )
        options = merge_kwargs(options, {"chat_template": flags.chat_template})
        for own in ("add_generation_prompt", "continue_final_message", "tokenize"):
            options.pop(own, None)
        for dropped in ("return_tensors", "return_dict"):
            options.pop(dropped, None)
        tool_dicts = options.pop("tools", None)
        padding = options.pop("padding", False)
        truncation = options.pop("truncation", False)
        max_length = options.pop("max_length", None)
        try:
            ids = self._tok.apply_chat_template(
                shaped,
                tools=tool_dicts,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                padding=padding,
                truncation=truncation,
                max_length=max_length,
                return_dict=False,
                **options,
            )
        except Exception as exc:  # vLLM turns mistral_common's errors into ValueError
            raise PromptError(str(exc)) from exc
        return list(ids)

    @property
    def special_ids(self) -> list[int]:
        inner = self._tok.tokenizer.instruct_tokenizer.tokenizer
        return [i for i in range(inner.n_words) if inner.is_special(i)]


class HarmonySimTokenizer(SimTokenizer):
    """gpt-oss: chats rendered by the harmony library the way vLLM's chat server does;
    completions, decoding and output words through the Hugging Face tokenizer."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self._harmony = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        # vLLM's switch: instructions in the system message rather than a developer one.
        self.system_instructions = bool(
            int(os.environ.get("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", "0"))
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        from openai_harmony import Conversation, RenderConversationConfig, Role

        preprocess_messages(messages, "openai")  # text parts only, as the HF path
        flags: ChatFlags = kwargs.get("flags") or DEFAULT_FLAGS
        # _make_request_with_harmony: the request's effort as --reasoning-effort-map rewrites
        # it sets the system message's "Reasoning:" line (none of the other chat flags but
        # the tools' exclusion, applied by the server, reach harmony).
        effort = map_reasoning_effort(
            getattr(messages, "reasoning_effort", None), flags.reasoning_effort_map
        )
        if effort == "none":
            raise PromptError(f"Harmony does not support reasoning_effort={effort!r}")
        if effort is not None and effort not in HARMONY_EFFORTS:
            raise PromptError(
                f"reasoning_effort={effort!r} is not supported by Harmony. "
                f"Supported values are: {', '.join(HARMONY_EFFORTS)}."
            )
        try:
            built = _harmony_request(
                copy.deepcopy(list(messages)),
                kwargs.get("tools"),
                self.system_instructions,
                effort,
            )
            kept = _without_superseded_reasoning(built)
            ids = self._harmony.render_conversation_for_completion(
                Conversation.from_messages(kept),
                Role.ASSISTANT,
                config=RenderConversationConfig(auto_drop_analysis=False),
            )
            return _older_tool_call_headers(self._harmony, list(ids))
        except PromptError:
            raise
        except Exception as exc:  # vLLM answers harmony failures 400
            raise PromptError(str(exc)) from exc

    def count_text(self, text: str) -> int:
        return len(self._harmony.encode(text, disallowed_special=()))


def _flatten(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    found: list[str] = []
    for item in content:
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict) and item.get("text") is not None:
            found.append(item["text"])
    return "".join(found) if found else None


def _harmony_system(instructions: str | None, effort: str | None = None) -> Any:
    from openai_harmony import Message, ReasoningEffort, Role, SystemContent

    system = SystemContent.new()
    if effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    if instructions is not None:
        identity = system.model_identity
        system = system.with_model_identity(
            instructions if not identity else identity + "\n" + instructions
        )
    system = system.with_conversation_start_date(datetime.datetime.now().strftime("%Y-%m-%d"))
    return Message.from_role_and_content(Role.SYSTEM, system)


def _harmony_developer(instructions: str | None, tools: Any, in_system: bool = False) -> Any:
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    dev = DeveloperContent.new()
    if instructions is not None and not in_system:
        dev = dev.with_instructions(instructions)
    functions = [
        ToolDescription.new(
            name=t["function"]["name"],
            description=t["function"].get("description") or "",
            parameters=t["function"].get("parameters"),
        )
        for t in tools or []
        if t.get("type", "function") == "function"
    ]
    if functions:
        dev = dev.with_function_tools(functions)
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def _harmony_request(
    messages: list[dict[str, Any]], tools: Any, in_system: bool = False, effort: str | None = None
) -> list[Any]:
    from openai_harmony import Author, Message, Role, TextContent

    instructions = None
    if messages and messages[0].get("role") in ("system", "developer"):
        instructions = _flatten(messages[0].get("content"))
        messages = messages[1:]
    if in_system:
        out: list[Any] = [_harmony_system(instructions, effort)]
        if tools:
            out.append(_harmony_developer(None, tools, in_system=True))
    else:
        out = [_harmony_system(None, effort)]
        if instructions or tools:
            out.append(_harmony_developer(instructions, tools))

    call_names: dict[Any, Any] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            call_names[call.get("id")] = call.get("function", {}).get("name")

    for m in messages:
        role = m.get("role")
        # vLLM's request model renames the older reasoning_content to reasoning.
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            said = _flatten(m.get("content"))
            if said:
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, said).with_channel("commentary")
                )
            if reasoning:
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel(
                        "analysis"
                    )
                )
            for call in calls:
                fn = call.get("function", {})
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, fn.get("arguments", "") or "")
                    .with_channel("commentary")
                    .with_recipient(f"functions.{fn.get('name', '')}")
                    .with_content_type("json")
                )
            continue
        if role == "tool":
            name = call_names.get(m.get("tool_call_id", ""), "")
            out.append(
                Message.from_author_and_content(
                    Author.new(Role.TOOL, f"functions.{name}"), _flatten(m.get("content")) or ""
                )
                .with_channel("commentary")
                .with_recipient("assistant")
            )
            continue
        if role == "assistant" and reasoning:
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
            )
        content = m.get("content") or ""
        texts = (
            [TextContent(text=content)]
            if isinstance(content, str)
            else [TextContent(text=c.get("text", "")) for c in content]
        )
        if role == "assistant":
            if texts and texts[0].text:
                out.append(Message.from_role_and_contents(role, texts).with_channel("final"))
        elif role in ("system", "developer"):
            said = _flatten(m.get("content"))
            if said is not None and role == "system" and in_system:
                out.append(_harmony_system(said))
            elif said is not None:
                out.append(_harmony_developer(said, None, in_system))
        else:
            out.append(Message.from_role_and_contents(role, texts))
    return out


def _without_superseded_reasoning(messages: list[Any]) -> list[Any]:
    finals = [
        i for i, m in enumerate(messages) if m.author.role == "assistant" and m.channel == "final"
    ]
    cut = finals[-1] if finals else -1
    return [m for i, m in enumerate(messages) if i >= cut or m.channel != "analysis"]


def _older_tool_call_headers(encoding: Any, ids: list[int]) -> list[int]:
    """vLLM feeds gpt-oss prior tool calls as ``assistant to=R<|channel|>C T``."""

    def special(text: str) -> int:
        return int(encoding.encode(text, allowed_special="all")[0])

    start, channel, constrain, message = (
        special(t) for t in ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
    )
    pos = 0
    while pos < len(ids):
        if ids[pos] != start:
            pos += 1
            continue
        try:
            end = ids.index(message, pos + 1)
            ch = ids.index(channel, pos + 1, end)
            co = ids.index(constrain, ch + 1, end)
        except ValueError:
            pos += 1
            continue
        author = encoding.decode(ids[pos + 1 : ch])
        middle = encoding.decode(ids[ch + 1 : co])
        kind = encoding.decode(ids[co + 1 : end])
        if author != "assistant" or " to=" not in middle or not middle.endswith(" "):
            pos = end + 1
            continue
        chan, recipient = middle[:-1].split(" to=", 1)
        if not (chan and recipient and kind):
            pos = end + 1
            continue
        header = [
            start,
            *encoding.encode(f"assistant to={recipient}"),
            channel,
            *encoding.encode(f"{chan} {kind}"),
            message,
        ]
        ids[pos : end + 1] = header
        pos += len(header)
    return ids
