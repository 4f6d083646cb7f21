"""Turning OpenAI chat messages and tools into what vLLM hands the chat template.

Matched against vLLM's ``vllm/entrypoints/chat_utils.py`` (``_parse_chat_message_content``,
``_parse_chat_message_content_parts``, ``_postprocess_messages``), its chat request
model (``reasoning_content`` renamed to ``reasoning``) and ``tool.model_dump()`` of its
``ChatCompletionToolsParam``. What we reproduce:

* content ``None`` -> no parts; a string -> one text part; a list -> its parts. Parts may
  be plain strings or dicts typed ``text`` / ``input_text`` / ``output_text`` (key
  ``text``), ``refusal`` (key ``refusal``) or ``thinking`` (key ``thinking``). A ``text``
  or ``refusal`` part whose value is missing is skipped.
* For "string"-format templates the texts are joined with ``"\\n"`` (an empty list gives
  ``""``); for "openai"-format templates each becomes ``{"type": "text", "text": ...}``.
* Only these keys survive: ``role``, ``content``; for assistants ``tool_calls`` (when
  not None) and ``reasoning``/``reasoning_content``; for tools ``tool_call_id``, and list
  content that is all text re-joined with ``"\\n"``; ``name`` and ``task`` when strings;
  for ``developer`` messages ``tools``.
* Assistant ``tool_calls``: an empty list is dropped; each ``function.arguments`` given
  as a JSON string is parsed into a dict (invalid JSON -> ``{}``); anything that is not a
  dict or list becomes ``{}``.
* Tools are re-shaped like pydantic's ``model_dump()``: ``{"type", "function": {"name",
  "description", "parameters", <extra keys>}, <extra keys>}`` with missing
  ``description``/``parameters`` present as ``None`` (so ``tojson`` prints ``null``).

Differences: media parts (images, audio, video, files) are rejected, since this gateway
counts text-only prompts; we do not re-validate every field the way vLLM's pydantic
models do (e.g. a tool call without ``id`` is accepted here).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kvgate.tokenize.chat_template import ContentFormat
from kvgate.tokenize.errors import PromptRenderError

_TEXT_KEY_BY_TYPE = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_IF_MISSING = frozenset({"text", "refusal"})
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "file",
)


def _part_text(part: Any, index: int, where: str) -> tuple[str, str | None]:
    """Return (kind, text) of one content part; kind is "text" or "tool_reference"."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, Mapping):
        raise PromptRenderError(f"{where}: content part {index} must be an object or a string")
    part_type = part.get("type")
    if part_type is None:
        media = next((k for k in _MEDIA_KEYS if k in part), None)
        if media is not None:
            raise PromptRenderError(
                f"{where}: content part {index} is {media!r}; only text is supported"
            )
        if "tool_reference" in part:
            return "tool_reference", _require_str(part.get("tool_reference"), index, where)
        raise PromptRenderError(f"{where}: content part {index} has no 'type'")
    if not isinstance(part_type, str):
        raise PromptRenderError(f"{where}: content part {index} has an invalid 'type'")
    if part_type in _TEXT_KEY_BY_TYPE:
        value = part.get(_TEXT_KEY_BY_TYPE[part_type])
        if value is None and part_type in _SKIP_IF_MISSING:
            return "text", None  # vLLM logs and skips these
        return "text", _require_str(value, index, where)
    if part_type == "tool_reference":
        return "tool_reference", _require_str(part.get("name"), index, where)
    raise PromptRenderError(
        f"{where}: content part type {part_type!r} is not supported; only text is"
    )


def _require_str(value: Any, index: int, where: str) -> str:
    if not isinstance(value, str):
        raise PromptRenderError(f"{where}: content part {index} must carry a string")
    return value


def _parse_content(content: Any, fmt: ContentFormat, where: str) -> str | list[dict[str, str]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise PromptRenderError(f"{where}: content must be a string, a list of parts or null")

    if fmt == "openai":
        wrapped: list[dict[str, str]] = []
        for i, part in enumerate(parts):
            kind, text = _part_text(part, i, where)
            if text is None:
                continue
            if kind == "tool_reference":
                wrapped.append({"type": "tool_reference", "name": text})
            else:
                wrapped.append({"type": "text", "text": text})
        return wrapped

    texts = []
    for i, part in enumerate(parts):
        _, text = _part_text(part, i, where)
        if text is not None:
            texts.append(text)
    return "\n".join(texts)


def parse_messages(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """OpenAI ``messages`` -> the conversation vLLM renders. Never mutates the input."""
    if not isinstance(messages, list):
        raise PromptRenderError("messages must be a list")
    conversation: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise PromptRenderError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptRenderError(f"{where}: 'role' must be a string")
        out: dict[str, Any] = {
            "role": role,
            "content": _parse_content(message.get("content"), fmt, where),
        }

        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                if not isinstance(tool_calls, list):
                    raise PromptRenderError(f"{where}: 'tool_calls' must be a list")
                out["tool_calls"] = copy.deepcopy(tool_calls)
            # The request model renames the older ``reasoning_content`` to ``reasoning``.
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            content = out["content"]
            if isinstance(content, list) and all(p.get("type") == "text" for p in content):
                # Most templates expect a tool result as a plain string.
                out["content"] = "\n".join(p["text"] for p in content)

        name = message.get("name")
        if isinstance(name, str):
            out["name"] = name
        task = message.get("task")
        if isinstance(task, str):
            out["task"] = task
        if role == "developer":
            out["tools"] = copy.deepcopy(message.get("tools"))
        conversation.append(out)

    _postprocess_tool_calls(conversation)
    return conversation


def _postprocess_tool_calls(conversation: list[dict[str, Any]]) -> None:
    for i, message in enumerate(conversation):
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not tool_calls:
            del message["tool_calls"]  # keeps templates on the plain-assistant path
            continue
        for j, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, dict):
                raise PromptRenderError(
                    f"messages[{i}].tool_calls[{j}] must be an object with a 'function' object"
                )
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                # Templates expect arguments as a mapping (transformers' convention).
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    function["arguments"] = {}
            elif not isinstance(arguments, dict | list):
                function["arguments"] = {}


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Request ``tools`` -> the dicts vLLM passes to the template (``model_dump()`` shape)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptRenderError("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise PromptRenderError(f"{where} must be an object")
        tool_type = tool.get("type", "function")
        if tool_type != "function":
            raise PromptRenderError(f"{where}: only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptRenderError(f"{where}: 'function' must be an object with a string 'name'")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise PromptRenderError(f"{where}: function 'description' must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise PromptRenderError(f"{where}: function 'parameters' must be an object")
        # Declared fields first, in model order; unknown keys follow in input order.
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": description,
            "parameters": copy.deepcopy(parameters),
        }
        fn.update({k: copy.deepcopy(v) for k, v in function.items() if k not in fn})
        shaped: dict[str, Any] = {"type": "function", "function": fn}
        shaped.update({k: copy.deepcopy(v) for k, v in tool.items() if k not in shaped})
        out.append(shaped)
    return out
