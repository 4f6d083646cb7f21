"""``POST /v1/responses`` on a gpt-oss model: the prompt vLLM 0.34 renders through harmony.

vLLM does not render a Responses request on gpt-oss as a chat: its harmony path
(``vllm/renderers/online_renderer.py``: ``_render_responses_with_harmony``, with
``build_harmony_preamble`` and ``extract_instructions_from_messages`` of
``parser/harmony_utils.py`` and ``response_input_to_harmony`` of
``responses/harmony.py``) builds harmony messages from the request itself:

* the preamble: a system message with ``reasoning.effort`` as ``--reasoning-effort-map``
  rewrites it (low/medium/high, anything else is refused) and the date, then a developer
  message with the instructions (``instructions``, or a leading system/developer input
  message's text when it is absent) and the function tools, when there is either; tools
  are shown only when one of them is not a built-in one, and a tool that is neither a
  function nor a built-in is refused; ``tool_choice`` is not read;
* each input item as one message: a message with all its parts (an assistant's on the final
  channel; a system/developer one as instructions, or nothing without text), a function
  call on the commentary channel to ``functions.NAME`` (json), a function call output from
  the latest call with its ``call_id`` (none: refused), a reasoning item's contents joined by
  newlines on the analysis channel (without content: an empty assistant message); any other
  item is refused;
* rendered for a new assistant turn, analysis before the last final answer dropped, prior
  tool calls in the older header layout.

``include`` asking for output logprobs is refused before (``logprobs are not supported with
gpt-oss models``). Refusals inside the item conversion are ``invalid_request_error`` with
param ``input``; the preamble's are ``VLLMValidationError`` (``BadRequestError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_sim.chat_flags import map_reasoning_effort
from vllm_sim.engine_tokenizers import (
    HARMONY_EFFORTS,
    HarmonySimTokenizer,
    _flatten,
    _harmony_developer,
    _harmony_system,
    _older_tool_call_headers,
    _without_superseded_reasoning,
)
from vllm_sim.responses_protocol import (
    FunctionTool,
    ResponseFunctionToolCall,
    ResponsesError,
    ResponsesRequest,
    VLLMValidationError,
)

# vLLM's BUILTIN_TOOL_TO_MCP_SERVER_LABEL values: tools harmony describes in the system
# message when a tool server runs them (the simulator has none).
_BUILTIN_TOOLS = frozenset({"code_interpreter", "web_search_preview", "container"})
LOGPROBS_REFUSED = "logprobs are not supported with gpt-oss models"


def refuse_logprobs(req: ResponsesRequest) -> None:
    """serving.py's ``_validate_create_responses_input`` on gpt-oss."""
    if isinstance(req.include, list) and "message.output_text.logprobs" in req.include:
        raise ResponsesError.invalid(LOGPROBS_REFUSED, "logprobs")


def harmony_messages(
    tokenizer: HarmonySimTokenizer,
    req: ResponsesRequest,
    effort_map: Mapping[str, str] | None = None,
) -> list[Any]:
    """The harmony messages vLLM builds for ``req`` on a gpt-oss model (``effort_map``: the
    server's ``--reasoning-effort-map``)."""
    return _preamble_and_input(req, tokenizer.system_instructions, effort_map)


def render_harmony(tokenizer: HarmonySimTokenizer, messages: list[Any]) -> list[int]:
    """vLLM's ``render_for_completion``: the prompt token ids of ``messages``."""
    from openai_harmony import Conversation, RenderConversationConfig, Role

    try:
        ids = tokenizer._harmony.render_conversation_for_completion(
            Conversation.from_messages(_without_superseded_reasoning(messages)),
            Role.ASSISTANT,
            config=RenderConversationConfig(auto_drop_analysis=False),
        )
        return _older_tool_call_headers(tokenizer._harmony, list(ids))
    except Exception as exc:  # the library's own refusals (special-token text in a header)
        raise ResponsesError(400, str(exc)) from exc


def _preamble_and_input(
    req: ResponsesRequest, in_system: bool, effort_map: Mapping[str, str] | None
) -> list[Any]:
    # Tool types as extract_tool_types collects them (no MCP label is allow-listed).
    tool_types = {tool.type for tool in req.tools if tool.type != "mcp"}
    with_tools = not tool_types <= _BUILTIN_TOOLS
    items: str | list[Any] = req.input
    instructions = req.instructions
    if instructions is None and isinstance(items, list) and items:
        first = _as_dict(items[0], exclude_none=True)
        if first.get("role") in ("system", "developer"):
            instructions = _flatten(first.get("content"))
            items = items[1:]
    effort = map_reasoning_effort(
        req.reasoning.effort if req.reasoning is not None else None, effort_map
    )
    if effort is not None and effort not in HARMONY_EFFORTS:
        raise ResponsesError.from_validation(
            VLLMValidationError(
                f"reasoning_effort={effort!r} is not supported by Harmony. "
                f"Supported values are: {', '.join(HARMONY_EFFORTS)}.",
                parameter="reasoning_effort",
            )
        )
    tools = _function_tools(req) if with_tools else None
    messages: list[Any] = [_harmony_system(instructions if in_system else None, effort)]
    if (instructions and not in_system) or tools:
        messages.append(_harmony_developer(instructions, tools, in_system))
    if isinstance(items, str):
        from openai_harmony import Message, Role

        messages.append(Message.from_role_and_content(Role.USER, items))
        return messages
    calls: list[ResponseFunctionToolCall] = []
    try:
        for item in items:
            message = _item_message(item, calls, in_system)
            if message is not None:
                messages.append(message)
            if isinstance(item, ResponseFunctionToolCall):
                calls.append(item)
    except (ValueError, VLLMValidationError) as exc:
        raise ResponsesError.invalid(str(exc), "input") from exc
    return messages


def _function_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """get_developer_message's tools: functions shown, built-ins skipped, others refused."""
    tools = []
    for tool in req.tools:
        if tool.type in _BUILTIN_TOOLS:
            continue
        if not isinstance(tool, FunctionTool):
            raise ResponsesError.from_validation(
                VLLMValidationError(f"tool type {tool.type!r} is not supported.", parameter="tools")
            )
        function = {"name": tool.name, "description": tool.description}
        tools.append({"type": "function", "function": {**function, "parameters": tool.parameters}})
    return tools


def _as_dict(item: Any, *, exclude_none: bool = False) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    dumped: dict[str, Any] = item.model_dump(exclude_none=exclude_none)
    return dumped


def _item_message(item: Any, calls: list[ResponseFunctionToolCall], in_system: bool) -> Any:
    """response_input_to_harmony: one item's message (None: a system/developer message
    without text)."""
    from openai_harmony import Author, Message, Role, TextContent

    data = _as_dict(item)
    kind = data.get("type")
    if kind == "message" or (kind is None and "role" in data):
        role, content = data["role"], data["content"]
        if role in ("system", "developer"):
            text = _flatten(content)
            if not text:
                return None
            if role == "system" and in_system:
                return _harmony_system(text)
            return _harmony_developer(text, None, in_system)
        if isinstance(content, str):
            message = Message.from_role_and_content(role, content)
        else:
            texts = [TextContent(text=part.get("text", "")) for part in content]
            message = Message.from_role_and_contents(role, texts)
        return message.with_channel("final") if role == "assistant" else message
    if kind == "function_call_output":
        call_id = data["call_id"]
        call = next((c for c in reversed(calls) if c.call_id == call_id), None)
        if call is None:
            raise VLLMValidationError(f"No call message found for {call_id}", parameter="input")
        author = Author.new(Role.TOOL, f"functions.{call.name}")
        return (
            Message.from_author_and_content(author, data["output"])
            .with_channel("commentary")
            .with_recipient("assistant")
        )
    if kind == "reasoning" or (kind is None and "summary" in data):
        content = data.get("content")
        if content:
            text = "\n".join(part["text"] for part in content)
            return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis")
        return Message.from_role_and_content(Role.ASSISTANT, "")
    if kind == "function_call":
        return (
            Message.from_role_and_content(Role.ASSISTANT, data["arguments"])
            .with_channel("commentary")
            .with_recipient(f"functions.{data['name']}")
            .with_content_type("json")
        )
    raise VLLMValidationError(f"Unknown input type: {kind}", parameter="input")
