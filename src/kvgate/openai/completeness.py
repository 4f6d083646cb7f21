"""Whether an answer is complete by the OpenAI/vLLM API's own grammar, before it is kept.

A cache or an Idempotency-Key replays what it stores to every later request, so only an
answer the client could take as finished may be stored. A 200 is not enough: vLLM sends
its headers before generating, so a generation that fails later still ends a 200 stream
(with an in-band `data: {"error": {...}}` event, or a choice finishing with
`finish_reason` `abort`/`error`), and whatever stands in front of it (a proxy, a load
balancer) can answer 200 with an HTML page or nothing at all.

Complete means, for a streamed request: `text/event-stream`; every dispatched event's
data a JSON `chat.completion.chunk` or `text_completion` object (one kind throughout)
with a `choices` list; no error event; every choice index seen (indices 0..n-1, none
missing) ends with one event carrying its `finish_reason`, which is neither `abort` nor
`error`, and sends nothing after it; then `data: [DONE]`, and nothing but comments after
it. The usage event (`"choices": []`) may come anywhere before `[DONE]`. For a plain
request: `application/json`, a `chat.completion` or `text_completion` object, no `error`,
a non-empty `choices` list with indices 0..n-1 each finished (not `abort`/`error`).

SSE framing as the spec reads it: lines end with LF, CRLF or CR; an event ends at a blank
line (an unterminated last event is never dispatched, so a stream whose `[DONE]` lacks
its blank line has not ended); `:` lines are comments; several `data:` lines join with
LF; fields other than `data` (`event`, `id`, `retry`) do not matter here.

Cost: one pass over a body that the store bounds anyway (`max_answer_bytes`), each event
decoded once by the C JSON decoder; it runs once per answer, when the answer ends.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

__all__ = [
    "AnswerDefect",
    "SseEvent",
    "answer_defect",
    "answer_is_complete",
    "head_defect",
    "sse_events",
]


class AnswerDefect(enum.StrEnum):
    """Why an answer is not complete (a metric label: a small, fixed set)."""

    STATUS = "status"  # not a 200
    CONTENT_TYPE = "content_type"  # neither JSON nor an event stream (e.g. text/html)
    STREAM_MISMATCH = "stream_mismatch"  # a stream to a plain request, or JSON to a stream
    EMPTY = "empty"  # no body, or a stream without a single event
    MALFORMED = "malformed"  # not the API's objects, or broken SSE framing
    ERROR = "error"  # an error object: in-band in a stream, or the JSON body
    # The stream ended without its terminal event: `data: [DONE]` (chat/completions),
    # `message_stop` (Anthropic Messages), `response.completed`/`incomplete` (Responses).
    NO_DONE = "no_done"
    NO_CHOICES = "no_choices"  # not a single choice
    # A choice never got its finish_reason (a message its stop_reason, a response its end).
    UNFINISHED_CHOICE = "unfinished_choice"
    # A choice finished with `abort` or `error`; a message without a finished stop_reason;
    # a response cancelled, or incomplete for another reason than its max_output_tokens.
    FAILED_CHOICE = "failed_choice"


#: Finish reasons that mean the engine gave up on the choice, not that it ended.
FAILED_FINISH_REASONS: Final = frozenset({"abort", "error"})

_STREAM_OBJECTS: Final = frozenset({"chat.completion.chunk", "text_completion"})
_PLAIN_OBJECTS: Final = frozenset({"chat.completion", "text_completion"})
_EVENT_STREAM: Final = "text/event-stream"
_JSON: Final = "application/json"
_DONE: Final = "[DONE]"


def answer_is_complete(*, stream: bool, status: int, content_type: str, body: bytes) -> bool:
    """True only for an answer complete by the API's grammar (see the module docstring)."""
    return answer_defect(stream=stream, status=status, content_type=content_type, body=body) is None


def answer_defect(
    *, stream: bool, status: int, content_type: str, body: bytes
) -> AnswerDefect | None:
    """Why the answer is not complete, or None when it is."""
    head = head_defect(stream=stream, status=status, content_type=content_type, body=body)
    if head is not None:
        return head
    return _stream_defect(body) if stream else _plain_defect(body)


def head_defect(
    *, stream: bool, status: int, content_type: str, body: bytes
) -> AnswerDefect | None:
    """What every API's rule checks first: a 200, JSON for a plain request and an event
    stream for a streamed one, a body that is not empty."""
    if status != 200:
        return AnswerDefect.STATUS
    media_type = content_type.partition(";")[0].strip().lower()
    expected, other = (_EVENT_STREAM, _JSON) if stream else (_JSON, _EVENT_STREAM)
    if media_type == other:
        return AnswerDefect.STREAM_MISMATCH
    if media_type != expected:
        return AnswerDefect.CONTENT_TYPE
    if not body.strip():
        return AnswerDefect.EMPTY
    return None


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: its `event` field (None when it has none) and its data."""

    name: str | None
    data: str


def sse_events(body: bytes) -> tuple[list[SseEvent], bool] | AnswerDefect:
    """The stream's dispatched events, framed as the module docstring says, and whether an
    event with data trails unterminated (never dispatched: the stream was cut); MALFORMED
    for a body that is not UTF-8. For the APIs whose events are named (Anthropic
    Messages, Responses)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return AnswerDefect.MALFORMED
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    *blocks, tail = text.split("\n\n")
    events: list[SseEvent] = []
    for block in blocks:
        data = _data_of(block)
        if data is not None:
            events.append(SseEvent(_name_of(block), data))
    return events, _data_of(tail) is not None


def _name_of(event: str) -> str | None:
    """The event's `event` field (the last one wins), or None."""
    name: str | None = None
    for line in event.split("\n"):
        if line.startswith("event:"):
            name = line[7:] if line.startswith(" ", 6) else line[6:]
    return name


def _plain_defect(body: bytes) -> AnswerDefect | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return AnswerDefect.MALFORMED
    if type(obj) is not dict:
        return AnswerDefect.MALFORMED
    if _is_error(obj):
        return AnswerDefect.ERROR
    kind = obj.get("object")
    choices = obj.get("choices")
    if kind not in _PLAIN_OBJECTS or type(choices) is not list:
        return AnswerDefect.MALFORMED
    if not choices:
        return AnswerDefect.NO_CHOICES
    part = "message" if kind == "chat.completion" else "text"
    finished: dict[int, str] = {}
    for choice in choices:
        if type(choice) is not dict or not _has_part(choice, part):
            return AnswerDefect.MALFORMED
        index = choice.get("index")
        reason = choice.get("finish_reason")
        if not _is_index(index) or index in finished:
            return AnswerDefect.MALFORMED
        if reason is None:
            return AnswerDefect.UNFINISHED_CHOICE
        if type(reason) is not str:
            return AnswerDefect.MALFORMED
        finished[index] = reason
    return _choices_defect(finished, unfinished=False)


def _stream_defect(body: bytes) -> AnswerDefect | None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return AnswerDefect.MALFORMED
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    *events, tail = text.split("\n\n")
    kind: str | None = None
    finished: dict[int, str] = {}
    open_choices: set[int] = set()
    done = False
    dispatched = 0
    for event in events:
        payload = _data_of(event)
        if payload is None:
            continue  # comments only (": ping"), or fields without data: nothing dispatched
        dispatched += 1
        if done:
            return AnswerDefect.MALFORMED  # nothing may follow [DONE]
        if payload.strip() == _DONE:
            done = True
            continue
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return AnswerDefect.MALFORMED
        if type(obj) is not dict:
            return AnswerDefect.MALFORMED
        if _is_error(obj):
            return AnswerDefect.ERROR
        event_kind = obj.get("object")
        choices = obj.get("choices")
        if event_kind not in _STREAM_OBJECTS or type(choices) is not list:
            return AnswerDefect.MALFORMED
        if kind is None:
            kind = event_kind
        elif event_kind != kind:
            return AnswerDefect.MALFORMED
        part = "delta" if kind == "chat.completion.chunk" else "text"
        for choice in choices:
            if type(choice) is not dict or not _has_part(choice, part):
                return AnswerDefect.MALFORMED
            index = choice.get("index")
            if not _is_index(index) or index in finished:
                return AnswerDefect.MALFORMED  # no event for a choice after its finish
            reason = choice.get("finish_reason")
            if reason is None:
                open_choices.add(index)
            elif type(reason) is str:
                open_choices.discard(index)
                finished[index] = reason
            else:
                return AnswerDefect.MALFORMED
    if _data_of(tail) is not None:
        # An event the stream never terminated with its blank line: never dispatched.
        return AnswerDefect.MALFORMED if done else AnswerDefect.NO_DONE
    if not done:
        return AnswerDefect.NO_DONE if dispatched else AnswerDefect.EMPTY
    return _choices_defect(finished, unfinished=bool(open_choices))


def _choices_defect(finished: dict[int, str], *, unfinished: bool) -> AnswerDefect | None:
    """The choices as a whole: some, all finished, none failed, indices 0..n-1."""
    if unfinished:
        return AnswerDefect.UNFINISHED_CHOICE
    if not finished:
        return AnswerDefect.NO_CHOICES
    if any(reason in FAILED_FINISH_REASONS for reason in finished.values()):
        return AnswerDefect.FAILED_CHOICE
    if max(finished) != len(finished) - 1:
        # A missing index is a choice that never came (no event, so no finish either).
        return AnswerDefect.UNFINISHED_CHOICE
    return None


def _data_of(event: str) -> str | None:
    """The event's data (its `data` lines joined with LF), or None if it is not
    dispatched (no data line, or an empty data buffer, as the SSE spec says)."""
    values: list[str] | None = None
    for line in event.split("\n"):
        if not line.startswith("data"):
            continue  # a comment, another field, a blank line between events
        if len(line) == 4:
            value = ""
        elif line[4] == ":":
            value = line[6:] if line.startswith(" ", 5) else line[5:]
        else:
            continue  # another field whose name starts with "data"
        if values is None:
            values = [value]
        else:
            values.append(value)
    if values is None:
        return None
    data = "\n".join(values)
    return data or None


def _is_error(obj: dict[str, Any]) -> bool:
    # vLLM: {"error": {...}}; older servers: {"object": "error", "message": ...}.
    return obj.get("error") is not None or obj.get("object") == "error"


def _is_index(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def _has_part(choice: dict[str, Any], part: str) -> bool:
    """A chat choice carries its `delta`/`message` object, a completion its `text`."""
    value = choice.get(part)
    return type(value) is str if part == "text" else type(value) is dict
