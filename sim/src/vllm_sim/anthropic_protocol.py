"""Anthropic's Messages API as vLLM 0.34 reads it: the request models, its error bodies, and
the chat-completion request it turns a Messages request into.

Written from vLLM 0.34.0's ``entrypoints/anthropic/{protocol,serving,api_router}.py`` and the
FastAPI error handlers it installs (``entrypoints/serve/exception_handling``); no code is
shared with vLLM.

* **Validation.** FastAPI validates the body against vLLM's pydantic request models before
  vLLM's handler runs, so a malformed request (``max_tokens`` missing, an unknown block type,
  ``thinking.budget_tokens`` under 1024, ...) is answered by vLLM's generic
  ``RequestValidationError`` handler: 400 in the *OpenAI* error shape,
  ``{"error": {"message": "N validation error(s):\\n  {...}", "type": "Bad Request",
  "param": "body.max_tokens", "code": 400}}``. The models below declare the same fields, types,
  defaults and validators under the same class names, so pydantic reports the same errors in
  the same order (class names appear in some messages).
* **Handler errors** (an unknown model, a template failure, a prompt too long, a sampling
  parameter out of range, ...) are vLLM ``ErrorResponse``\\ s that the Anthropic router
  translates (``translate_error_response``): ``{"type": "error", "error": {"type": ...,
  "message": ...}}`` with the same status, the type from the status (400
  ``invalid_request_error``, 404 ``not_found_error``, 5xx ``api_error``, ...).
* **Conversion** (``to_chat_completion_request``): the system prompt (string, or its text
  blocks joined without a separator, the ``x-anthropic-billing-header`` blocks dropped) leads;
  inline ``system`` messages stay in place or are merged into it when the chat template needs
  system-first ordering; text / image / thinking / tool_use / tool_result blocks become
  content parts, ``reasoning``, ``tool_calls`` and ``tool`` messages (a user turn's tool
  results go *before* its remaining text); tools become functions (``tool_addition`` /
  ``tool_removal`` blocks applied), ``tool_choice`` any -> required, tool -> named, and tools
  without a choice mean "auto"; ``output_config.effort`` is the ``reasoning_effort``, which a
  disabled thinking overrides; an enabled thinking sets ``thinking_token_budget``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

# vLLM's VLLM_MAX_STOP_STRINGS (default 4): the most stop_sequences a request may carry.
MAX_STOP_STRINGS = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))
BILLING_HEADER = "x-anthropic-billing-header"


# --- the request models (vLLM 0.34's protocol.py, field for field) -------------------------


def _reject_tool_changes(content: str | list[AnthropicContentBlock] | None) -> None:
    if content is None or isinstance(content, str):
        return
    for block in content:
        if block.type in ("tool_addition", "tool_removal"):
            raise ValueError(f'{block.type} blocks are only allowed in messages with role "system"')


class AnthropicTool(BaseModel):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_custom_tools(cls, data: Any) -> Any:
        # Anthropic's server tools (web_search_*, bash_*, ...) are refused by their type,
        # before a missing input_schema would be reported.
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(
                f"tool type {data.get('type')!r} is not supported; only custom "
                "tools with an input_schema are supported"
            )
        return data

    @field_validator("input_schema")
    @classmethod
    def _schema_is_an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if "type" not in schema:
            schema["type"] = "object"  # appended: the schema's key order is kept
        return schema


class AnthropicToolChangeReference(BaseModel):
    type: Literal["tool_reference"]
    name: str


class AnthropicToolChangeDefinition(BaseModel):
    type: Literal["tool_definition"]
    definition: AnthropicTool


AnthropicToolChange = Annotated[
    AnthropicToolChangeReference | AnthropicToolChangeDefinition, Field(discriminator="type")
]


class AnthropicContentBlock(BaseModel):
    type: Literal[
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    ]
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: AnthropicToolChange | None = None

    @model_validator(mode="after")
    def _tool_change_has_tool(self) -> AnthropicContentBlock:
        if self.type in ("tool_addition", "tool_removal"):
            if self.tool is None:
                raise ValueError(f"tool is required for {self.type} blocks")
            if self.type == "tool_removal" and self.tool.type != "tool_reference":
                raise ValueError("tool_removal only accepts a tool_reference")
        return self


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicContentBlock]

    @model_validator(mode="after")
    def _tool_changes_in_system_only(self) -> AnthropicMessage:
        if self.role != "system":
            _reject_tool_changes(self.content)
        return self


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named_choice_has_name(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")
        return self


class AnthropicJsonOutputFormat(BaseModel):
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    type: Literal["json_schema"] = "json_schema"


AnthropicEffort = Literal["low", "medium", "high", "xhigh", "max"]
AnthropicThinkingDisplay = Literal["summarized", "omitted", "updates"]


class AnthropicOutputConfig(BaseModel):
    effort: AnthropicEffort | None = None
    format: AnthropicJsonOutputFormat | None = None


class AnthropicThinkingConfigEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: AnthropicThinkingDisplay | None = None


class AnthropicThinkingConfigDisabled(BaseModel):
    type: Literal["disabled"]


class AnthropicThinkingConfigAdaptive(BaseModel):
    type: Literal["adaptive"]
    display: AnthropicThinkingDisplay | None = None


class AnthropicThinkingConfigBetweenTools(BaseModel):
    type: Literal["between_tools"]


AnthropicThinkingConfig = Annotated[
    AnthropicThinkingConfigEnabled
    | AnthropicThinkingConfigDisabled
    | AnthropicThinkingConfigAdaptive
    | AnthropicThinkingConfigBetweenTools,
    Field(discriminator="type"),
]


def _model_is_set(model: str) -> str:
    if not model:
        raise ValueError("Model is required")
    return model


class AnthropicMessagesRequest(BaseModel):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    metadata: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None
    thinking: AnthropicThinkingConfig | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    system: str | list[AnthropicContentBlock] | None = None
    temperature: float | None = None
    tool_choice: AnthropicToolChoice | None = None
    tools: list[AnthropicTool] | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's own fields.
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    watermarking: bool | None = None
    min_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        return _model_is_set(model)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, max_tokens: int) -> int:
        if max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        return max_tokens

    @field_validator("system")
    @classmethod
    def _system(cls, system: Any) -> Any:
        _reject_tool_changes(system)
        return system

    @model_validator(mode="before")
    @classmethod
    def _return_mm_kwargs_alias(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("return_mm_kwargs") is False
            and "mm_payload" not in data
        ):
            data = {**data, "mm_payload": "none"}
        return data

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> AnthropicMessagesRequest:
        # A disaggregated prefill leg (max_tokens=1) is exempt.
        if self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"):
            return self
        if (
            isinstance(self.thinking, AnthropicThinkingConfigEnabled)
            and self.thinking.budget_tokens >= self.max_tokens
        ):
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


class AnthropicCountTokensRequest(BaseModel):
    model: str
    messages: list[AnthropicMessage]
    output_config: AnthropicOutputConfig | None = None
    system: str | list[AnthropicContentBlock] | None = None
    thinking: AnthropicThinkingConfig | None = None
    tool_choice: AnthropicToolChoice | None = None
    tools: list[AnthropicTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        return _model_is_set(model)

    @field_validator("system")
    @classmethod
    def _system(cls, system: Any) -> Any:
        _reject_tool_changes(system)
        return system


AnyAnthropicRequest = AnthropicMessagesRequest | AnthropicCountTokensRequest


# --- error bodies ----------------------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """vLLM's ``translate_error_type``: Anthropic's vocabulary for an HTTP status."""
    if status in _ANTHROPIC_ERROR_TYPES:
        return _ANTHROPIC_ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
_TRACEBACK_LINE = re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?')
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?>/[\w\-]+)+/[\w\-]+\.\w+")


def sanitize_message(message: str) -> str:
    """vLLM 0.34's ``sanitize_message``, applied to every error message it sends: object
    addresses, traceback lines and file paths are scrubbed."""
    message = _ADDRESS.sub(">", message)
    message = _TRACEBACK_LINE.sub("", message)
    message = _SYSTEM_PATH.sub("<path>", message)
    if "." in message:
        message = _FILE_PATH.sub("<path>", message)
    return message.strip()


class HandlerError(Exception):
    """What vLLM's Messages handler answers with: an ErrorResponse (status, message) that
    the router translates into Anthropic's shape. ``str(exc)`` is the raw message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @classmethod
    def bad_request(
        cls, message: str, *, parameter: str | None = None, value: Any = None
    ) -> HandlerError:
        """A 400 from a ``VLLMValidationError`` (whose text names the parameter and value)
        or a plain ``ValueError``."""
        extras = []
        if parameter is not None:
            extras.append(f"parameter={parameter}")
        if value is not None:
            extras.append(f"value={value}")
        return cls(400, f"{message} ({', '.join(extras)})" if extras else message)

    @property
    def body(self) -> dict[str, Any]:
        return anthropic_error_body(self.status, sanitize_message(str(self)))


# vLLM 0.34's RequestValidationError handler: the error list, bounded.
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
# pydantic-core's schema kinds, which show up as segments of a union member's loc.
_SCHEMA_KIND_SEGMENTS = frozenset(
    [
        "function-wrap",
        "function-after",
        "function-before",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "chain",
        "default",
        "nullable",
        "tagged-union",
        "union",
        "call",
        "arguments",
        "is-instance",
        "is-subclass",
        "callable",
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "bytearray",
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "complex",
        "none",
        "nonetype",
    ]
)


def _is_schema_segment(segment: str) -> bool:
    return bool(_BRACKETED.search(segment)) or segment.lower() in _SCHEMA_KIND_SEGMENTS


def clean_loc(loc: tuple[Any, ...]) -> str:
    """An error's loc as a dotted path without pydantic's union-member segments."""
    kept = [str(p) for p in loc if not _is_schema_segment(str(p))]
    return ".".join(kept) if kept else ".".join(str(p) for p in loc)


def _input_summary(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:
        return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _error_line(error: Any) -> str:
    if isinstance(error, dict):
        error = dict(error)
        if "input" in error:
            error["input"] = _input_summary(error["input"])
        if isinstance(error.get("loc"), tuple | list):
            error["loc"] = clean_loc(tuple(error["loc"]))
    text = str(error)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def validation_error_body(errors: list[Any]) -> dict[str, Any]:
    """The 400 body vLLM 0.34 answers a request that fails FastAPI's validation with (its
    generic handler: the OpenAI error shape, not Anthropic's)."""
    param = None
    if errors and isinstance(errors[0], dict) and errors[0].get("loc"):
        param = clean_loc(tuple(errors[0]["loc"]))
    if errors:
        label = "error" if len(errors) == 1 else "errors"
        shown = errors[:_MAX_REPORTED_ERRORS]
        message = f"{len(errors)} validation {label}:\n"
        message += "".join(f"  {_error_line(e)}\n" for e in shown)
        if len(errors) > len(shown):
            message += f"  ...and {len(errors) - len(shown)} more {label}\n"
        message = message.rstrip()
    else:
        message = "Validation error"
    return {
        "error": {
            "message": sanitize_message(message),
            "type": HTTPStatus.BAD_REQUEST.phrase,
            "param": param,
            "code": 400,
        }
    }


def body_errors(errors: list[Any]) -> list[Any]:
    """pydantic's errors as FastAPI reports them for the request body: under ``body``."""
    return [
        {**{k: v for k, v in e.items() if k != "url"}, "loc": ("body", *e.get("loc", ()))}
        for e in errors
    ]


# --- the conversion to a chat completion request ---------------------------------------------


@dataclass
class ChatPlan:
    """The chat-completion request vLLM builds from a Messages request (the fields that
    reach the prompt, the sampling parameters and the generation)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # "auto", "required", "none", {"type": "function", "function": {"name": ...}} or None.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Sampling (None for count_tokens, which generates nothing).
    max_tokens: int | None = None
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    cache_salt: str | None = None
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _system_text(content: str | list[AnthropicContentBlock]) -> str | None:
    """An inline system message's text (billing-header blocks dropped); None if empty."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b.text
        for b in content
        if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_results(block: AnthropicContentBlock, out: list[dict[str, Any]]) -> None:
    """A user turn's tool_result: one tool message (then a user message with its images)."""
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        texts: list[str] = []
        for item in block.content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    content: Any = text or ""
    if references:
        content = references
        if text:
            content.append({"type": "text", "text": text})
    out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": content})
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
            }
        )


def _turn(message: AnthropicMessage, out: list[dict[str, Any]]) -> None:
    """One user or assistant message; its tool results land in ``out`` first."""
    turn: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, str):
        turn["content"] = message.content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in message.content:
            if block.type == "text" and block.text:
                parts.append({"type": "text", "text": block.text})
            elif block.type == "image" and block.source:
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
            elif block.type == "thinking" and block.thinking is not None:
                reasoning.append(block.thinking)
            elif block.type == "tool_use":
                calls.append(
                    {
                        "id": block.id or f"call_{int(time.time())}",
                        "type": "function",
                        "function": {
                            "name": block.name or "",
                            "arguments": json.dumps(block.input or {}),
                        },
                    }
                )
            elif block.type == "tool_result":
                if message.role == "user":
                    _tool_results(block, out)
                else:
                    result = str(block.content) if block.content else ""
                    parts.append({"type": "text", "text": f"Tool result: {result}"})
            # redacted_thinking, tool_reference, tool_addition/removal: nothing to render.
        if reasoning:
            turn["reasoning"] = "".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            turn["content"] = parts[0]["text"]
        elif parts:
            turn["content"] = parts
    # A user turn left without content (only tool results) is dropped.
    if message.role == "user" and "content" not in turn:
        return
    out.append(turn)


def _resolved_tools(request: AnyAnthropicRequest) -> list[AnthropicTool] | None:
    """The tools in effect at the end of the conversation (tool_addition / tool_removal
    blocks applied in order)."""
    changes = [
        block
        for message in request.messages
        if not isinstance(message.content, str)
        for block in message.content
        if block.type in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return request.tools
    tools = {tool.name: tool for tool in request.tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.tool
        assert change is not None
        if isinstance(change, AnthropicToolChangeDefinition):
            name = change.definition.name
            tools[name] = change.definition
        else:
            name = change.name
            if name not in tools:
                raise HandlerError.bad_request(
                    f"{block.type} references tool {name!r}, which is not declared in tools"
                )
            if block.type == "tool_addition":
                tools[name] = tools[name].model_copy(update={"defer_loading": None})
        if block.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


# vLLM's validate_cache_salt (ChatCompletionRequest's "before" validator).
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _check_cache_salt(salt: str | None) -> None:
    if salt is None:
        return
    if len(salt) > 128 or any(ch in _CACHE_SALT_FORBIDDEN for ch in salt):
        raise HandlerError.bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            parameter="cache_salt",
        )


def to_chat_plan(
    request: AnyAnthropicRequest,
    *,
    merge_inline_system: bool,
    disabled_thinking_effort: str = "none",
) -> ChatPlan:
    """vLLM 0.34's ``to_chat_completion_request``, step for step."""
    messages: list[dict[str, Any]] = []
    # The leading system message: the system field, plus the inline ones when merged.
    system_parts: list[str] = []
    if request.system:
        if isinstance(request.system, str):
            system_parts.append(request.system)
        else:
            system_parts += [
                b.text
                for b in request.system
                if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)
            ]
    if merge_inline_system:
        for message in request.messages:
            if message.role == "system" and (text := _system_text(message.content)):
                system_parts.append(text)
    if system_parts:
        messages.append({"role": "system", "content": "".join(system_parts)})
    for message in request.messages:
        if message.role == "system":
            if not merge_inline_system and (text := _system_text(message.content)):
                messages.append({"role": "system", "content": text})
            continue
        _turn(message, messages)

    plan = ChatPlan(messages=messages, chat_template_kwargs=request.chat_template_kwargs)
    if isinstance(request, AnthropicMessagesRequest):
        _check_cache_salt(request.cache_salt)
        plan.max_tokens = request.max_tokens
        plan.stop = request.stop_sequences
        plan.temperature = request.temperature
        plan.top_p = request.top_p
        plan.top_k = request.top_k
        plan.min_tokens = request.min_tokens
        plan.cache_salt = request.cache_salt
        plan.stream = bool(request.stream)

    output_config = request.output_config
    if output_config and output_config.format and output_config.format.json_schema:
        plan.response_format = {
            "type": output_config.format.type,
            "json_schema": {
                "name": output_config.format.type,
                "schema": output_config.format.json_schema,
            },
        }
    if output_config and output_config.effort is not None:
        plan.reasoning_effort = output_config.effort
    thinking = request.thinking
    if thinking is not None:
        if thinking.type in ("disabled", "between_tools"):
            plan.reasoning_effort = disabled_thinking_effort
        elif isinstance(thinking, AnthropicThinkingConfigEnabled):
            plan.thinking_token_budget = thinking.budget_tokens
        # "adaptive" pins nothing.

    choice = request.tool_choice
    if choice is not None:
        plan.parallel_tool_calls = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            plan.tool_choice = {"type": "function", "function": {"name": choice.name}}
        else:
            plan.tool_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    tools = _resolved_tools(request)
    if tools is not None:
        if plan.tool_choice is None:
            plan.tool_choice = "auto"
        plan.tools = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                    "strict": tool.strict,
                    "defer_loading": tool.defer_loading,
                },
            }
            for tool in tools
        ]
    return plan
