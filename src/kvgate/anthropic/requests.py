"""Anthropic Messages requests: validated, and converted into the chat request vLLM runs.

vLLM 0.34 serves ``POST /v1/messages`` by converting the Anthropic body into a chat
completion request and running its chat path on it
(``vllm/entrypoints/anthropic/serving.py``: ``to_chat_completion_request``). So the prompt
the engine counts is that chat request's prompt, and kvgate's canonical request for a
Messages body is exactly the converted chat request (:class:`MessagesRequest`, kind
``chat``): its messages, tools, tool choice, response format and template keywords are
what kvgate's chat counting already counts as the engine does. The client's own body is
kept (``wire_body``) for forwarding: the engine converts it itself.

The conversion, as vLLM does it:

* ``system`` (a string, or blocks of which only non-empty ``text`` ones count, minus any
  that start with ``x-anthropic-billing-header``) becomes one leading system message, the
  texts joined with nothing between them.
* A message whose content is a string keeps it. Block content: non-empty ``text`` blocks
  are content parts (one part alone becomes a plain string); ``thinking`` blocks join into
  the message's ``reasoning``; ``redacted_thinking`` and ``tool_reference`` blocks are
  dropped; ``tool_use`` becomes a function call (``arguments`` = ``json.dumps(input)``);
  a ``tool_result`` in a user turn becomes a ``tool`` message placed before the turn (its
  text items joined with a newline, ``tool_reference`` items as parts), one in an assistant
  turn a ``"Tool result: ..."`` text part (Python's ``str`` of its content). A user turn
  left with no content is dropped; an assistant turn is kept.
* ``max_tokens`` (required) is both ``max_tokens`` and ``max_completion_tokens``;
  ``stop_sequences`` is ``stop``; a stream asks for usage on every chunk.
* ``output_config.effort`` is the ``reasoning_effort``, ``output_config.format`` a JSON
  schema ``response_format``; ``thinking``: ``enabled`` sets ``thinking_token_budget``,
  ``disabled``/``between_tools`` set the effort vLLM resolves for disabled thinking (see
  ``DISABLED_THINKING_EFFORT``), ``adaptive`` nothing.
* ``tool_choice`` ``auto``/``any``/``none``/``tool`` becomes ``auto``/``required``/``none``/a
  named function (``parallel_tool_calls`` = not ``disable_parallel_tool_use``); tools become
  function tools (``input_schema`` -> ``parameters``, ``"type": "object"`` added last when
  missing), and with tools and no choice the choice is ``auto``.

Image blocks (in a turn, or in a user's ``tool_result``, whose images vLLM puts in a user
message after the tool message) become chat ``image_url`` parts as vLLM converts them (a
``url`` source's URL, else a base64 data URL): the chat path's image rule counts them on a
vision model and refuses them on any other (docs/counting.md, "Images").

Refused here although vLLM would take them (kvgate cannot count them as the engine will):
system-role turns inside
``messages`` (vLLM merges them into the leading system message or not depending on the
model's chat template: Anthropic's own API refuses them too) and with them the
``tool_addition``/``tool_removal`` blocks only such turns may hold, a ``tool_use`` without
an ``id`` (vLLM would invent a time-based one). Types are checked strictly (an integer is
not a string of digits), as Anthropic's API does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from kvgate.openai import ApiError, ParsedRequest, load_json_object
from kvgate.openai.errors import clip
from kvgate.tokenize.request_fields import with_request_fields

from .errors import AnthropicError, invalid_request

__all__ = [
    "COUNT_TOKENS_PATH",
    "DISABLED_THINKING_EFFORT",
    "MESSAGES_PATH",
    "MessagesRequest",
    "parse_count_tokens_request",
    "parse_messages_request",
    "rewrite_messages_body",
]

MESSAGES_PATH: Final = "/v1/messages"
# Anthropic's messages.count_tokens, which vLLM answers from the rendered prompt.
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"

#: Upper bound of max_tokens (keeps later arithmetic within exact integers), as on the
#: chat path.
MAX_TOKENS_LIMIT: Final = 2**31 - 1

#: The ``reasoning_effort`` a ``disabled``/``between_tools`` thinking becomes. vLLM 0.34
#: (``--anthropic-disabled-thinking-effort auto``) probes the chat template once: "none",
#: unless the template rejects it or renders it like some effort, then "low". "none" gives
#: the engine's prompt for every template that ignores the effort or reads it (or
#: ``enable_thinking``) as an on/off switch. A template that refuses "none", or renders it
#: like an effort but "low" otherwise, is counted with "none" where vLLM renders "low"
#: (as is a server started with another ``--anthropic-disabled-thinking-effort``).
DISABLED_THINKING_EFFORT: Final = "none"

_BILLING_HEADER: Final = "x-anthropic-billing-header"
_ROLES: Final = ("user", "assistant")
_BLOCK_TYPES: Final = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
# A block's optional fields and the JSON type each must have when present (not null).
_BLOCK_FIELDS: Final[dict[str, type]] = {
    "text": str,
    "source": dict,
    "id": str,
    "tool_use_id": str,
    "name": str,
    "input": dict,
    "is_error": bool,
    "tool_name": str,
    "thinking": str,
    "signature": str,
    "data": str,
}
_TOOL_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
_EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")
_THINKING_DISPLAYS: Final = ("summarized", "omitted", "updates")
_THINKING_TYPES: Final = ("enabled", "disabled", "adaptive", "between_tools")
_MIN_THINKING_BUDGET: Final = 1024
# The Anthropic fields vLLM copies onto the chat request as they are (when not null).
_COPIED: Final = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("watermarking", "watermarking"),
    ("cache_salt", "cache_salt"),
    ("kv_transfer_params", "kv_transfer_params"),
    ("ec_transfer_params", "ec_transfer_params"),
    ("vllm_xargs", "vllm_xargs"),
)


@dataclass(frozen=True, slots=True)
class MessagesRequest(ParsedRequest):
    """The canonical request of a Messages body: ``body``, ``messages`` and ``tools`` are
    the chat request vLLM converts it into; ``wire_body`` is the client's own body, the one
    forwarded (the engine converts it itself)."""

    wire_body: dict[str, Any] = field(default_factory=dict, repr=False)


# --------------------------------------------------------------------------- field checks


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), "an unsupported value")


_EXPECTED: Final[dict[type, str]] = {
    str: "a valid string",
    dict: "a valid dictionary",
    list: "a valid list",
    bool: "a valid boolean",
    int: "a valid integer",
}


def _wrong_type(path: str, expected: str, value: object) -> AnthropicError:
    return invalid_request(f"{path}: Input should be {expected}, not {_kind(value)}")


def _required(path: str) -> AnthropicError:
    return invalid_request(f"{path}: Field required")


def _typed(value: object, kind: type, path: str) -> Any:
    """``value`` when it is of JSON type ``kind`` (bool is no integer), else a 400."""
    if type(value) is not kind:
        raise _wrong_type(path, _EXPECTED[kind], value)
    return value


def _optional(obj: dict[str, Any], key: str, kind: type, path: str) -> Any:
    value = obj.get(key)
    return None if value is None else _typed(value, kind, path)


def _optional_number(obj: dict[str, Any], key: str) -> None:
    value = obj.get(key)
    if value is not None and type(value) not in (int, float):
        raise _wrong_type(key, "a valid number", value)


def _int_in(value: object, path: str, minimum: int, maximum: int = MAX_TOKENS_LIMIT) -> int:
    number: int = _typed(value, int, path)
    if number < minimum:
        raise invalid_request(f"{path}: Input should be greater than or equal to {minimum}")
    if number > maximum:
        raise invalid_request(f"{path}: Input should be less than or equal to {maximum}")
    return number


def _choice(value: object, path: str, allowed: tuple[str, ...]) -> str:
    if type(value) is not str or value not in allowed:
        names = ", ".join(f"'{name}'" for name in allowed)
        shown = clip(value) if type(value) is str else _kind(value)
        raise invalid_request(f"{path}: Input should be one of {names}, not {shown!s}")
    return value


# --------------------------------------------------------------------------- content blocks


def _block(value: object, path: str) -> dict[str, Any]:
    block: dict[str, Any] = _typed(value, dict, path)
    kind = block.get("type")
    if kind is None:
        raise _required(f"{path}.type")
    if type(kind) is not str or kind not in _BLOCK_TYPES:
        raise invalid_request(
            f"{path}.type: Input should be one of {', '.join(sorted(_BLOCK_TYPES))}, "
            f"not {clip(kind) if type(kind) is str else _kind(kind)}"
        )
    for key, expected in _BLOCK_FIELDS.items():
        _optional(block, key, expected, f"{path}.{key}")
    content = block.get("content")
    if content is not None and type(content) is not str:
        items = _typed(content, list, f"{path}.content")
        for j, item in enumerate(items):
            _typed(item, dict, f"{path}.content.{j}")
    if kind in ("tool_addition", "tool_removal"):
        # vLLM takes them only in system-role turns, which kvgate refuses (see the module).
        raise invalid_request(
            f'{path}.type: {kind} blocks are only allowed in messages with role "system", '
            "which this gateway does not accept"
        )
    return block


def _blocks(value: object, path: str) -> list[dict[str, Any]]:
    items = _typed(value, list, path)
    return [_block(item, f"{path}.{i}") for i, item in enumerate(items)]


def _image_url(source: object, path: str) -> str:
    """vLLM's ``_convert_image_source_to_url``: a ``url`` source's URL, anything else a
    base64 data URL (``media_type`` defaulting to image/jpeg). The chat path's image rule
    counts it, or refuses it on a model without one."""
    if type(source) is not dict:
        source = {}
    if source.get("type") == "url":
        return str(_typed(source.get("url", ""), str, f"{path}.source.url"))
    media_type = _typed(source.get("media_type", "image/jpeg"), str, f"{path}.source.media_type")
    data = _typed(source.get("data", ""), str, f"{path}.source.data")
    return f"data:{media_type};base64,{data}"


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _not_billing(text: str) -> bool:
    # Claude Code's per-request attribution line, which vLLM drops (prefix caching).
    return not text.startswith(_BILLING_HEADER)


def _system(value: object) -> str | None:
    """The leading system message's content, or None when there is none."""
    if value is None:
        return None
    if type(value) is str:
        return value or None
    parts = [
        block["text"]
        for block in _blocks(value, "system")
        if block["type"] == "text" and block.get("text") and _not_billing(block["text"])
    ]
    return "".join(parts) or None


def _tool_call(block: dict[str, Any], path: str) -> dict[str, Any]:
    if not block.get("id"):
        raise _required(f"{path}.id")
    if block.get("name") is None:
        raise _required(f"{path}.name")
    return {
        "id": block["id"],
        "type": "function",
        "function": {
            "name": block["name"],
            # json.dumps as vLLM writes it (its chat path parses it back into an object).
            "arguments": json.dumps(block.get("input") or {}),
        },
    }


def _user_tool_result(block: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """A user turn's tool_result: the tool message vLLM places before the turn, and a user
    message of the result's images after it."""
    content = block.get("content")
    text = ""
    references: list[dict[str, Any]] = []
    images: list[str] = []
    if type(content) is str:
        text = content
    elif type(content) is list:
        texts: list[str] = []
        for j, item in enumerate(content):
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                texts.append(_typed(value, str, f"{path}.content.{j}.text"))
            elif kind == "image":
                url = _image_url(item.get("source", {}), f"{path}.content.{j}")
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append(
                        {"type": "tool_reference", "name": _typed(name, str, f"{path}.content.{j}")}
                    )
            # Other items (documents, search results, ...) are not part of the prompt.
        text = "\n".join(texts)
    tool_content: str | list[dict[str, Any]] = text
    if references:
        tool_content = references
        if text:
            tool_content.append({"type": "text", "text": text})
    tool = {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": tool_content}
    if not images:
        return [tool]
    return [tool, {"role": "user", "content": [_image_part(url) for url in images]}]


def _messages(value: object) -> list[dict[str, Any]]:
    """The chat messages of the Anthropic turns, in vLLM's order."""
    if value is None:
        raise _required("messages")
    turns = _typed(value, list, "messages")
    if not turns:
        raise invalid_request("messages: at least one message is required")
    converted: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        path = f"messages.{i}"
        _typed(turn, dict, path)
        role = turn.get("role")
        if role is None:
            raise _required(f"{path}.role")
        if role == "system":
            raise invalid_request(
                f"{path}.role: system messages inside 'messages' are not supported by this "
                "gateway (its prompt depends on the model's chat template); use the top-level "
                "'system' parameter"
            )
        role = _choice(role, f"{path}.role", _ROLES)
        if "content" not in turn or turn["content"] is None:
            raise _required(f"{path}.content")
        content = turn["content"]
        message: dict[str, Any] = {"role": role}
        if type(content) is str:
            message["content"] = content
            converted.append(message)
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(_blocks(content, f"{path}.content")):
            where = f"{path}.content.{j}"
            kind = block["type"]
            if kind == "text":
                if block.get("text"):
                    parts.append({"type": "text", "text": block["text"]})
            elif kind == "image":
                if block.get("source"):
                    parts.append(_image_part(_image_url(block["source"], where)))
            elif kind == "thinking":
                if block.get("thinking") is not None:
                    reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append(_tool_call(block, where))
            elif kind == "tool_result":
                if role == "user":
                    converted.extend(_user_tool_result(block, where))
                else:
                    result = block.get("content")
                    # Python's str() of the content, exactly as vLLM writes it.
                    shown = str(result) if result else ""
                    parts.append({"type": "text", "text": f"Tool result: {shown}"})
            # redacted_thinking and tool_reference blocks are not part of the prompt.
        if reasoning:
            message["reasoning"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        if parts:
            if len(parts) == 1 and parts[0]["type"] == "text":
                message["content"] = parts[0]["text"]
            else:
                message["content"] = parts
        if role == "user" and "content" not in message:
            continue  # e.g. a turn of tool results only: its tool messages stand for it
        converted.append(message)
    return converted


# --------------------------------------------------------------------------- tools


def _tools(value: object) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    converted: list[dict[str, Any]] = []
    for i, item in enumerate(_typed(value, list, "tools")):
        path = f"tools.{i}"
        tool: dict[str, Any] = _typed(item, dict, path)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            # vLLM refuses Anthropic-defined tools (web_search_*, bash_*, ...) by name.
            raise invalid_request(
                f"{path}.type: tool type {clip(kind) if type(kind) is str else _kind(kind)} is "
                "not supported; only custom tools with an input_schema are supported"
            )
        name = tool.get("name")
        if name is None:
            raise _required(f"{path}.name")
        _typed(name, str, f"{path}.name")
        description = _optional(tool, "description", str, f"{path}.description")
        if tool.get("input_schema") is None:
            raise _required(f"{path}.input_schema")
        schema = dict(_typed(tool["input_schema"], dict, f"{path}.input_schema"))
        if "type" not in schema:
            schema["type"] = "object"  # vLLM's default, appended after the client's keys
        function: dict[str, Any] = {"name": name, "description": description, "parameters": schema}
        for key in ("strict", "defer_loading"):
            flag = _optional(tool, key, bool, f"{path}.{key}")
            if flag is not None:
                function[key] = flag
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(value: object) -> tuple[Any, bool | None]:
    """The chat tool_choice and parallel_tool_calls (None: not set)."""
    if value is None:
        return None, None
    choice: dict[str, Any] = _typed(value, dict, "tool_choice")
    kind = _choice(choice.get("type"), "tool_choice.type", ("auto", "any", "tool", "none"))
    name = _optional(choice, "name", str, "tool_choice.name")
    no_parallel = _optional(
        choice, "disable_parallel_tool_use", bool, "tool_choice.disable_parallel_tool_use"
    )
    if kind == "tool":
        if not name:
            raise invalid_request("tool_choice.name: required when type is 'tool'")
        chat: Any = {"type": "function", "function": {"name": name}}
    else:
        chat = _TOOL_CHOICES[kind]
    return chat, not no_parallel


# --------------------------------------------------------------------------- thinking, output


def _effort(obj: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """output_config: the reasoning effort and the chat response_format."""
    config = _optional(obj, "output_config", dict, "output_config")
    if config is None:
        return None, None
    effort = config.get("effort")
    if effort is not None:
        effort = _choice(effort, "output_config.effort", _EFFORTS)
    fmt = _optional(config, "format", dict, "output_config.format")
    response_format = None
    if fmt is not None:
        _choice(fmt.get("type", "json_schema"), "output_config.format.type", ("json_schema",))
        schema = _optional(fmt, "schema", dict, "output_config.format.schema")
        if schema:
            response_format = {
                "type": "json_schema",
                "json_schema": {"name": "json_schema", "schema": schema},
            }
    return effort, response_format


def _thinking(obj: dict[str, Any], max_tokens: int) -> tuple[str | None, int | None]:
    """thinking: the effort it sets (disabled) and the thinking token budget (enabled)."""
    thinking = _optional(obj, "thinking", dict, "thinking")
    if thinking is None:
        return None, None
    kind = _choice(thinking.get("type"), "thinking.type", _THINKING_TYPES)
    if thinking.get("display") is not None and kind in ("enabled", "adaptive"):
        _choice(thinking["display"], "thinking.display", _THINKING_DISPLAYS)
    if kind in ("disabled", "between_tools"):
        return DISABLED_THINKING_EFFORT, None
    if kind == "adaptive":
        return None, None
    if thinking.get("budget_tokens") is None:
        raise _required("thinking.budget_tokens")
    budget = _int_in(thinking["budget_tokens"], "thinking.budget_tokens", _MIN_THINKING_BUDGET)
    remote = obj.get("kv_transfer_params")
    prefill_leg = type(remote) is dict and bool(remote.get("do_remote_decode"))
    if budget >= max_tokens and not prefill_leg:
        raise invalid_request("thinking.budget_tokens: must be less than max_tokens")
    return None, budget


# --------------------------------------------------------------------------- entry point


def _api_error(error: ApiError) -> AnthropicError:
    return invalid_request(error.message)


def parse_messages_request(body: bytes, *, count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body and convert it as vLLM 0.34 does. Raises
    :class:`AnthropicError` (400 ``invalid_request_error``) for a body it cannot accept.
    ``count_only``: a count_tokens body, which has no ``max_tokens`` and no stream."""
    try:
        obj = load_json_object(body)
    except ApiError as error:
        raise _api_error(error) from None

    model = obj.get("model")
    if model is None:
        raise _required("model")
    _typed(model, str, "model")
    if not model:
        raise invalid_request("model: String should have at least 1 character")
    if count_only:
        # Nothing is generated: the thinking budget has no cap to stay under.
        max_tokens, stream = MAX_TOKENS_LIMIT, False
    else:
        if obj.get("max_tokens") is None:
            raise _required("max_tokens")
        max_tokens = _int_in(obj["max_tokens"], "max_tokens", 1)
        stream = bool(_optional(obj, "stream", bool, "stream"))
    stop = obj.get("stop_sequences")
    if stop is not None:
        for i, item in enumerate(_typed(stop, list, "stop_sequences")):
            _typed(item, str, f"stop_sequences.{i}")
    for key in ("temperature", "top_p"):
        _optional_number(obj, key)
    _optional(obj, "top_k", int, "top_k")
    _optional(obj, "metadata", dict, "metadata")
    min_tokens = obj.get("min_tokens")
    min_tokens = 0 if min_tokens is None else _int_in(min_tokens, "min_tokens", 0)
    template_kwargs = _optional(obj, "chat_template_kwargs", dict, "chat_template_kwargs")

    # The conversion, in vLLM's order.
    messages: list[dict[str, Any]] = []
    system = _system(obj.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages += _messages(obj.get("messages"))
    if not messages:
        raise invalid_request("messages: no message has any content")
    chat: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
    }
    if stop is not None:
        chat["stop"] = stop
    for source, target in _COPIED:
        if obj.get(source) is not None:
            chat[target] = obj[source]
    chat["min_tokens"] = min_tokens
    if template_kwargs is not None:
        chat["chat_template_kwargs"] = template_kwargs
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    effort, response_format = _effort(obj)
    if response_format is not None:
        chat["response_format"] = response_format
    disabled_effort, budget = _thinking(obj, max_tokens)
    if disabled_effort is not None:
        effort = disabled_effort  # thinking is applied after output_config
    if effort is not None:
        chat["reasoning_effort"] = effort
    if budget is not None:
        chat["thinking_token_budget"] = budget
    tool_choice, parallel = _tool_choice(obj.get("tool_choice"))
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    tools = _tools(obj.get("tools"))
    if tools is not None and tool_choice is None:
        tool_choice = "auto"
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if tools is not None:
        chat["tools"] = tools

    return MessagesRequest(
        kind="chat",
        path=MESSAGES_PATH,
        model=model,
        body=chat,
        messages=messages,
        tools=tools,
        chat_template_kwargs=with_request_fields(template_kwargs, reasoning_effort=effort),
        stream=stream,
        # vLLM asks its chat path for usage on every Anthropic stream.
        include_usage_requested=stream,
        max_new_tokens=max_tokens,
        max_tokens_param="max_tokens",
        min_tokens=min_tokens,
        body_bytes=len(body),
        wire_body=obj,
    )


def parse_count_tokens_request(body: bytes) -> MessagesRequest:
    """A count_tokens body, converted as vLLM converts it to render the prompt it counts."""
    return parse_messages_request(body, count_only=True)


# --------------------------------------------------------------------------- forwarding

_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def rewrite_messages_body(
    body: dict[str, Any], *, model: str | None = None, max_tokens: int | None = None
) -> bytes:
    """The client's Messages body, serialised once with the served ``model`` (a budget
    fallback) and the reserved ``max_tokens`` (a clamp) written in. ``body`` is unchanged."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        out["max_tokens"] = max_tokens
    return _ENCODER.encode(out).encode("utf-8")
