"""Whether an OpenAI Responses answer is complete by the API's own grammar, before the
answer layer keeps it (an Idempotency-Key's replay, a cache entry): the Responses
counterpart of ``kvgate.openai.completeness``, whose framing, head checks and defect labels
it shares.

A plain request: a 200 ``application/json`` ``response`` object (``object: "response"``,
an ``output`` list) with no ``error`` whose ``status`` ends a finished answer.

A stream: a 200 ``text/event-stream`` of named events (``event: <type>``, one JSON data
object whose ``type`` is the same, ``sequence_number`` increasing when present):
``response.created`` first, then only ``response.*`` events, the last of them the terminal
``response.completed`` or ``response.incomplete`` whose ``response`` is a finished one with
that status, and nothing after it. ``response.failed`` and an ``error`` event are errors;
an event of another type is not this grammar. (No ``[DONE]``: neither OpenAI nor vLLM
sends one.)

Finished means ``status: "completed"``, or ``"incomplete"`` with ``incomplete_details.reason``
``"max_output_tokens"``: the counterpart of OpenAI's ``length``. That answer is complete for
the same request: the cap is the request's (its ``max_output_tokens``, part of the body the
cache key and the Idempotency-Key fingerprint digest, or, for a body without one, the cap
kvgate reserves and writes in, the same for the same request under the same model
settings), greedy decoding cuts it at the same token, and an answer cut by a lower cap than
asked (a budget clamp) never reaches a cache (``AnswerRun.keep_what_serves``). Any other
``incomplete`` reason (``content_filter``) is not the request's own limit and is not kept;
``cancelled`` (vLLM's aborted harmony generation), ``failed``, ``queued`` and
``in_progress`` are not finished.

What the grammar cannot show: on the chat-template path vLLM 0.34 reports a generation the
engine aborted as ``completed`` ("completed" is its catch-all status), with the output
generated so far; no field tells it apart (docs/apis.md names this deviation).
"""

from __future__ import annotations

import json
from typing import Any, Final

from kvgate.openai.completeness import AnswerDefect, head_defect, sse_events

__all__ = ["TERMINAL_STATUSES", "answer_defect"]

#: The terminal events of a finished stream, and the status their response carries.
TERMINAL_STATUSES: Final = {"response.completed": "completed", "response.incomplete": "incomplete"}
#: The one ``incomplete`` reason that is the request's own limit.
OWN_LIMIT: Final = "max_output_tokens"
_FAILED_EVENTS: Final = frozenset({"error", "response.failed"})
_UNFINISHED: Final = frozenset({"queued", "in_progress"})


def answer_defect(
    *, stream: bool, status: int, content_type: str, body: bytes
) -> AnswerDefect | None:
    """Why the Responses answer is not complete, or None when it is."""
    head = head_defect(stream=stream, status=status, content_type=content_type, body=body)
    if head is not None:
        return head
    if stream:
        return _stream_defect(body)
    obj = _json_object(body)
    if obj is None:
        return AnswerDefect.MALFORMED
    return _response_defect(obj)


def _response_defect(obj: dict[str, Any]) -> AnswerDefect | None:
    """A response object: finished, failed, or not one at all."""
    if obj.get("error") is not None:
        return AnswerDefect.ERROR
    if obj.get("object") != "response" or type(obj.get("output")) is not list:
        return AnswerDefect.MALFORMED
    status = obj.get("status")
    if status == "completed":
        return None
    if status == "incomplete":
        details = obj.get("incomplete_details")
        reason = details.get("reason") if type(details) is dict else None
        return None if reason == OWN_LIMIT else AnswerDefect.FAILED_CHOICE
    if status == "failed":
        return AnswerDefect.ERROR
    if status == "cancelled":
        return AnswerDefect.FAILED_CHOICE
    if status in _UNFINISHED:
        return AnswerDefect.UNFINISHED_CHOICE
    return AnswerDefect.MALFORMED


def _stream_defect(body: bytes) -> AnswerDefect | None:
    framed = sse_events(body)
    if isinstance(framed, AnswerDefect):
        return framed
    events, cut = framed
    ended = False  # the terminal event came
    outcome: AnswerDefect | None = None  # what its response says
    sequence = -1
    for number, event in enumerate(events):
        obj = _json_object(event.data)
        kind = obj.get("type") if obj is not None else None
        if obj is None or type(kind) is not str:
            return AnswerDefect.MALFORMED
        if kind in _FAILED_EVENTS or event.name in _FAILED_EVENTS:
            return AnswerDefect.ERROR
        if event.name is not None and event.name != kind:
            return AnswerDefect.MALFORMED
        if ended:
            return AnswerDefect.MALFORMED  # nothing may follow the terminal event
        if (number == 0) != (kind == "response.created") or not kind.startswith("response."):
            return AnswerDefect.MALFORMED
        if "sequence_number" in obj:
            value = obj["sequence_number"]
            if type(value) is not int or value <= sequence:
                return AnswerDefect.MALFORMED
            sequence = value
        expected = TERMINAL_STATUSES.get(kind)
        if expected is not None:
            response = obj.get("response")
            if type(response) is not dict or response.get("status") != expected:
                return AnswerDefect.MALFORMED
            ended, outcome = True, _response_defect(response)
    if cut:
        # An event the stream never terminated with its blank line: never dispatched.
        return AnswerDefect.MALFORMED if ended else AnswerDefect.NO_DONE
    if not ended:
        return AnswerDefect.NO_DONE if events else AnswerDefect.EMPTY
    return outcome


def _json_object(text: str | bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if type(obj) is dict else None
