"""OpenAI Responses requests: validated, and converted into the chat request vLLM renders.

vLLM 0.34 serves ``POST /v1/responses`` for a chat-template model by turning the body into
chat messages and tools and rendering them with the chat template
(``vllm/renderers/online_renderer.py``: ``render_responses``;
``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages``,
``construct_tool_dicts``; ``protocol.py``: ``ResponsesRequest.build_chat_params``). So the
prompt the engine counts is that chat request's prompt, and kvgate's canonical request for
a Responses body is the converted chat request (:class:`ResponsesRequest`, kind ``chat``,
path ``/v1/responses``): its messages, tools and template keywords are what kvgate's chat
counting counts as the engine does. The client's own body is kept (``wire_body``) for
forwarding: the engine converts it itself.

The conversion, as vLLM does it:

* ``instructions`` (when not empty) is a leading system message.
* ``input`` as a string is one user message. As items:

  - a ``message`` of role ``user``/``system``/``developer`` is a chat message with its
    content (a string, or ``input_text`` parts);
  - an ``assistant`` message is the text of its *first* content part (``""`` without
    parts); a ``function_call`` (``custom_tool_call``) is a tool call (``id`` = its
    ``call_id``; a custom call's input as ``{"input": ...}`` JSON); a ``reasoning`` item is
    the ``reasoning`` of an assistant message (its first content text, else its first
    summary text). Each of them fills the previous assistant message when that message
    does not have it yet (tool calls are appended), else starts a new one;
  - a ``function_call_output`` (``custom_tool_call_output``) is a ``tool`` message.
* A last ``message`` or ``reasoning`` item whose status is ``in_progress`` or
  ``incomplete`` is continued (``continue_final_message``, no generation prompt).
* ``tools``: a ``function`` tool is a chat function tool; a ``custom`` tool the
  single-string function vLLM shows the model. With no tools, ``tool_choice`` auto/none is
  ``none`` and required or a named tool is refused, as vLLM refuses them.
* ``reasoning.effort`` is the template's ``reasoning_effort`` (and ``enable_thinking``),
  as on the chat path.
* ``max_output_tokens`` is the cap; without it the engine generates up to the context
  limit, and kvgate writes the cap it reserved into the forwarded body.

Refused here (a 400 naming the field):

* What makes the prompt include a conversation kvgate never saw, so it would be counted
  low: ``previous_response_id``, ``conversation``, ``previous_input_messages``,
  ``item_reference`` items, and ``background`` (stored and run apart from this request).
* What kvgate cannot count: files (``input_file``), images outside a message's content or
  given by ``file_id`` (an ``input_image`` by URL in a message is counted by the model's
  image rule, docs/counting.md "Images"), built-in
  tools (``web_search``, ``file_search``, ``code_interpreter``, ``mcp``, ...: with a tool
  server vLLM runs them in further turns whose prompts kvgate never counts) and their call
  items, ``namespace`` tools, ``mm_processor_kwargs``, ``prompt`` templates (vLLM refuses
  them too), encrypted reasoning (likewise), a refusal as an assistant message's first part
  (vLLM fails on it).
* ``model`` is required (vLLM would serve its default model): kvgate routes by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from kvgate.openai import ApiError, ParsedRequest, load_json_object
from kvgate.openai.errors import clip, invalid_request
from kvgate.tokenize.request_fields import REASONING_EFFORTS, with_request_fields

__all__ = [
    "RESPONSES_PATH",
    "ResponsesRequest",
    "parse_responses_request",
    "rewrite_responses_body",
]

RESPONSES_PATH: Final = "/v1/responses"

#: Upper bound of max_output_tokens (keeps later arithmetic within exact integers), as on
#: the chat path.
MAX_TOKENS_LIMIT: Final = 2**31 - 1

_INPUT_ROLES: Final = ("user", "system", "developer")
_PARTIAL: Final = frozenset({"in_progress", "incomplete"})
# Input item types that are stateful or uncountable (see the module docstring).
_STORED_ITEMS: Final = frozenset({"item_reference"})
# The shim vLLM shows the model for a custom tool (vllm/tool_parsers/utils.py).
_CUSTOM_INPUT_KEY: Final = "input"
_NAMESPACE_SEPARATOR: Final = "__"
_TOOL_CHOICE_MODES: Final = ("none", "auto", "required")
_TEXT_FORMATS: Final = ("text", "json_schema", "json_object")

# Fields whose prompt includes a conversation kvgate did not see.
_STATEFUL_FIELDS: Final = {
    "previous_response_id": "a stored earlier response",
    "conversation": "a stored conversation",
    "previous_input_messages": "earlier messages",
}


def custom_tool_parameters() -> dict[str, Any]:
    """The parameters of the single-string function vLLM shows for a ``custom`` tool."""
    return {
        "type": "object",
        "properties": {
            _CUSTOM_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [_CUSTOM_INPUT_KEY],
        "additionalProperties": False,
    }


@dataclass(frozen=True, slots=True)
class ResponsesRequest(ParsedRequest):
    """The canonical request of a Responses body: ``body``, ``messages`` and ``tools`` are
    the chat request vLLM renders for it; ``wire_body`` is the client's own body, the one
    forwarded (the engine converts it itself)."""

    wire_body: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def prompt_param(self) -> str:
        # The client wrote its prompt as `input` (and `instructions`), not as messages.
        return "input"


# --------------------------------------------------------------------------- field checks


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a decimal number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), "an unsupported value")


def _type_error(param: str, expected: str, value: object) -> ApiError:
    return invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
        param,
        "invalid_type",
    )


def _missing(param: str) -> ApiError:
    return invalid_request(
        f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    )


def _invalid_value(param: str, value: object, allowed: tuple[str, ...]) -> ApiError:
    shown = clip(value) if type(value) is str else _json_type(value)
    names = ", ".join(f"'{name}'" for name in allowed)
    return invalid_request(
        f"Invalid value: '{shown}'. Supported values are: {names}.", param, "invalid_value"
    )


def _unsupported(param: str, message: str) -> ApiError:
    return invalid_request(message, param, "unsupported_parameter")


_EXPECTED: Final[dict[type, str]] = {
    str: "a string",
    dict: "an object",
    list: "an array",
    bool: "a boolean",
    int: "an integer",
}


def _typed(value: object, kind: type, param: str) -> Any:
    """``value`` when it is of JSON type ``kind`` (a boolean is no integer), else a 400."""
    if type(value) is not kind:
        raise _type_error(param, _EXPECTED[kind], value)
    return value


def _optional(obj: dict[str, Any], key: str, kind: type, param: str) -> Any:
    value = obj.get(key)
    return None if value is None else _typed(value, kind, param)


def _required(obj: dict[str, Any], key: str, kind: type, param: str) -> Any:
    value = obj.get(key)
    if value is None:
        raise _missing(param)
    return _typed(value, kind, param)


def _optional_number(obj: dict[str, Any], key: str) -> None:
    value = obj.get(key)
    if value is not None and type(value) not in (int, float):
        raise _type_error(key, "a number", value)


def _max_output_tokens(obj: dict[str, Any]) -> int | None:
    value = obj.get("max_output_tokens")
    if value is None:
        return None
    number: int = _typed(value, int, "max_output_tokens")
    if number < 1:
        raise invalid_request(
            "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 1, "
            f"but got {number} instead.",
            "max_output_tokens",
            "integer_below_min_value",
        )
    if number > MAX_TOKENS_LIMIT:
        raise invalid_request(
            "Invalid 'max_output_tokens': integer above maximum value. Expected a value <= "
            f"{MAX_TOKENS_LIMIT}, but got {clip(number, 24)} instead.",
            "max_output_tokens",
            "integer_above_max_value",
        )
    return number


# --------------------------------------------------------------------------- content


def _media_refused(param: str, kind: str) -> ApiError:
    return _unsupported(
        param,
        f"'{kind}' content is not supported by this gateway: it cannot count the tokens of "
        "images or files.",
    )


def _input_parts(value: list[Any], param: str, *, images: bool = False) -> list[dict[str, Any]]:
    """Input content parts: ``input_text`` (as vLLM keeps them: type and text), and with
    ``images`` (a message's content) ``input_image`` parts by URL, which the model's image
    rule counts (a model without one refuses them)."""
    parts: list[dict[str, Any]] = []
    for j, raw in enumerate(value):
        where = f"{param}[{j}]"
        part: dict[str, Any] = _typed(raw, dict, where)
        kind = part.get("type")
        if kind is None:
            raise _missing(f"{where}.type")
        if kind == "input_image" and images:
            parts.append(_input_image(part, where))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise _media_refused(f"{where}.type", kind)
        if kind != "input_text":
            raise _invalid_value(f"{where}.type", kind, ("input_text",))
        text = _required(part, "text", str, f"{where}.text")
        parts.append({"type": "input_text", "text": text})
    return parts


def _input_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` by URL (a data: URL, or one the engine fetches); an uploaded
    file's id names nothing the engine can read here."""
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise _unsupported(
            f"{where}.file_id",
            "Images given by 'file_id' are not supported by this gateway; send 'image_url'.",
        )
    url = _required(part, "image_url", str, f"{where}.image_url")
    # vLLM's request model defaults a message's image detail to "auto".
    return {"type": "input_image", "image_url": url, "detail": part.get("detail", "auto")}


def _input_content(item: dict[str, Any], param: str) -> str | list[dict[str, Any]]:
    content = item.get("content")
    if content is None:
        raise _missing(param)
    if type(content) is str:
        return content
    if type(content) is not list:
        raise _type_error(param, "a string or an array of content parts", content)
    return _input_parts(content, param, images=True)


def _assistant_text(item: dict[str, Any], param: str) -> str:
    """What vLLM keeps of an assistant message: the text of its first content part."""
    content = item.get("content")
    if content is None:
        raise _missing(param)
    if type(content) is str:
        return content
    if type(content) is not list:
        raise _type_error(param, "a string or an array of content parts", content)
    kinds: set[str] = set()
    for j, raw in enumerate(content):
        where = f"{param}[{j}]"
        part: dict[str, Any] = _typed(raw, dict, where)
        kind = part.get("type")
        if kind is None:
            raise _missing(f"{where}.type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise _media_refused(f"{where}.type", kind)
        if kind not in ("output_text", "refusal", "input_text"):
            raise _invalid_value(f"{where}.type", kind, ("output_text", "refusal"))
        if kind == "refusal":
            _required(part, "refusal", str, f"{where}.refusal")
            if j == 0:
                # vLLM reads the first part's text, which a refusal does not have.
                raise _unsupported(
                    f"{where}.type",
                    "An assistant message that starts with a refusal part is not supported "
                    "(the server cannot render it).",
                )
        else:
            _required(part, "text", str, f"{where}.text")
        kinds.add("input" if kind == "input_text" else "output")
    if len(kinds) > 1:
        # Neither an output message nor an input message: vLLM's validation refuses it.
        raise invalid_request(
            f"Invalid '{param}': an assistant message's parts are either output parts "
            "(output_text, refusal) or input parts (input_text), not both.",
            param,
            "invalid_value",
        )
    if not content:
        return ""
    text: str = content[0]["text"]
    return text


def _tool_output(item: dict[str, Any], param: str) -> str | list[dict[str, Any]]:
    output = item.get("output")
    if output is None:
        raise _missing(param)
    if type(output) is str:
        return output
    if type(output) is not list:
        raise _type_error(param, "a string or an array of content parts", output)
    return _input_parts(output, param)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    if item.get("encrypted_content") is not None:
        # vLLM refuses it the same way.
        raise invalid_request("Encrypted content is not supported.", "input")
    content = _optional(item, "content", list, f"{param}.content")
    summary = _optional(item, "summary", list, f"{param}.summary")
    texts: dict[str, list[str]] = {}
    for key, parts, kind in (
        ("content", content, "reasoning_text"),
        ("summary", summary, "summary_text"),
    ):
        texts[key] = []
        for j, raw in enumerate(parts or ()):
            where = f"{param}.{key}[{j}]"
            part: dict[str, Any] = _typed(raw, dict, where)
            if part.get("type") != kind:
                raise _invalid_value(f"{where}.type", part.get("type"), (kind,))
            texts[key].append(_required(part, "text", str, f"{where}.text"))
    if texts["content"]:
        return texts["content"][0]
    if texts["summary"]:
        return texts["summary"][0]
    return ""


def _call(item: dict[str, Any], param: str, *, custom: bool) -> dict[str, Any]:
    call_id = _required(item, "call_id", str, f"{param}.call_id")
    name: str = _required(item, "name", str, f"{param}.name")
    if custom:
        payload = _optional(item, "input", str, f"{param}.input") or ""
        arguments = json.dumps({_CUSTOM_INPUT_KEY: payload}, ensure_ascii=False)
    else:
        arguments = _required(item, "arguments", str, f"{param}.arguments")
        namespace = _optional(item, "namespace", str, f"{param}.namespace")
        if namespace:
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _previous_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    if messages and messages[-1].get("role") == "assistant":
        return messages[-1]
    return None


def _fill(messages: list[dict[str, Any]], key: str, value: Any) -> None:
    """vLLM's merge: the previous assistant message takes ``key`` when it has none yet,
    else a new assistant message holds it."""
    previous = _previous_assistant(messages)
    if previous is not None and previous.get(key) is None:
        previous[key] = value
    else:
        messages.append({"role": "assistant", key: value})


def _input_messages(value: object) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages of ``input`` and whether the last one is continued."""
    if type(value) is str:
        return [{"role": "user", "content": value}], False
    if type(value) is not list:
        raise _type_error("input", "a string or an array of input items", value)
    messages: list[dict[str, Any]] = []
    continued = False
    for i, raw in enumerate(value):
        param = f"input[{i}]"
        item: dict[str, Any] = _typed(raw, dict, param)
        kind = item.get("type")
        if kind is None:
            if "role" not in item:
                raise _missing(f"{param}.type")
            kind = "message"
        _typed(kind, str, f"{param}.type")
        status = item.get("status")
        partial = status in _PARTIAL
        if kind == "message":
            role = _required(item, "role", str, f"{param}.role")
            if role == "assistant":
                _fill(messages, "content", _assistant_text(item, f"{param}.content"))
            elif role in _INPUT_ROLES:
                content = _input_content(item, f"{param}.content")
                messages.append({"role": role, "content": content})
            else:
                raise _invalid_value(
                    f"{param}.role", role, ("user", "assistant", "system", "developer")
                )
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, param, custom=kind == "custom_tool_call")
            previous = _previous_assistant(messages)
            if previous is not None:
                previous.setdefault("tool_calls", [])
                if previous["tool_calls"] is None:
                    previous["tool_calls"] = []
                previous["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
            partial = False
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(
                {
                    "role": "tool",
                    "content": _tool_output(item, f"{param}.output"),
                    "tool_call_id": _required(item, "call_id", str, f"{param}.call_id"),
                }
            )
            partial = False
        elif kind == "reasoning":
            _fill(messages, "reasoning", _reasoning_text(item, param))
        elif kind in _STORED_ITEMS:
            raise _unsupported(
                param,
                f"'{kind}' input items are not supported by this gateway: they refer to "
                "stored items it cannot count. Send the items themselves.",
            )
        else:
            raise _unsupported(
                f"{param}.type",
                f"Input items of type '{clip(kind)}' are not supported by this gateway: only "
                "message, function_call, function_call_output, custom_tool_call, "
                "custom_tool_call_output and reasoning items can be counted.",
            )
        continued = partial
    return messages, continued


# --------------------------------------------------------------------------- tools


def _tools(value: object) -> tuple[list[dict[str, Any]] | None, set[str]]:
    """The chat tools vLLM renders, and the names a named tool choice may use."""
    if value is None:
        return None, set()
    items = _typed(value, list, "tools")
    converted: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, raw in enumerate(items):
        param = f"tools[{i}]"
        tool: dict[str, Any] = _typed(raw, dict, param)
        kind = tool.get("type")
        if kind is None:
            raise _missing(f"{param}.type")
        _typed(kind, str, f"{param}.type")
        if kind not in ("function", "custom"):
            raise _unsupported(
                f"{param}.type",
                f"Tools of type '{clip(kind)}' are not supported by this gateway: only "
                "function and custom tools can be counted (built-in tools run further turns "
                "whose prompts it cannot count).",
            )
        name: str = _required(tool, "name", str, f"{param}.name")
        description = _optional(tool, "description", str, f"{param}.description")
        function: dict[str, Any] = {"name": name, "description": description}
        if kind == "function":
            function["parameters"] = _optional(tool, "parameters", dict, f"{param}.parameters")
            for key in ("strict", "defer_loading"):
                flag = _optional(tool, key, bool, f"{param}.{key}")
                if flag is not None:
                    function[key] = flag
        else:
            fmt = _optional(tool, "format", dict, f"{param}.format")
            if fmt is not None and fmt.get("type") == "grammar":
                # vLLM refuses them the same way.
                raise invalid_request(
                    "Custom tools with a grammar format are not supported; only free-form "
                    "text custom tools are accepted.",
                    "tools",
                )
            function["parameters"] = custom_tool_parameters()
            defer = _optional(tool, "defer_loading", bool, f"{param}.defer_loading")
            if defer is not None:
                function["defer_loading"] = defer
        converted.append({"type": "function", "function": function})
        names.add(name)
    return converted, names


def _tool_choice(value: object, tools: list[dict[str, Any]] | None, names: set[str]) -> Any:
    """The chat tool_choice for what vLLM makes of the Responses one."""
    has_tools = bool(tools)
    if value is None:
        value = "auto"
    if type(value) is str:
        if value not in _TOOL_CHOICE_MODES:
            raise _invalid_value("tool_choice", value, _TOOL_CHOICE_MODES)
        if not has_tools:
            if value == "required":
                raise invalid_request(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                    "tool_choice",
                )
            return "none"
        return value
    choice: dict[str, Any] = _typed(value, dict, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = _optional(choice, "name", str, "tool_choice.name")
        if not has_tools or not name or name not in names:
            raise invalid_request(
                "Tool choice 'function' not found in 'tools' parameter.", "tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode = choice.get("mode")
        if mode not in ("auto", "required"):
            raise _invalid_value("tool_choice.mode", mode, ("auto", "required"))
        return mode
    raise _unsupported(
        "tool_choice.type",
        f"A tool_choice of type '{clip(kind) if type(kind) is str else _json_type(kind)}' is "
        "not supported by this gateway: only function and custom tools can be counted.",
    )


# --------------------------------------------------------------------------- the rest


def _reasoning_effort(obj: dict[str, Any]) -> str | None:
    reasoning = _optional(obj, "reasoning", dict, "reasoning")
    if reasoning is None:
        return None
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if type(effort) is not str or effort not in REASONING_EFFORTS:
        raise _invalid_value("reasoning.effort", effort, REASONING_EFFORTS)
    return effort


def _text_format(obj: dict[str, Any]) -> None:
    text = _optional(obj, "text", dict, "text")
    if text is None:
        return
    fmt = _optional(text, "format", dict, "text.format")
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind is None:
        raise _missing("text.format.type")
    if kind not in _TEXT_FORMATS:
        raise _invalid_value("text.format.type", kind, _TEXT_FORMATS)
    if kind == "json_schema":
        _optional(fmt, "schema", dict, "text.format.schema")


def _refuse_uncountable(obj: dict[str, Any]) -> None:
    for name, what in _STATEFUL_FIELDS.items():
        if obj.get(name) is not None:
            raise _unsupported(
                name,
                f"'{name}' is not supported by this gateway: the prompt would include "
                f"{what} it cannot count. Send the whole conversation as 'input' instead.",
            )
    background = _optional(obj, "background", bool, "background")
    if background:
        raise _unsupported(
            "background",
            "'background' is not supported by this gateway: a background response is stored "
            "and run apart from the request it meters.",
        )
    if obj.get("prompt") is not None:
        # vLLM refuses it too.
        raise _unsupported("prompt", "prompt template is not supported")
    if obj.get("mm_processor_kwargs") is not None:
        raise _unsupported(
            "mm_processor_kwargs",
            "'mm_processor_kwargs' is not supported by this gateway: it cannot count the tokens "
            "of multimodal inputs.",
        )


def _model(obj: dict[str, Any]) -> str:
    model: str = _required(obj, "model", str, "model")
    if not model:
        raise invalid_request(
            "Invalid 'model': empty string. Expected a model name.", "model", "invalid_value"
        )
    return model


# --------------------------------------------------------------------------- entry point


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Validate a Responses body and convert it as vLLM 0.34 does. Raises
    :class:`~kvgate.openai.ApiError` (400, OpenAI's shape) for a body it cannot accept."""
    obj = load_json_object(body)
    model = _model(obj)
    _refuse_uncountable(obj)
    stream = bool(_optional(obj, "stream", bool, "stream"))
    max_new = _max_output_tokens(obj)
    for key in ("temperature", "top_p"):
        _optional_number(obj, key)
    _optional(obj, "include", list, "include")
    _optional(obj, "metadata", dict, "metadata")
    _text_format(obj)
    effort = _reasoning_effort(obj)
    template_kwargs = _optional(obj, "chat_template_kwargs", dict, "chat_template_kwargs")
    instructions = _optional(obj, "instructions", str, "instructions")

    if "input" not in obj or obj["input"] is None:
        raise _missing("input")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    converted, continued = _input_messages(obj["input"])
    messages += converted
    if not messages:
        raise invalid_request(
            "Invalid 'input': empty array. Expected at least one input item (or instructions).",
            "input",
            "empty_array",
        )
    tools, names = _tools(obj.get("tools"))
    tool_choice = _tool_choice(obj.get("tool_choice"), tools, names)

    chat: dict[str, Any] = {"model": model, "messages": messages}
    if max_new is not None:
        chat["max_tokens"] = max_new
    if stream:
        chat["stream"] = True
    if tools:
        chat["tools"] = tools
    chat["tool_choice"] = tool_choice
    if effort is not None:
        chat["reasoning_effort"] = effort
    if template_kwargs is not None:
        chat["chat_template_kwargs"] = template_kwargs
    if continued:
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True

    return ResponsesRequest(
        kind="chat",
        path=RESPONSES_PATH,
        model=model,
        body=chat,
        messages=messages,
        # An empty list renders as no tools (vLLM's construct_tool_dicts).
        tools=tools or None,
        chat_template_kwargs=with_request_fields(template_kwargs, reasoning_effort=effort),
        add_generation_prompt=not continued,
        continue_final_message=continued,
        stream=stream,
        # Responses streams always end with the response and its usage.
        include_usage_requested=stream,
        max_new_tokens=max_new,
        max_tokens_param="max_tokens" if max_new is not None else None,
        body_bytes=len(body),
        wire_body=obj,
    )


# --------------------------------------------------------------------------- forwarding

_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def rewrite_responses_body(
    body: dict[str, Any], *, model: str | None = None, max_output_tokens: int | None = None
) -> bytes:
    """The client's Responses body, serialised once with the served ``model`` (a budget
    fallback) and the reserved ``max_output_tokens`` (a clamp, or the cap kvgate reserved
    for a body without one) written in. ``body`` is unchanged."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    if max_output_tokens is not None:
        if type(max_output_tokens) is not int or max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be an int >= 1, got {max_output_tokens!r}")
        out["max_output_tokens"] = max_output_tokens
    return _ENCODER.encode(out).encode("utf-8")
