# ruff: noqa: RUF001, RUF002 (the fullwidth bars are the models' own token spelling)
"""Counting for DeepSeek V3.2 and V4, whose chats vLLM builds with Python encoders.

vLLM never applies a chat template to these models: its ``deepseek_v32`` and ``deepseek_v4``
tokenizer modes (chosen by ``auto`` from the architecture, see ``modes``) replace
``apply_chat_template`` with DeepSeek's own prompt encoders, then tokenize the prompt string
like any other chat prompt: with the model's ``tokenizer.json``, ``add_special_tokens`` as the
request says (False by default), and every added token matched wherever its text appears, so
``<｜User｜>`` typed into a message is that one token (the engine's count, not a lower one).

What reaches the encoder, as vLLM hands it over:

* messages preprocessed like every chat (``parse_messages``): V3.2 with string content
  (text parts joined with a newline), V4 with OpenAI parts (joined with a blank line by
  the encoder); tool-call arguments already parsed into objects;
* tools shaped as vLLM's ``model_dump()`` (declared fields only), put in a new leading
  system message (V3.2) or on the first system message, a new one only when there is none
  (V4);
* ``chat_template_kwargs``: ``thinking`` / ``enable_thinking`` (V3.2 default off, V4 default
  on), ``reasoning_effort`` (V4: none/low/high/max and their aliases), V4's
  ``drop_thinking``. vLLM also passes the request's own ``reasoning_effort`` field and
  derives ``enable_thinking`` from it when ``chat_template_kwargs`` leaves that unset
  (``render_deepseek_prompt(reasoning_effort=...)``); the counting API carries that field
  on its ``chat_template_kwargs`` (``tokenize.request_fields.ChatTemplateKwargs``).

Neither encoder reads ``add_generation_prompt`` or ``continue_final_message``: a user turn
always ends in ``<｜Assistant｜>`` and a thinking marker, an assistant turn always in the
end-of-sentence token. The prompt text (tool instructions, effort prompts, markup) is the
models' published format, reproduced byte for byte because every byte is counted.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from kvgate.tokenize.counter import CountPlan, PromptCounter
from kvgate.tokenize.errors import PromptRenderError
from kvgate.tokenize.messages import parse_messages

EncoderVersion = Literal["v32", "v4"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

_V32_TOOLS_PREAMBLE = (
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<{d}function_calls>" block like the following as'
    " part of your reply to the user:\n"
    "<{d}function_calls>\n"
    '<{d}invoke name="$FUNCTION_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
    "...\n"
    "</{d}invoke>\n"
    '<{d}invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    "</{d}invoke>\n"
    "</{d}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes,"
    ' while lists and objects should use JSON format. The "string" attribute should be set'
    ' to "true" for string type parameters and "false" for other types (numbers, booleans,'
    " arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly"
    " consider outputting a thinking block. Here is an example:\n"
    "<{d}function_calls>\n"
    "...\n"
    "</{d}function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "{o}...thinking about results{c}\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    "{schemas}\n"
    "</functions>\n"
)
_V4_TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke"
    ' tools by writing a "<{d}tool_calls>" block like the following:\n\n'
    "<{d}tool_calls>\n"
    '<{d}invoke name="$TOOL_NAME">\n'
    '<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n'
    "...\n"
    "</{d}invoke>\n"
    '<{d}invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</{d}invoke>\n"
    "</{d}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other'
    " types (numbers, booleans, arrays, objects), pass the value in JSON format and set"
    ' `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by {o}), you MUST output your complete reasoning"
    " inside {o}...{c} BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after {c} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke"
    " tool calls.\n"
)
# V4 thinking mode opens the conversation with the effort's instructions ("low": none).
V4_EFFORT_PROMPTS = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem"
        " to resolve the root cause, rigorously stress-testing your logic against all"
        " potential paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every"
        " intermediate step, considered alternative, and rejected hypothesis to ensure"
        " absolutely no assumption is left unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to"
        " chance: exhaustively decompose the problem into its most fundamental components,"
        " trace every causal chain to its root, and resolve the underlying cause rather than"
        " any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from"
        " multiple angles and are certain that no assumption remains unchecked and no error"
        " remains undiscovered.\n\n"
    ),
}
_TOOL_FUNCTION_FIELDS = ("name", "description", "parameters")
# Keys vLLM passes to the encoder by name: the same key in chat_template_kwargs is a
# duplicate keyword argument there, so the request fails.
_RESERVED_KWARGS = ("conversation", "messages")


def _text(value: Any) -> str:
    """A value as ``str.format`` writes it into the prompt."""
    return value if isinstance(value, str) else format(value)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def _functions(tools: Any) -> list[Any]:
    if not isinstance(tools, list):
        raise PromptRenderError("a message's tools must be a list")
    functions = []
    for tool in tools:
        if not isinstance(tool, Mapping) or "function" not in tool:
            raise PromptRenderError("each tool needs a 'function'")
        functions.append(tool["function"])
    return functions


def _tools_section(tools: Any, version: EncoderVersion) -> str:
    schemas = "\n".join(_json(function) for function in _functions(tools))
    preamble = _V32_TOOLS_PREAMBLE if version == "v32" else _V4_TOOLS_PREAMBLE
    return preamble.format(d=DSML, o=THINK_OPEN, c=THINK_CLOSE, schemas=schemas)


def _parameter(name: str, value: Any) -> str:
    """A string argument goes in as it is; any other value as JSON."""
    if isinstance(value, str):
        return f'<{DSML}parameter name="{name}" string="true">{value}</{DSML}parameter>'
    return f'<{DSML}parameter name="{name}" string="false">{_json(value)}</{DSML}parameter>'


def _arguments_object(arguments: Any) -> Mapping[str, Any]:
    """Arguments as vLLM hands them over: JSON text parsed, and anything that is not an
    object (invalid JSON, a list, a number) an empty object, so the turn still renders."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, Mapping) else {}


def _tool_calls_block(calls: list[Any], block: str) -> str:
    """``\\n\\n<｜DSML｜BLOCK>`` with one invoke per call, each argument a parameter."""
    invokes = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or "name" not in function:
            raise PromptRenderError("a tool call needs a 'function' with a 'name'")
        arguments = _arguments_object(function.get("arguments"))
        parameters = "\n".join(_parameter(_text(key), value) for key, value in arguments.items())
        invokes.append(
            f'<{DSML}invoke name="{_text(function["name"])}">\n{parameters}\n</{DSML}invoke>'
        )
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    return max(
        (i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")),
        default=-1,
    )


def _without_stale_reasoning(
    messages: list[dict[str, Any]], kept_roles: frozenset[str]
) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, roles outside
    ``kept_roles`` (developer messages among them) are left out altogether."""
    last_user = _last_user_index(messages)
    kept = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in kept_roles or i >= last_user:
            kept.append(message)
        elif role == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning"})
    return kept


# -- DeepSeek V3.2 ------------------------------------------------------------------------------


def encode_v32(messages: list[dict[str, Any]], *, thinking: bool, drop_thinking: bool) -> str:
    """The V3.2 prompt string for a conversation that already holds its tools message."""
    if thinking and drop_thinking:
        kept = _without_stale_reasoning(messages, frozenset({"user", "system", "tool"}))
        if len(kept) < len(messages):
            # vLLM's V3.2 encoder still renders as many messages as it was given, past the
            # end of the shortened list: a developer message before the last user turn
            # fails the request in thinking mode.
            raise PromptRenderError(
                "in thinking mode DeepSeek V3.2 fails on a developer message before the last "
                "user message"
            )
        messages = kept
    last_user = _last_user_index(messages)
    return BOS + "".join(
        _v32_message(i, messages, thinking, last_user) for i in range(len(messages))
    )


def _v32_message(i: int, messages: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
    message = messages[i]
    role = message.get("role")
    content = message.get("content")
    tools = message.get("tools")
    # Only the newest user turn opens a thought; every other one closes it at once.
    marker = THINK_OPEN if thinking and i == last_user else THINK_CLOSE
    if role == "system":
        return (content or "") + (("\n\n" + _tools_section(tools, "v32")) if tools else "")
    if role == "developer":
        if not content:
            raise PromptRenderError("a developer message needs content")
        body = ("\n\n" + _tools_section(tools, "v32")) if tools else ""
        return f"{USER}{body}\n\n# The user's message is: {_text(content)}{ASSISTANT}{marker}"
    if role == "user":
        return f"{USER}{_text(content)}{ASSISTANT}{marker}"
    if role == "tool":
        return _v32_tool_result(i, messages, thinking, last_user)
    if role == "assistant":
        calls = message.get("tool_calls")
        calls_block = _tool_calls_block(calls, "function_calls") if calls else ""
        reasoning_part = ""
        if thinking and i > last_user:
            reasoning = message.get("reasoning")
            if not (reasoning or calls):
                raise PromptRenderError(
                    "in thinking mode an assistant turn after the last user message needs "
                    "reasoning or tool calls"
                )
            reasoning_part = _text(reasoning or "") + THINK_CLOSE
        return f"{reasoning_part}{_text(content or '')}{calls_block}{EOS}"
    raise PromptRenderError(f"role {role!r} is not supported by the DeepSeek V3.2 format")


def _v32_tool_result(i: int, messages: list[dict[str, Any]], thinking: bool, last_user: int) -> str:
    """One result inside ``<function_results>``: the block opens at the first result of the
    assistant turn's calls and closes after as many results as it made calls."""
    caller = i - 1
    while caller >= 0 and messages[caller].get("role") == "tool":
        caller -= 1
    # A leading tool message is read against the conversation's last message, as in vLLM.
    assistant = messages[caller]
    if not (i == 0 or (caller >= 0 and assistant.get("role") == "assistant")):
        raise PromptRenderError("a tool message must follow an assistant's tool calls")
    position = i - caller
    calls = assistant.get("tool_calls")
    if not (calls and len(calls) >= position):
        raise PromptRenderError("a tool result has no tool call to answer")
    out = "\n\n<function_results>" if position == 1 else ""
    out += f"\n<result>{_text(messages[i].get('content'))}</result>"
    if position == len(calls):
        marker = THINK_OPEN if thinking and i >= last_user else THINK_CLOSE
        out += "\n</function_results>\n\n" + marker
    return out


# -- DeepSeek V4 --------------------------------------------------------------------------------


def _v4_flatten(content: Any) -> Any:
    """OpenAI parts to one text (a blank line between parts); anything else as it is."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            texts.append(_text(part))
        elif part.get("type") in ("image", "image_url"):
            texts.append(IMAGE_PLACEHOLDER)
        elif part.get("type") == "text":
            texts.append(part.get("text", ""))
        else:
            raise PromptRenderError(f"content part type {part.get('type')!r} is not supported")
    return "\n\n".join(texts)


def _v4_merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """V4 has no tool role: results join the user turn that follows the calls, as blocks,
    and so does a user message right after them (or after another user message)."""
    merged: list[dict[str, Any]] = []
    for original in messages:
        message = copy.deepcopy(original)
        role = message.get("role")
        previous = merged[-1] if merged else None
        open_user = previous is not None and previous.get("role") == "user" and "blocks" in previous
        if role == "tool":
            block = {
                "type": "tool_result",
                "id": message.get("tool_call_id", ""),
                "content": message.get("content", ""),
            }
            if open_user and previous is not None:
                previous["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            text = _v4_flatten(message.get("content", ""))
            block = {"type": "text", "text": text}
            if open_user and previous is not None and previous.get("task") is None:
                previous["blocks"].append(block)
            else:
                user: dict[str, Any] = {"role": "user", "content": text, "blocks": [block]}
                if "task" in message:
                    user["task"] = message["task"]
                merged.append(user)
        else:
            merged.append(message)
    return merged


def _v4_order_results_by_call(messages: list[dict[str, Any]]) -> None:
    """Results in a user turn take the order of the calls they answer (stable; unknown ids
    sort first)."""
    call_order: dict[Any, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            call_order = {}
            for n, call in enumerate(message["tool_calls"]):
                function = call.get("function", {}) if isinstance(call, Mapping) else {}
                call_id = call.get("id") or function.get("id", "")
                if call_id:
                    call_order[call_id] = n
        elif message.get("role") == "user" and message.get("blocks"):
            blocks = message["blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) < 2 or not call_order:
                continue
            ordered = iter(sorted(results, key=lambda b: call_order.get(b.get("id", ""), 0)))
            message["blocks"] = [
                next(ordered) if b.get("type") == "tool_result" else b for b in blocks
            ]


def _v4_user_blocks(blocks: list[dict[str, Any]]) -> str:
    texts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block.get("text", "")))
        elif kind == "tool_result":
            result = block.get("content", "")
            if isinstance(result, list):
                result = "\n\n".join(
                    part.get("text", "")
                    if part.get("type") == "text"
                    else f"[Unsupported {part.get('type')}]"
                    for part in result
                )
            texts.append(f"<tool_result>{_text(result)}</tool_result>")
        else:
            texts.append(f"[Unsupported {kind}]")
    return "\n\n".join(texts)


def encode_v4(
    messages: list[dict[str, Any]], *, thinking: bool, drop_thinking: bool, effort: str | None
) -> str:
    """The V4 prompt string for a conversation that already carries its tools."""
    messages = _v4_merge_tool_results(messages)
    _v4_order_results_by_call(messages)
    # Reasoning stays in view whenever the conversation declares tools.
    if any(m.get("tools") for m in messages):
        drop_thinking = False
    if thinking and drop_thinking:
        messages = _without_stale_reasoning(
            messages,
            frozenset({"user", "system", "tool", "latest_reminder", "direct_search_results"}),
        )
    effort = effort or "low"
    if effort not in V4_EFFORT_PROMPTS:
        raise PromptRenderError(f"reasoning effort {effort!r} is not one of low, high, max")
    last_user = _last_user_index(messages)
    prompt = BOS
    for i in range(len(messages)):
        if i == 0 and thinking:
            prompt += V4_EFFORT_PROMPTS[effort]
        prompt += _v4_message(i, messages, thinking, drop_thinking, last_user)
    return prompt


def _v4_message(
    i: int, messages: list[dict[str, Any]], thinking: bool, drop_thinking: bool, last_user: int
) -> str:
    message = messages[i]
    role = message.get("role")
    content = _v4_flatten(message.get("content"))
    tools = message.get("tools")
    tools_part = ("\n\n" + _tools_section(tools, "v4")) if tools else ""
    if role == "system":
        out = _text(content or "") + tools_part
    elif role == "developer":
        if not content:
            raise PromptRenderError("a developer message needs content")
        if not isinstance(content, str):
            raise PromptRenderError("a developer message's content must be text")
        out = USER + content + tools_part
    elif role == "user":
        blocks = message.get("blocks")
        out = USER + (_v4_user_blocks(blocks) if blocks else _text(content or ""))
    elif role == "latest_reminder":
        out = LATEST_REMINDER + _text(content)
    elif role == "assistant":
        calls = message.get("tool_calls")
        calls_block = _tool_calls_block(calls, "tool_calls") if calls else ""
        reasoning_part = ""
        after_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not after_task and (not drop_thinking or i > last_user):
            reasoning_part = _text(message.get("reasoning") or "") + THINK_CLOSE
        out = f"{reasoning_part}{_text(content or '')}{calls_block}{EOS}"
    else:
        raise PromptRenderError(f"role {role!r} is not supported by the DeepSeek V4 format")

    following = messages[i + 1].get("role") if i + 1 < len(messages) else None
    if following is not None and following not in ("assistant", "latest_reminder"):
        return out
    task = message.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise PromptRenderError(f"task {task!r} is not one of {sorted(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_OPEN if thinking else THINK_CLOSE)
        return out + TASK_TOKENS[task]
    # A user turn, or a system message that ends the conversation or opens an assistant
    # turn, hands over to the assistant.
    if role in ("user", "developer") or (role == "system" and following in (None, "assistant")):
        opens = thinking and (not drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_OPEN if opens else THINK_CLOSE)
    return out


# -- request shaping and the counter ------------------------------------------------------------


def shape_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Request tools as vLLM's ``model_dump()`` of them: declared fields only; ``strict``
    and ``defer_loading`` only when set (the tool's own ``defer_loading`` copied down)."""
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
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise PromptRenderError(f"tools[{i}]: 'description' must be a string")
        if function.get("parameters") is not None and not isinstance(
            function["parameters"], Mapping
        ):
            raise PromptRenderError(f"tools[{i}]: 'parameters' must be an object")
        fn = {k: copy.deepcopy(function.get(k)) for k in _TOOL_FUNCTION_FIELDS}
        if function.get("strict") is not None:
            fn["strict"] = function["strict"]
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


def _effective_kwargs(
    chat_template_kwargs: Mapping[str, Any] | None, reasoning_effort: str | None
) -> dict[str, Any]:
    """The request's kwargs as vLLM merges them (None and "auto" values mean unset) over
    the server's --default-chat-template-kwargs."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise PromptRenderError("chat_template_kwargs must be an object")
    request = {k: v for k, v in (chat_template_kwargs or {}).items() if v not in (None, "auto")}
    if reasoning_effort is not None:
        # The request field wins over the same key, and switches thinking unless the
        # request's kwargs name enable_thinking themselves (even as null).
        if "enable_thinking" not in (chat_template_kwargs or {}):
            request["enable_thinking"] = reasoning_effort != "none"
        request["reasoning_effort"] = reasoning_effort
    kwargs = dict(getattr(chat_template_kwargs, "server_defaults", {})) | request
    clash = next((k for k in _RESERVED_KWARGS if k in kwargs), None)
    if clash is not None:
        raise PromptRenderError(f"chat_template_kwargs may not set {clash!r}")
    return kwargs


def _v4_effort(kwargs: Mapping[str, Any], thinking: bool) -> tuple[bool, str | None]:
    """(thinking, effort) after V4's effort words: none turns thinking off, max stays,
    minimal/low/medium are low, anything else high; unset is high while thinking."""
    effort = kwargs.get("reasoning_effort")
    if not isinstance(effort, str):
        return thinking, "high" if thinking else None
    if effort == "none":
        return False, None
    if effort == "max":
        return thinking, "max"
    if effort in ("low", "minimal", "medium"):
        return thinking, "low"
    return thinking, "high"


def render_deepseek_prompt(
    version: EncoderVersion,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    reasoning_effort: str | None = None,
) -> str:
    """The prompt string vLLM's DeepSeek ``version`` encoder builds for a chat request
    (``reasoning_effort``: the request's own field of that name)."""
    kwargs = _effective_kwargs(chat_template_kwargs, reasoning_effort)
    shaped_tools = kwargs.get("tools", shape_tools(tools))
    conversation = parse_messages(messages, "string" if version == "v32" else "openai")
    if version == "v32":
        thinking = bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))
        if shaped_tools:
            conversation.insert(0, {"role": "system", "tools": shaped_tools})
        if not conversation:
            raise PromptRenderError("messages must contain at least one message")
        # Reasoning of earlier turns goes once the user speaks again.
        drop = conversation[-1].get("role") == "user"
        return encode_v32(conversation, thinking=thinking, drop_thinking=drop)

    if "thinking" in kwargs or "enable_thinking" in kwargs:
        thinking = bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
    else:
        thinking = True
    if shaped_tools:
        system = next((i for i, m in enumerate(conversation) if m.get("role") == "system"), None)
        if system is None:
            conversation.insert(0, {"role": "system", "tools": shaped_tools})
        else:
            conversation[system] = {**conversation[system], "tools": shaped_tools}
    thinking, effort = _v4_effort(kwargs, thinking)
    return encode_v4(
        conversation,
        thinking=thinking,
        drop_thinking=bool(kwargs.get("drop_thinking", True)),
        effort=effort,
    )


class DeepseekPromptCounter(PromptCounter):
    """A DeepSeek V3.2 or V4 model: chats through the encoder, text as ``PromptCounter``."""

    version: ClassVar[EncoderVersion]

    @property
    def has_chat_template(self) -> bool:
        return True  # the encoder stands in for one

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt string vLLM would build (the two flags are not the encoder's, only
        the request model's check that they are not both set)."""
        if continue_final_message and add_generation_prompt:
            raise PromptRenderError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        try:
            return render_deepseek_prompt(
                self.version,
                messages,
                tools,
                chat_template_kwargs,
                # The request's own field, which the counting API carries on the kwargs.
                reasoning_effort=getattr(chat_template_kwargs, "reasoning_effort", None),
            )
        except PromptRenderError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # malformed parts
            raise PromptRenderError(f"the request does not fit the DeepSeek format: {exc}") from exc

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
        prompt = self.render_chat(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.plan_text(prompt, add_special_tokens=add_special_tokens)


class DeepseekV32PromptCounter(DeepseekPromptCounter):
    version = "v32"


class DeepseekV4PromptCounter(DeepseekPromptCounter):
    version = "v4"
