"""OpenAI's Responses API as vLLM 0.34 reads it (the chat-template path): the request models,
the handler's refusals, and the chat messages a Responses request becomes.

Written from vLLM 0.34.0's ``entrypoints/openai/responses/{protocol,utils}.py``,
``renderers/online_renderer.py`` (``render_responses``) and its error handlers; no code is
shared with vLLM. vLLM types the request with the ``openai`` SDK's models; the simulator does
not depend on that package, so the SDK types vLLM uses are declared here as the installed SDK
(openai 3.63) declares them, for the members the chat path reads:

* **Validation.** FastAPI validates the body against ``ResponsesRequest`` before vLLM's
  handler runs; pydantic's errors become vLLM's generic 400 (``{"error": {"message": "N
  validation error(s): ...", "type": "Bad Request", "param": "body.<field>", "code":
  400}}``). The request's fields, defaults, constraints and model validators are vLLM's, in
  vLLM's order, so the same body fails with the same errors. vLLM's model validators raise
  ``VLLMValidationError``, which pydantic does not wrap: it reaches vLLM's error handler and
  is answered ``{"error": {"message": "<text> (parameter=<p>)", "type": "BadRequestError",
  "param": "<p>", "code": 400}}`` (``tool_choice: "required"`` without tools, a named
  tool choice that names no tool, ``background`` with ``store: false``, any ``prompt``, a
  bad ``cache_salt``, a custom tool with a grammar format).
* **Input items.** The SDK's input union has some sixty members; the ones declared here
  are the message forms (``EasyInputMessageParam``, ``Message``,
  ``ResponseOutputMessageParam``), ``function_call`` / ``function_call_output``,
  ``reasoning``, ``item_reference`` and the output items vLLM's ``input_item_parsing``
  builds (``ResponseOutputMessage``, ``ResponseFunctionToolCall``,
  ``ResponseReasoningItem``). An item that validates as none of them is refused with the
  same status, type and ``param`` (``body.input``) as vLLM, but the error list names only
  these members (vLLM's lists all of them).
* **Conversion** (``construct_input_messages``): ``instructions`` become a leading system
  message; a string input is one user message; message items pass through as chat messages
  (``input_text``/``output_text`` parts render as text); an assistant output message
  becomes ``{"role": "assistant", "content": <its first part's text>}``; a
  ``function_call`` becomes an assistant ``tool_calls`` entry (merged into the assistant
  message before it); a ``function_call_output`` a ``tool`` message; a ``reasoning`` item
  the assistant's ``reasoning`` (content, else summary; encrypted content refused).
  Function tools become chat tools (``{"type": "function", "function": {name,
  description, parameters[, strict][, defer_loading]}}``), other tool types are not shown
  to the model. A trailing assistant message or reasoning item ``in_progress`` /
  ``incomplete`` is continued (``continue_final_message``) instead of prompting anew.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Required

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

from vllm_sim import protocol
from vllm_sim.anthropic_protocol import sanitize_message, validation_error_body

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")
_MAX_CACHE_SALT_LENGTH = 128
# vLLM's VLLM_MAX_STOP_STRINGS default.
MAX_STOP_STRINGS = 4


class VLLMValidationError(Exception):
    """vLLM's ``VLLMValidationError``: not a ``ValueError``, so a model validator raising it
    escapes pydantic and reaches vLLM's error handler (400, ``BadRequestError``)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{base} ({', '.join(extras)})" if extras else base


@dataclass
class ResponsesError(Exception):
    """An ``ErrorResponse`` vLLM's Responses handler answers with (OpenAI's error shape)."""

    status: int
    message: str
    err_type: str = "BadRequestError"
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @classmethod
    def from_validation(cls, exc: VLLMValidationError) -> ResponsesError:
        return cls(400, str(exc), "BadRequestError", exc.parameter)

    @classmethod
    def invalid(cls, message: str, param: str | None, status: int = 400) -> ResponsesError:
        return cls(status, message, "invalid_request_error", param)

    @property
    def body(self) -> dict[str, Any]:
        return protocol.error_body(
            sanitize_message(self.message), self.err_type, self.status, self.param
        )


def fastapi_validation_body(errors: list[Any]) -> dict[str, Any]:
    """vLLM's ``RequestValidationError`` handler: the bounded error list; ``param`` from a
    ``VLLMValidationError`` in an error's context, else the first error's location."""
    body = validation_error_body(errors)
    for error in errors:
        ctx_error = error.get("ctx", {}).get("error") if isinstance(error, dict) else None
        if isinstance(ctx_error, VLLMValidationError):
            body["error"]["param"] = ctx_error.parameter
            break
    return body


def body_errors(errors: list[Any]) -> list[Any]:
    """pydantic's errors as FastAPI reports them for the request body: under ``body``."""
    return [
        {**{k: v for k, v in e.items() if k != "url"}, "loc": ("body", *e.get("loc", ()))}
        for e in errors
    ]


# --- the SDK types vLLM's request is typed with (openai 3.63, field for field) ------------


class _SdkModel(BaseModel):
    """openai's ``BaseModel``: extra fields allowed (and echoed)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseInputTextParam(TypedDict, total=False):
    text: Required[str]
    type: Required[Literal["input_text"]]
    prompt_cache_breakpoint: dict[str, Any]


class ResponseInputImageParam(TypedDict, total=False):
    detail: Required[Literal["low", "high", "auto", "original"]]
    type: Required[Literal["input_image"]]
    file_id: str | None
    image_url: str | None
    prompt_cache_breakpoint: dict[str, Any]


class ResponseInputFileParam(TypedDict, total=False):
    type: Required[Literal["input_file"]]
    detail: Literal["auto", "low", "high"]
    file_data: str
    file_id: str | None
    file_url: str
    filename: str
    prompt_cache_breakpoint: dict[str, Any]


ResponseInputContentParam = (
    ResponseInputTextParam | ResponseInputImageParam | ResponseInputFileParam
)


class EasyInputMessageParam(TypedDict, total=False):
    content: Required[str | list[ResponseInputContentParam]]
    role: Required[Literal["user", "assistant", "system", "developer"]]
    phase: Literal["commentary", "final_answer"] | None
    type: Literal["message"]


class Message(TypedDict, total=False):
    content: Required[list[ResponseInputContentParam]]
    role: Required[Literal["user", "system", "developer"]]
    status: Literal["in_progress", "completed", "incomplete"]
    type: Literal["message"]


class ResponseOutputTextParam(TypedDict, total=False):
    annotations: Required[list[dict[str, Any]]]
    text: Required[str]
    type: Required[Literal["output_text"]]
    logprobs: list[dict[str, Any]]


class ResponseOutputRefusalParam(TypedDict, total=False):
    refusal: Required[str]
    type: Required[Literal["refusal"]]


class ResponseOutputMessageParam(TypedDict, total=False):
    id: Required[str]
    content: Required[list[ResponseOutputTextParam | ResponseOutputRefusalParam]]
    role: Required[Literal["assistant"]]
    status: Required[Literal["in_progress", "completed", "incomplete"]]
    type: Required[Literal["message"]]
    phase: Literal["commentary", "final_answer"] | None


class ResponseFunctionToolCallParam(TypedDict, total=False):
    arguments: Required[str]
    call_id: Required[str]
    name: Required[str]
    type: Required[Literal["function_call"]]
    id: str
    caller: dict[str, Any] | None
    namespace: str
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOutput(TypedDict, total=False):
    output: Required[str | list[ResponseInputContentParam]]
    type: Required[Literal["function_call_output"]]
    id: str | None
    call_id: str | None
    caller: dict[str, Any] | None
    name: str | None
    namespace: str | None
    status: Literal["in_progress", "completed", "incomplete"] | None


class _SummaryParam(TypedDict):
    text: str
    type: Literal["summary_text"]


class _ReasoningContentParam(TypedDict):
    text: str
    type: Literal["reasoning_text"]


class ResponseReasoningItemParam(TypedDict, total=False):
    id: Required[str]
    summary: Required[list[_SummaryParam]]
    type: Required[Literal["reasoning"]]
    content: list[_ReasoningContentParam]
    encrypted_content: str | None
    status: Literal["in_progress", "completed", "incomplete"]


class ItemReference(TypedDict, total=False):
    id: Required[str]
    type: Literal["item_reference"] | None


class ResponseOutputText(_SdkModel):
    annotations: list[dict[str, Any]]
    text: str
    type: Literal["output_text"]
    logprobs: list[dict[str, Any]] | None = None


class ResponseOutputRefusal(_SdkModel):
    refusal: str
    type: Literal["refusal"]


class ResponseOutputMessage(_SdkModel):
    id: str
    content: list[ResponseOutputText | ResponseOutputRefusal]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    type: Literal["message"]
    phase: Literal["commentary", "final_answer"] | None = None


class ResponseFunctionToolCall(_SdkModel):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"]
    id: str | None = None
    async_: bool | None = Field(default=None, alias="async")
    caller: dict[str, Any] | None = None
    namespace: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class Summary(_SdkModel):
    text: str
    type: Literal["summary_text"]


class Content(_SdkModel):
    text: str
    type: Literal["reasoning_text"]


class ResponseReasoningItem(_SdkModel):
    id: str
    summary: list[Summary]
    type: Literal["reasoning"]
    content: list[Content] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


ResponseOutputItem = ResponseOutputMessage | ResponseFunctionToolCall | ResponseReasoningItem
ResponseInputItemParam = (
    EasyInputMessageParam
    | Message
    | ResponseOutputMessageParam
    | ResponseFunctionToolCallParam
    | FunctionCallOutput
    | ResponseReasoningItemParam
    | ItemReference
)
ResponseInputOutputItem = ResponseInputItemParam | ResponseOutputItem


class FunctionTool(_SdkModel):
    name: str
    parameters: dict[str, object] | None = None
    strict: bool | None = None
    type: Literal["function"]
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    async_: bool | None = Field(default=None, alias="async")
    defer_loading: bool | None = None
    description: str | None = None
    output_schema: dict[str, object] | None = None


class OtherTool(_SdkModel):
    """Any other tool the SDK declares (vLLM's chat path shows none of them to the model)."""

    type: Literal[
        "file_search",
        "computer",
        "computer_use_preview",
        "web_search",
        "web_search_2025_08_26",
        "mcp",
        "code_interpreter",
        "programmatic_tool_calling",
        "image_generation",
        "local_shell",
        "shell",
        "custom",
        "namespace",
        "tool_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "apply_patch",
    ]


Tool = FunctionTool | OtherTool


class ToolChoiceAllowed(_SdkModel):
    mode: Literal["auto", "required"]
    tools: list[dict[str, object]]
    type: Literal["allowed_tools"]


class ToolChoiceTypes(_SdkModel):
    type: Literal[
        "file_search",
        "web_search_preview",
        "computer",
        "computer_use_preview",
        "computer_use",
        "web_search_preview_2025_03_11",
        "image_generation",
        "code_interpreter",
    ]


class ToolChoiceFunction(_SdkModel):
    name: str
    type: Literal["function"]


class ToolChoiceMcp(_SdkModel):
    server_label: str
    type: Literal["mcp"]
    name: str | None = None


class ToolChoiceCustom(_SdkModel):
    name: str
    type: Literal["custom"]


ToolChoice = (
    Literal["none", "auto", "required"]
    | ToolChoiceAllowed
    | ToolChoiceTypes
    | ToolChoiceFunction
    | ToolChoiceMcp
    | ToolChoiceCustom
)


class Reasoning(_SdkModel):
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    mode: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseFormatText(_SdkModel):
    type: Literal["text"]


class ResponseFormatTextJSONSchemaConfig(_SdkModel):
    name: str
    schema_: dict[str, object] = Field(alias="schema")
    type: Literal["json_schema"]
    description: str | None = None
    strict: bool | None = None


class ResponseFormatJSONObject(_SdkModel):
    type: Literal["json_object"]


class ResponseTextConfig(_SdkModel):
    format: (
        ResponseFormatText | ResponseFormatTextJSONSchemaConfig | ResponseFormatJSONObject | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsePrompt(_SdkModel):
    id: str
    variables: dict[str, Any] | None = None
    version: str | None = None


class PromptCacheOptionsParam(_SdkModel):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"
    comparison_response_id: str | None = None
    prewarm: bool | None = None


# --- vLLM's ResponsesRequest (field for field, validators in its order) ---------------------


def _default_input_image_details(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    content = value.get("content")
    if not isinstance(content, list):
        return value
    new_content = []
    changed = False
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image" and "detail" not in part:
            part = {**part, "detail": "auto"}
            changed = True
        new_content.append(part)
    return {**value, "content": new_content} if changed else value


def _top_logprobs(value: Any) -> Any:
    return 0 if value is None else value


def _thinking_token_budget(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if value < -1:
        raise ValueError(f"thinking_token_budget must be >= -1, got {value}")
    return value


def _validate_cache_salt(cache_salt: object) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            parameter="cache_salt",
        )
    if len(cache_salt) > _MAX_CACHE_SALT_LENGTH or any(
        char in _CACHE_SALT_FORBIDDEN_CHARS for char in cache_salt
    ):
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            parameter="cache_salt",
        )


def _random_suffix() -> str:
    return protocol.random_uuid()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    background: bool | None = False
    include: (
        list[
            Literal[
                "code_interpreter_call.outputs",
                "computer_call_output.output.image_url",
                "file_search_call.results",
                "message.input_image.image_url",
                "message.output_text.logprobs",
                "reasoning.encrypted_content",
            ],
        ]
        | None
    ) = None
    input: (
        str
        | list[
            Annotated[
                ResponseInputOutputItem,
                BeforeValidator(_default_input_image_details),
            ]
        ]
    )
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: ResponsePrompt | None = None
    reasoning: Reasoning | None = None
    include_reasoning: bool = True
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: ResponseTextConfig | None = None
    tool_choice: ToolChoice = "auto"
    tools: list[Tool] = Field(default_factory=list)
    top_logprobs: Annotated[int, BeforeValidator(_top_logprobs)] = 0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptionsParam | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    watermarking: bool | None = None
    request_id: str = Field(default_factory=lambda: f"resp_{_random_suffix()}")
    session_id: str | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    enable_response_messages: bool = False
    previous_input_messages: list[dict[str, Any]] | None = None
    structured_outputs: dict[str, Any] | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = []
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    thinking_token_budget: Annotated[int | None, BeforeValidator(_thinking_token_budget)] = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("prompt_cache_retention", mode="before")
    @classmethod
    def _normalize_prompt_cache_retention(cls, value: object) -> object:
        return "in_memory" if value == "in-memory" else value

    def is_include_output_logprobs(self) -> bool:
        return isinstance(self.include, list) and "message.output_text.logprobs" in self.include

    @model_validator(mode="before")
    @classmethod
    def apply_return_mm_kwargs_alias(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("return_mm_kwargs") is False
            and "mm_payload" not in data
        ):
            data = {**data, "mm_payload": "none"}
        return data

    @model_validator(mode="before")
    @classmethod
    def check_cache_salt_support(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _validate_cache_salt(data.get("cache_salt"))
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_background(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("background"):
            return data
        if not data.get("store", True):
            raise VLLMValidationError(
                "background can only be used when `store` is true", parameter="background"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt") is not None:
            raise VLLMValidationError("prompt template is not supported", parameter="prompt")
        return data

    @model_validator(mode="before")
    @classmethod
    def input_item_parsing(cls, data: Any) -> Any:
        """Function calls, reasoning items and assistant messages with list content become
        the SDK's output items (ids and statuses filled in); invalid ones are left for the
        union to refuse."""
        if not isinstance(data, dict):
            return data
        input_data = data.get("input")
        if input_data is None or isinstance(input_data, str | bytes):
            return data
        if not isinstance(input_data, list):
            try:
                input_data = list(input_data)
            except TypeError:
                return data
        processed: list[Any] = []
        for item in input_data:
            normalized = _normalize_item(item)
            if not isinstance(normalized, dict):
                processed.append(normalized)
                continue
            item_type = normalized.get("type")
            model: type[BaseModel] | None = None
            keep = normalized
            if item_type == "function_call":
                model = ResponseFunctionToolCall
            elif item_type == "reasoning":
                model = ResponseReasoningItem
            elif item_type == "message" and normalized.get("role") == "assistant":
                keep = item
                if isinstance(normalized.get("content"), list):
                    model = ResponseOutputMessage
            if model is None:
                processed.append(keep)
                continue
            try:
                processed.append(model.model_validate(normalized))
            except ValueError:
                processed.append(keep)
        data["input"] = processed
        return data

    @model_validator(mode="before")
    @classmethod
    def check_custom_tool_format(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        if not isinstance(tools, list):
            return data
        for tool in tools:
            if not isinstance(tool, dict):
                continue
            tool_format = tool.get("format")
            if (
                tool.get("type") == "custom"
                and isinstance(tool_format, dict)
                and tool_format.get("type") == "grammar"
            ):
                raise VLLMValidationError(
                    "Custom tools with a grammar format are not supported; "
                    "only free-form text custom tools are accepted.",
                    parameter="tools",
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        tool_choice = data.get("tool_choice", "auto")
        has_tools = tools is not None and len(tools) > 0
        is_named = isinstance(tool_choice, dict) and tool_choice.get("type") in (
            "function",
            "custom",
        )
        not_found = "Tool choice 'function' not found in 'tools' parameter."
        if not has_tools:
            if tool_choice in ("auto", "none"):
                data["tool_choice"] = "none"
            elif tool_choice == "required":
                raise VLLMValidationError(
                    "Tool choice 'required' must be specified with 'tools' parameter.",
                    parameter="tool_choice",
                )
            elif is_named:
                raise VLLMValidationError(not_found, parameter="tool_choice")
        elif is_named and tools is not None:
            name = tool_choice.get("name")
            names = {
                tool.get("name") if isinstance(tool, dict) else getattr(tool, "name", None)
                for tool in tools
            }
            # vLLM also resolves a bare name declared in one namespace tool (not modelled).
            if not name or name not in names:
                raise VLLMValidationError(not_found, parameter="tool_choice")
        return data


def _normalize_item(item: Any) -> Any:
    """``_normalize_openresponses_input_item``: ``type``, ``id``, ``status`` (and a reasoning
    item's ``summary``, an output text's ``annotations``) filled in on assistant messages and
    reasoning items."""
    if not isinstance(item, dict):
        return item
    item_type = item.get("type", "message")
    if not (
        item_type == "reasoning" or (item_type == "message" and item.get("role") == "assistant")
    ):
        return item
    out = item.copy()
    out["type"] = item_type
    if out.get("id") in (None, ""):
        prefix = "rs" if item_type == "reasoning" else "msg"
        out["id"] = f"{prefix}_{protocol.random_uuid()}"
    if out.get("status") in (None, ""):
        out["status"] = "completed"
    if item_type == "reasoning" and out.get("summary") is None:
        out["summary"] = []
    if item_type == "message" and isinstance(out.get("content"), list):
        out["content"] = [
            {**part, "annotations": []}
            if isinstance(part, dict)
            and part.get("type") == "output_text"
            and "annotations" not in part
            else part
            for part in out["content"]
        ]
    return out


# --- the conversion to chat messages (vLLM's construct_input_messages) ---------------------


def should_continue_final_message(request_input: str | list[Any]) -> bool:
    if isinstance(request_input, str) or not request_input:
        return False
    last = request_input[-1]
    if isinstance(last, ResponseOutputMessage | ResponseReasoningItem):
        return last.status in ("in_progress", "incomplete")
    if isinstance(last, dict):
        if last.get("type", "message") not in ("message", "reasoning"):
            return False
        return last.get("status") in ("in_progress", "incomplete")
    return False


def _text_of(part: Any) -> str:
    return str(part.get("text", "")) if isinstance(part, dict) else str(part)


def _message_from_item(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One chat message, or None when the item merged into the assistant message before."""
    prev_assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if isinstance(item, ResponseFunctionToolCall):
        name = f"{item.namespace}__{item.name}" if item.namespace else item.name
        call = {
            "id": item.call_id,
            "function": {"name": name, "arguments": item.arguments},
            "type": "function",
        }
        if prev_assistant is not None:
            calls = prev_assistant.get("tool_calls")
            if calls is None:
                prev_assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                calls.append(call)
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if isinstance(item, ResponseReasoningItem):
        reasoning = ""
        if item.encrypted_content:
            raise VLLMValidationError("Encrypted content is not supported.", parameter="input")
        if item.content:
            reasoning = item.content[0].text
        elif item.summary:
            reasoning = item.summary[0].text
        if prev_assistant is not None and prev_assistant.get("reasoning") is None:
            prev_assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if isinstance(item, ResponseOutputMessage):
        first = item.content[0] if item.content else None
        text = getattr(first, "text", None) if first is not None else ""
        if prev_assistant is not None and prev_assistant.get("content") is None:
            prev_assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if isinstance(item, dict) and item.get("type") in (
        "function_call_output",
        "custom_tool_call_output",
    ):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if isinstance(item, dict) and item.get("type") == "reasoning":
        content, summary = item.get("content"), item.get("summary")
        text = ""
        if content:
            text = _text_of(next(iter(content)))
        elif summary:
            text = _text_of(next(iter(summary)))
        if prev_assistant is not None and prev_assistant.get("reasoning") is None:
            prev_assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if isinstance(item, dict) and item.get("role") == "assistant":
        raw = item.get("content")
        if raw and not isinstance(raw, str):
            parts = list(raw)
            text = _text_of(parts[0]) if parts else ""
        elif isinstance(raw, str):
            text = raw
        else:
            text = ""
        if prev_assistant is not None and prev_assistant.get("content") is None:
            prev_assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if isinstance(item, dict) and "role" in item:
        return item
    item_type = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    raise VLLMValidationError(f"Unsupported input item type: {item_type}", parameter="input")


def construct_input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a request (no stored history: see the module)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    converted: list[dict[str, Any]] = []
    for item in request.input:
        message = _message_from_item(item, converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    messages.extend(converted)
    return messages


def construct_tool_dicts(
    request: ResponsesRequest, exclude_when_none: bool
) -> list[dict[str, Any]] | None:
    """The request's function tools as chat tools (``FunctionDefinition``'s dump: ``strict``
    and ``defer_loading`` only when set); None when there are none to show."""
    if not request.tools or (request.tool_choice == "none" and exclude_when_none):
        return None
    out = []
    for tool in request.tools:
        if not isinstance(tool, FunctionTool):
            continue
        function: dict[str, Any] = {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        }
        if tool.strict is not None:
            function["strict"] = tool.strict
        if tool.defer_loading is not None:
            function["defer_loading"] = tool.defer_loading
        out.append({"type": "function", "function": function})
    return out


# --- the response object ----------------------------------------------------------------------


@dataclass
class Sampling:
    """The ``SamplingParams`` fields the response echoes."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    stop: list[str] = field(default_factory=list)


_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


def to_sampling(request: ResponsesRequest, default_max_tokens: int) -> Sampling:
    """``to_sampling_params`` and ``SamplingParams``' checks, in vLLM's order (raised as
    ``VLLMValidationError``)."""
    max_tokens = (
        default_max_tokens
        if request.max_output_tokens is None
        else min(request.max_output_tokens, default_max_tokens)
    )
    temperature = 1.0 if request.temperature is None else float(request.temperature)
    top_p = 1.0 if request.top_p is None else float(request.top_p)
    top_k = 0 if request.top_k is None else request.top_k
    min_p = 0.0 if request.min_p is None else float(request.min_p)
    repetition = 1.0 if request.repetition_penalty is None else float(request.repetition_penalty)
    presence = 0.0 if request.presence_penalty is None else float(request.presence_penalty)
    frequency = 0.0 if request.frequency_penalty is None else float(request.frequency_penalty)
    stop = request.stop or []
    if isinstance(stop, str):
        stop = [stop]
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP

    if not math.isfinite(repetition):
        raise VLLMValidationError(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise VLLMValidationError(
            f"repetition_penalty must be greater than zero, got {repetition}."
        )
    if not math.isfinite(temperature):
        raise VLLMValidationError(
            f"temperature must be a finite number, got {temperature}.",
            parameter="temperature",
            value=temperature,
        )
    if temperature < 0.0:
        raise VLLMValidationError(
            f"temperature must be non-negative, got {temperature}.",
            parameter="temperature",
            value=temperature,
        )
    if temperature > 2.0:
        raise VLLMValidationError(
            f"temperature must be in [0, 2], got {temperature}.",
            parameter="temperature",
            value=temperature,
        )
    if not 0.0 < top_p <= 1.0:
        raise VLLMValidationError(
            f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p
        )
    if top_k < -1:
        raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise VLLMValidationError(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise VLLMValidationError(
            f"max_tokens must be at least 1, got {max_tokens}.",
            parameter="max_tokens",
            value=max_tokens,
        )
    if any(not s for s in stop):
        raise VLLMValidationError("stop cannot contain an empty string.")
    if temperature < _SAMPLING_EPS:
        top_p, top_k, min_p = 1.0, 0, 0.0
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logprobs=request.top_logprobs if request.is_include_output_logprobs() else None,
        stop=list(stop),
    )


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


def usage_body(prompt: int, output: int, cached: int, cache_write: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` for one turn (no reasoning parser: no reasoning tokens)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": cache_write,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def response_body(
    request: ResponsesRequest,
    sampling: Sampling,
    *,
    model_name: str,
    created_at: int,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """``ResponsesResponse.from_request`` dumped (``mode="json"``, by alias), field order
    as declared; ``metrics`` left out (not enabled)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    parallel = request.parallel_tool_calls if request.parallel_tool_calls is not None else True
    options = request.prompt_cache_options
    return {
        "id": request.request_id,
        "created_at": created_at,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "metadata": request.metadata,
        "model": model_name,
        "object": "response",
        "output": output,
        "parallel_tool_calls": parallel,
        "temperature": sampling.temperature,
        "tool_choice": _dump(request.tool_choice),
        "tools": _dump(request.tools),
        "top_p": sampling.top_p,
        "background": request.background,
        "max_output_tokens": sampling.max_tokens,
        "max_tool_calls": request.max_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt": None,
        "prompt_cache_options": (
            None
            if options is None
            else {
                "mode": options.mode,
                "ttl": options.ttl,
                "comparison_response_id": options.comparison_response_id,
            }
        ),
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "reasoning": _dump(request.reasoning),
        "safety_identifier": request.safety_identifier,
        "service_tier": request.service_tier,
        "status": status,
        "text": _dump(request.text),
        "top_logprobs": sampling.logprobs,
        "truncation": request.truncation,
        "usage": usage,
        "user": request.user,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def output_text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_message(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """``ResponseOutputMessage`` dumped (openai 3.63 adds ``phase``)."""
    return {
        "id": item_id,
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def now() -> int:
    return int(time.time())
