"""The harmony conversation vLLM 0.34 renders for a Responses body on a gpt-oss model.

On a gpt-oss model vLLM does not render the converted chat request: its harmony path
(``vllm/renderers/online_renderer.py``: ``_render_responses_with_harmony``; the helpers of
``vllm/entrypoints/openai/parser/harmony_utils.py`` and
``vllm/entrypoints/openai/responses/harmony.py``) builds harmony messages from the body
itself:

* a system message with ``reasoning.effort`` as the server's ``--reasoning-effort-map``
  rewrites it (low, medium or high; any other effort is refused when counted) and today's
  date; a developer message with the instructions and the function
  tools, when there is either. The instructions are ``instructions``, or when it is absent
  a leading ``system``/``developer`` input message's text. ``tool_choice`` and
  ``text.format`` shape the sampling, not the prompt;
* every input item in order, none merged: a user message with each content part's text;
  an assistant message on the final channel with *all* its parts (an empty one too);
  a later system/developer message as instructions (dropped when it has no text); a
  ``function_call`` on the commentary channel to ``functions.NAME`` (json); a
  ``function_call_output`` from ``functions.NAME``, the name of the latest call before it
  with its ``call_id``; a ``reasoning`` item on the analysis channel, its content texts
  joined by newlines (without content: an empty assistant message, its summary unread);
* rendered for a new assistant turn: an in-progress last item is not continued.

What vLLM's harmony path refuses, or cannot render as the chat path would, is refused
with a message naming the field (never counted low): reasoning efforts other than
low/medium/high, ``custom`` tools, ``custom_tool_call`` items and their outputs, a
``function_call_output`` whose call is not in the input or whose output is a list of parts,
images, and ``include`` asking for output logprobs. The conversation travels with the
converted chat messages (:class:`~kvgate.tokenize.harmony.HarmonyChatMessages`): only a
harmony counter reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from kvgate.tokenize.harmony import (
    HarmonyChatMessages,
    HarmonyPrompt,
    HarmonyTurn,
)

from .requests import ResponsesRequest

__all__ = ["harmony_prompt", "with_harmony_prompt"]

_LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
_INSTRUCTION_ROLES: Final = ("system", "developer")


class _Refused(Exception):
    """The body cannot be rendered by vLLM's harmony path: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def with_harmony_prompt(request: ResponsesRequest) -> ResponsesRequest:
    """``request`` whose chat messages also carry the harmony conversation vLLM renders
    for it on a gpt-oss model."""
    messages = HarmonyChatMessages(request.messages or [], harmony_prompt(request.wire_body))
    return dataclasses.replace(request, messages=messages)


def harmony_prompt(body: dict[str, Any]) -> HarmonyPrompt:
    """The harmony conversation of a Responses ``body`` that ``parse_responses_request``
    accepted (so its fields have their JSON types)."""
    try:
        return _build(body)
    except _Refused as refused:
        return HarmonyPrompt(
            None, None, None, (), refusal=str(refused), refusal_param=refused.param
        )


def _build(body: dict[str, Any]) -> HarmonyPrompt:
    include = body.get("include") or []
    if _LOGPROBS_INCLUDE in include:
        raise _Refused("include", f"'{_LOGPROBS_INCLUDE}' is not supported on gpt-oss models.")
    effort = _effort(body)
    tools = _function_tools(body.get("tools"))
    instructions: str | None = body.get("instructions")
    items: str | list[Any] = body["input"]
    first = 0
    if instructions is None and isinstance(items, list) and items:
        head = items[0]
        if head.get("role") in _INSTRUCTION_ROLES:
            # vLLM peels a leading system/developer message into the instructions.
            instructions = _joined_text(head.get("content"))
            first = 1
    turns = [HarmonyTurn("user", (items,))] if isinstance(items, str) else _turns(items, first)
    return HarmonyPrompt(instructions, tools, effort, tuple(turns))


def _effort(body: dict[str, Any]) -> str | None:
    # Checked when counted: the server's --reasoning-effort-map may rewrite it first.
    reasoning = body.get("reasoning") or {}
    effort: str | None = reasoning.get("effort")
    return effort


def _function_tools(
    tools: list[dict[str, Any]] | None,
) -> tuple[tuple[str, str, dict[str, Any] | None], ...] | None:
    if not tools:
        return None  # vLLM passes no tools then, and writes no tool section.
    described = []
    for i, tool in enumerate(tools):
        if tool["type"] != "function":
            raise _Refused(
                f"tools[{i}].type", f"{tool['type']!r} tools are not supported on gpt-oss."
            )
        described.append((tool["name"], tool.get("description") or "", tool.get("parameters")))
    return tuple(described)


def _joined_text(content: Any) -> str | None:
    """vLLM's ``flatten_input_text_content``: the text parts joined, None without any."""
    if content is None or isinstance(content, str):
        return content
    texts = [part["text"] for part in content if part.get("text") is not None]
    return "".join(texts) if texts else None


def _part_texts(content: str | list[dict[str, Any]], param: str) -> tuple[str, ...]:
    if isinstance(content, str):
        return (content,)
    texts = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            # vLLM's harmony path reads only text: the image would vanish from the prompt.
            raise _Refused(f"{param}[{j}]", "images are not supported on gpt-oss models.")
        # A refusal part has no text: vLLM renders it empty.
        texts.append(part.get("text") or "")
    return tuple(texts)


def _turns(items: list[dict[str, Any]], first: int) -> list[HarmonyTurn]:
    turns: list[HarmonyTurn] = []
    names_by_call_id: dict[str, str] = {}
    for i in range(first, len(items)):
        item, param = items[i], f"input[{i}]"
        kind = item.get("type") or "message"
        if kind == "message":
            role = item["role"]
            content = item["content"]
            if role in _INSTRUCTION_ROLES:
                text = _joined_text(content)
                if text:
                    turns.append(HarmonyTurn(role, (text,), instructions=True))
                continue
            texts = _part_texts(content, f"{param}.content")
            channel = "final" if role == "assistant" else None
            turns.append(HarmonyTurn(role, texts, channel=channel))
        elif kind == "function_call":
            names_by_call_id[item["call_id"]] = item["name"]
            turns.append(
                HarmonyTurn(
                    "assistant",
                    (item["arguments"],),
                    channel="commentary",
                    recipient=f"functions.{item['name']}",
                    content_type="json",
                )
            )
        elif kind == "function_call_output":
            call_id = item["call_id"]
            if call_id not in names_by_call_id:
                raise _Refused(
                    f"{param}.call_id",
                    f"no function_call with call_id {call_id!r} comes before this output "
                    "(gpt-oss models name a tool result by its call).",
                )
            output = item["output"]
            if not isinstance(output, str):
                raise _Refused(f"{param}.output", "gpt-oss models take a tool output as a string.")
            turns.append(
                HarmonyTurn(
                    "tool",
                    (output,),
                    channel="commentary",
                    recipient="assistant",
                    author_name=f"functions.{names_by_call_id[call_id]}",
                )
            )
        elif kind == "reasoning":
            content = item.get("content") or []
            if content:
                text = "\n".join(part["text"] for part in content)
                turns.append(HarmonyTurn("assistant", (text,), channel="analysis"))
            else:
                # vLLM keeps an empty assistant message in its place (the summary unread).
                turns.append(HarmonyTurn("assistant", ("",)))
        else:
            raise _Refused(f"{param}.type", f"{kind!r} items are not supported on gpt-oss models.")
    return turns
