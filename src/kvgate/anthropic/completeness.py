"""Whether an Anthropic Messages answer is complete by the API's own grammar, before the
answer layer keeps it (an Idempotency-Key's replay, a cache entry): the Messages
counterpart of ``kvgate.openai.completeness``, whose framing, head checks and defect labels
it shares.

A plain request: a 200 ``application/json`` ``message`` object (``type: "message"``,
``role: "assistant"``, a ``content`` list of typed blocks, possibly empty) with no error and
a ``stop_reason`` that ends a finished answer.

A stream: a 200 ``text/event-stream`` of named events (``event: <type>``, one JSON data
object whose ``type`` is the same): ``message_start`` (its ``message``) first; then content
blocks, each ``content_block_start`` at a new index, its ``content_block_delta`` events
while it is open, its ``content_block_stop``; then, with every block closed, one
``message_delta`` carrying the finished ``stop_reason``; then ``message_stop``, and nothing
after it. ``ping`` may come anywhere before ``message_stop``. An ``error`` event anywhere
(vLLM's failure after the 200: the open block is closed, then ``error``) is an error; an
event of another type is not this grammar.

The stop reasons of a finished answer are those vLLM 0.34 writes: ``end_turn``,
``stop_sequence``, ``tool_use`` and ``max_tokens``. ``max_tokens`` is the counterpart of
OpenAI's ``length``: the same request, with the same ``max_tokens``, is cut at the same
point, and an answer cut by a lower cap than asked (a budget clamp) never reaches a cache
(``AnswerRun.keep_what_serves``). vLLM writes no stop reason for a generation the engine
aborted (``null`` in ``message_delta``, none at all in a ``message``): a failed answer.
Anthropic's other reasons are not kept either: ``pause_turn`` asks the client to continue
the turn, ``refusal`` is a classifier's stop (neither comes from vLLM), and an unknown one
is not read as finished.
"""

from __future__ import annotations

import json
from typing import Any, Final, TypeGuard

from kvgate.openai.completeness import AnswerDefect, SseEvent, head_defect, sse_events

__all__ = ["FINISHED_STOP_REASONS", "answer_defect"]

#: The stop reasons of an answer that ended as the request asked.
FINISHED_STOP_REASONS: Final = frozenset({"end_turn", "stop_sequence", "tool_use", "max_tokens"})


def answer_defect(
    *, stream: bool, status: int, content_type: str, body: bytes
) -> AnswerDefect | None:
    """Why the Messages answer is not complete, or None when it is."""
    head = head_defect(stream=stream, status=status, content_type=content_type, body=body)
    if head is not None:
        return head
    return _stream_defect(body) if stream else _message_defect(body)


def _message_defect(body: bytes) -> AnswerDefect | None:
    obj = _json_object(body)
    if obj is None:
        return AnswerDefect.MALFORMED
    if _is_error(obj):
        return AnswerDefect.ERROR
    if not _is_message(obj):
        return AnswerDefect.MALFORMED
    return _stop_defect(obj.get("stop_reason"))


def _stream_defect(body: bytes) -> AnswerDefect | None:
    framed = sse_events(body)
    if isinstance(framed, AnswerDefect):
        return framed
    events, cut = framed
    started = stopped = False
    stop: AnswerDefect | None = AnswerDefect.UNFINISHED_CHOICE  # until a message_delta
    delta_seen = False
    open_blocks: set[int] = set()
    seen_blocks: set[int] = set()
    for event in events:
        obj = _event_object(event)
        if obj is None:
            return AnswerDefect.MALFORMED
        kind = obj["type"]
        if kind == "error" or event.name == "error":
            return AnswerDefect.ERROR
        if stopped:
            return AnswerDefect.MALFORMED  # nothing may follow message_stop
        if kind == "ping":
            continue
        if not started:
            if kind != "message_start" or not _is_message(obj.get("message")):
                return AnswerDefect.MALFORMED
            started = True
            continue
        if kind == "message_stop":
            stopped = True
            continue
        if delta_seen or kind == "message_start":
            return AnswerDefect.MALFORMED  # only message_stop follows the message_delta
        index = obj.get("index")
        if kind == "content_block_start":
            if not _is_index(index) or index in seen_blocks:
                return AnswerDefect.MALFORMED
            if type(obj.get("content_block")) is not dict:
                return AnswerDefect.MALFORMED
            seen_blocks.add(index)
            open_blocks.add(index)
        elif kind == "content_block_delta":
            if not _is_index(index) or index not in open_blocks:
                return AnswerDefect.MALFORMED
            if type(obj.get("delta")) is not dict:
                return AnswerDefect.MALFORMED
        elif kind == "content_block_stop":
            if not _is_index(index) or index not in open_blocks:
                return AnswerDefect.MALFORMED
            open_blocks.discard(index)
        elif kind == "message_delta":
            delta = obj.get("delta")
            if open_blocks or type(delta) is not dict:
                return AnswerDefect.MALFORMED
            delta_seen = True
            stop = _stop_defect(delta.get("stop_reason"))
        else:
            return AnswerDefect.MALFORMED
    if cut:
        # An event the stream never terminated with its blank line: never dispatched.
        return AnswerDefect.MALFORMED if stopped else AnswerDefect.NO_DONE
    if not stopped:
        return AnswerDefect.NO_DONE if events else AnswerDefect.EMPTY
    return stop


def _stop_defect(reason: object) -> AnswerDefect | None:
    if reason is None:
        return AnswerDefect.FAILED_CHOICE  # vLLM's aborted generation
    if type(reason) is not str:
        return AnswerDefect.MALFORMED
    return None if reason in FINISHED_STOP_REASONS else AnswerDefect.FAILED_CHOICE


def _json_object(text: str | bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if type(obj) is dict else None


def _event_object(event: SseEvent) -> dict[str, Any] | None:
    """The event's data object, whose ``type`` names it (and agrees with its ``event``)."""
    obj = _json_object(event.data)
    if obj is None or type(obj.get("type")) is not str:
        return None
    if event.name is not None and event.name != obj["type"]:
        return None
    return obj


def _is_message(obj: object) -> bool:
    if type(obj) is not dict:
        return False
    content = obj.get("content")
    return (
        obj.get("type") == "message"
        and obj.get("role") == "assistant"
        and type(content) is list
        and all(type(block) is dict and type(block.get("type")) is str for block in content)
    )


def _is_error(obj: dict[str, Any]) -> bool:
    # Anthropic's {"type": "error", "error": {...}}; an OpenAI-shaped {"error": {...}}.
    return obj.get("type") == "error" or obj.get("error") is not None


def _is_index(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0
