"""Turning OpenAI chat messages and tools into what vLLM hands the chat template.

Reproduces vLLM 0.34's request preprocessing for Hugging Face templates
(``vllm/renderers/chat_utils/chat_message.py``: ``parse_chat_message_content``,
``_strip_claude_code_billing_header``, ``_postprocess_messages``; ``vllm/renderers/hf.py``:
``_convert_developer_to_system``, ``_consolidate_system_messages``; the request model's
``reasoning_content`` -> ``reasoning`` rename and ``ChatCompletionToolsParam.model_dump()``):

* content ``None`` -> no parts; a string -> one text part; a list -> its parts. Parts may
  be plain strings or dicts typed ``text`` / ``input_text`` / ``output_text`` (key
  ``text``), ``refusal`` (key ``refusal``) or ``thinking`` (key ``thinking``). A ``text``
  or ``refusal`` part whose value is missing is skipped.
* A system message's text part that starts with ``x-anthropic-billing-header`` loses its
  first line (the whole part when nothing follows it): Claude Code's per-request
  attribution line, which vLLM drops so the prefix cache keeps working.
* For "string"-format templates the non-empty texts are joined with ``"\\n"`` (an empty
  list gives ``""``); for "openai"-format templates each becomes ``{"type": "text", "text": ...}``.
* Only these keys survive: ``role``, ``content``; for assistants ``tool_calls`` (when
  not None) and ``reasoning``/``reasoning_content``; for tools ``tool_call_id``, and list
  content that is all text re-joined with ``"\\n"``; ``name`` and ``task`` when strings;
  for ``developer`` messages ``tools``.
* Assistant ``tool_calls``: an empty list is dropped; each call must be a function call;
  ``function.arguments`` that is empty becomes ``{}``, a JSON string is parsed, and
  whatever is not then a JSON object (invalid JSON, ``[]``, ``42``, a list given as is)
  becomes ``{}``.
* Tools are re-shaped like their pydantic ``model_dump()``: ``{"type", "function":
  {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[,
  "defer_loading"]}``; unknown keys are dropped, ``description``/``parameters`` are
  present as ``None`` when missing (``tojson`` prints ``null``), ``strict`` and
  ``defer_loading`` only when set (a tool-level ``defer_loading`` is copied onto the
  function when the function has none).
* When the request has a ``developer`` message and the template never names that role,
  developer messages become system messages and, if that leaves a system message
  anywhere but first (or several), all system texts are merged into one leading system
  message joined with a blank line (``developer_as_system``).

* An "openai" text part keeps the keys no content-part type declares (``cache_control``…),
  as vLLM's ``_collect_extra_fields`` does.

* Image parts (``image_url`` with ``image_url.url``, Responses' ``input_image`` with
  ``image_url``) when the caller collects images (a vision model): an "openai" part becomes
  ``{"type": "image", ...extra keys}``; in the "string" format the image placeholders are
  put before the joined text, one per image, joined with ``"\\n"`` (vLLM's
  ``get_full_multimodal_text_prompt`` without interleaving). Each image's URL is collected
  (``vision.ImageRef``) for the counter.

Differences: other media parts (audio, video, files, embeddings) are rejected, and image
parts too unless the model is a vision model kvgate counts; we do not re-validate every
field the way vLLM's pydantic models do (e.g. a tool call without ``id`` is accepted here, a
tool reference's name must be a string).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kvgate.tokenize.chat_template import ContentFormat
from kvgate.tokenize.errors import PromptRenderError
from kvgate.tokenize.vision import ImageRef

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
            # vLLM reads a typeless tool reference's name from "name", as a typed one.
            return "tool_reference", _require_str(part.get("name"), index, where)
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
    if part_type in _IMAGE_PART_TYPES:
        raise PromptRenderError(
            f"{where}.content[{index}]: this model takes no images (kvgate counts images "
            "only for the vision models it knows)"
        )
    raise PromptRenderError(
        f"{where}: content part type {part_type!r} is not supported; only text is"
    )


# Every key of the content-part types vLLM 0.34's request model declares (OpenAI's and its
# own); a text part's other keys (``cache_control``, ...) stay in its "openai" dict.
_DECLARED_PART_KEYS = frozenset(
    {
        "type",
        "text",
        "refusal",
        "thinking",
        "closed",
        "name",
        "uuid",
        "data",
        "file",
        "image_url",
        "image_pil",
        "image_embeds",
        "audio_url",
        "audio_embeds",
        "input_audio",
        "video_url",
        "video_embeds",
        "prompt_cache_breakpoint",
    }
)


def _extra_fields(part: Any) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        return {}
    return {k: copy.deepcopy(v) for k, v in part.items() if k not in _DECLARED_PART_KEYS}


def _require_str(value: Any, index: int, where: str) -> str:
    if not isinstance(value, str):
        raise PromptRenderError(f"{where}: content part {index} must carry a string")
    return value


BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop the attribution line Claude Code puts first in system text parts.

    Its value changes on every request; vLLM removes it so the prefix cache survives.
    Only parts that start with it change: the first line goes, an emptied part too.
    """
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


# Image part types and where each keeps its URL.
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})


def _image_url(part: Mapping[str, Any], index: int, where: str) -> str:
    """The URL of an image part (``image_url.url``; Responses' ``input_image``: ``image_url``)."""
    value = part.get("image_url")
    if part.get("type") == "image_url":
        value = value.get("url") if isinstance(value, Mapping) else None
        name = f"{where}.content[{index}].image_url.url"
    else:
        name = f"{where}.content[{index}].image_url"
    if not isinstance(value, str) or not value:
        raise PromptRenderError(f"{name} must be a non-empty string")
    return value


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in _IMAGE_PART_TYPES


def _parse_content(
    content: Any,
    fmt: ContentFormat,
    where: str,
    role: str,
    images: list[ImageRef] | None = None,
    placeholder: str = "",
) -> str | list[dict[str, Any]]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise PromptRenderError(f"{where}: content must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    image_parts = 0
    if images is not None:
        for i, part in enumerate(parts):
            if _is_image_part(part):
                images.append(
                    ImageRef(_image_url(part, i, where), f"{where}.content[{i}].image_url")
                )
                image_parts += 1

    if fmt == "openai":
        wrapped: list[dict[str, Any]] = []
        for i, part in enumerate(parts):
            if image_parts and _is_image_part(part):
                wrapped.append({"type": "image", **_extra_fields(part)})
                continue
            kind, text = _part_text(part, i, where)
            if text is None:
                continue
            if kind == "tool_reference":
                wrapped.append({"type": "tool_reference", "name": text})
            else:
                wrapped.append({"type": "text", "text": text, **_extra_fields(part)})
        return wrapped

    texts = []
    for i, part in enumerate(parts):
        if image_parts and _is_image_part(part):
            continue
        _, text = _part_text(part, i, where)
        # vLLM keeps only non-empty strings here (a wrapped "openai" part is never empty).
        if text:
            texts.append(text)
    # The images' placeholders go first, each its own line (vLLM without interleaving).
    return "\n".join([placeholder] * image_parts + (["\n".join(texts)] if texts else []))


def parse_messages(
    messages: Any,
    fmt: ContentFormat,
    images: list[ImageRef] | None = None,
    placeholder: str = "",
) -> list[dict[str, Any]]:
    """OpenAI ``messages`` -> the conversation vLLM renders. Never mutates the input.

    ``images``: a vision model's collector: image parts are kept (their URLs appended to it
    in order) and ``placeholder`` stands for each in the "string" format; None refuses them.
    """
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
            "content": _parse_content(
                message.get("content"), fmt, where, role, images, placeholder
            ),
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
            if not isinstance(function, dict) or call.get("type", "function") != "function":
                raise PromptRenderError(
                    f"messages[{i}].tool_calls[{j}] must be a function call with a "
                    "'function' object"
                )
            function["arguments"] = _arguments_object(function.get("arguments"))


def _arguments_object(arguments: Any) -> dict[str, Any]:
    """Templates need a mapping: a JSON string is parsed, anything else non-object is {}.

    vLLM coerces instead of refusing because a bad call lives on in the conversation's
    history and would fail every later turn.
    """
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    parsed: Any = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def developer_as_system(
    conversation: list[dict[str, Any]], template_source: str
) -> list[dict[str, Any]]:
    """What vLLM renders when a template does not know the ``developer`` role.

    A template "knows" it when its source holds the quoted word. Otherwise each developer
    message becomes a system message (its ``tools`` dropped) and, when that puts a system
    message anywhere but first or leaves several, every system text is merged into one
    first message (a templates such as Qwen 3.6 refuse a late system message).
    """
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in template_source or "'developer'" in template_source:
        return conversation
    converted = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    return _merge_system_messages(converted)


def _merge_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, dict) else part
                for part in content
                if (isinstance(part, dict) and "text" in part) or isinstance(part, str)
            )
        if content:
            texts.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


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
        # model_dump() of vLLM's tool model: declared fields only, optional flags only
        # when set; a tool-level defer_loading reaches the function when it has none.
        strict = _optional_bool(function.get("strict"), f"{where}: function 'strict'")
        tool_defer = _optional_bool(tool.get("defer_loading"), f"{where}: 'defer_loading'")
        defer = _optional_bool(function.get("defer_loading"), f"{where}: function 'defer_loading'")
        if defer is None:
            defer = tool_defer
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": description,
            "parameters": copy.deepcopy(dict(parameters)) if parameters is not None else None,
        }
        if strict is not None:
            fn["strict"] = strict
        if defer is not None:
            fn["defer_loading"] = defer
        shaped: dict[str, Any] = {"type": "function", "function": fn}
        if tool_defer is not None:
            shaped["defer_loading"] = tool_defer
        out.append(shaped)
    return out


_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def _optional_bool(value: Any, where: str) -> bool | None:
    """A pydantic (lax mode) ``bool | None`` field: what the model holds after validation."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.lower() in _TRUE_WORDS
    raise PromptRenderError(f"{where} must be a boolean")


def kwargs_tools(tools: Any) -> list[dict[str, Any]]:
    """Tools given in ``chat_template_kwargs``: the template gets them as sent."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise PromptRenderError("chat_template_kwargs.tools must be a list of objects")
    return copy.deepcopy(tools)
