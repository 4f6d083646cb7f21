"""Reading OpenAI Responses answers for the bill, in bounded memory.

A non-streamed answer is one ``response`` object whose top-level ``usage`` holds
``input_tokens`` (the whole prompt, cached part included: ``input_tokens_details.
cached_tokens``) and ``output_tokens`` (reasoning included:
``output_tokens_details.reasoning_tokens``). vLLM writes ``usage`` after ``output`` but
before ``input_messages``/``output_messages`` (``enable_response_messages``), so it is read
by walking the top level (:class:`ResponseBodyScanner`), whatever the body's size.

A stream is a sequence of named SSE events (``event: <type>`` and one ``data:`` line of
JSON whose ``type`` repeats it; :class:`ResponsesStreamReader`): ``response.created`` and
``response.in_progress`` (the response without usage), the output's ``*.added``/``*.done``
events, the generated text in ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta`` and
``response.custom_tool_call_input.delta`` (``delta``), and a last ``response.completed``,
``response.incomplete`` or ``response.failed`` whose ``response.usage`` is the answer's;
``error`` reports a failure. Every event is read as it passes: only its ``type``,
``delta`` and ``response.usage`` are kept (the last event repeats the whole output: it is
skipped, not held). The deltas' text is kept up to ``max_text_chars`` for counting the
output of a stream that ends without its usage; each delta event is at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kvgate.json_capture import JsonPathCapture, Path

__all__ = [
    "DEFAULT_MAX_TEXT_CHARS",
    "TERMINAL_EVENTS",
    "TEXT_DELTA_EVENTS",
    "ResponseBodyScanner",
    "ResponsesStreamReader",
    "ResponsesUsage",
    "responses_usage",
]

#: Generated text retained for counting a stream without usage (characters).
DEFAULT_MAX_TEXT_CHARS: Final = 1024 * 1024

#: The events whose ``delta`` is generated output.
TEXT_DELTA_EVENTS: Final = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    }
)
#: The events that end a response and carry its usage.
TERMINAL_EVENTS: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})

_USAGE: Final[Path] = ("usage",)
_STATUS: Final[Path] = ("status",)
_TYPE: Final[Path] = ("type",)
_DELTA: Final[Path] = ("delta",)
_RESPONSE_USAGE: Final[Path] = ("response", "usage")
_ERROR_FIELDS: Final[tuple[Path, ...]] = (("code",), ("message",), ("error",))
_EVENT_PATHS: Final = (_TYPE, _DELTA, _RESPONSE_USAGE, *_ERROR_FIELDS)
# An event or field line longer than this before its colon is no field kvgate reads.
_MAX_FIELD: Final = 16
_MAX_NAME: Final = 128


@dataclass(frozen=True, slots=True)
class ResponsesUsage:
    """A Responses answer's usage: ``input_tokens`` is the whole prompt (its cached part
    included), ``output_tokens`` every generated token (reasoning included)."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


def _count(value: object) -> int | None:
    # bool is an int subclass: true/false are no token counts.
    return value if type(value) is int and value >= 0 else None


def responses_usage(usage: object) -> ResponsesUsage | None:
    """The usage from a decoded ``usage`` object, or None if it is not one
    (``input_tokens`` and ``output_tokens`` are required)."""
    if type(usage) is not dict:
        return None
    prompt = _count(usage.get("input_tokens"))
    output = _count(usage.get("output_tokens"))
    if prompt is None or output is None:
        return None
    cached = reasoning = 0
    details = usage.get("input_tokens_details")
    if type(details) is dict:
        cached = _count(details.get("cached_tokens")) or 0
    details = usage.get("output_tokens_details")
    if type(details) is dict:
        reasoning = _count(details.get("reasoning_tokens")) or 0
    return ResponsesUsage(prompt, output, min(cached, prompt), reasoning)


class ResponseBodyScanner:
    """The top-level ``usage`` (and ``status``) of a non-streamed ``response`` body fed in
    chunks, whatever its size."""

    __slots__ = ("_scan", "bytes_seen")

    def __init__(self) -> None:
        self._scan = JsonPathCapture((_USAGE, _STATUS))
        self.bytes_seen = 0

    def feed(self, chunk: bytes) -> None:
        self.bytes_seen += len(chunk)
        self._scan.feed(chunk)

    @property
    def usage(self) -> ResponsesUsage | None:
        return responses_usage(self._scan.values.get(_USAGE))

    @property
    def status(self) -> str | None:
        status = self._scan.values.get(_STATUS)
        return status if type(status) is str else None

    @property
    def buffered_bytes(self) -> int:
        return self._scan.buffered_bytes


# SSE line kinds, once a line's field is known.
_UNDECIDED, _DATA, _EVENT, _IGNORED = range(4)


class ResponsesStreamReader:
    """Reads a Responses SSE stream fed chunk by chunk (chunks need not align with events
    or lines).

    After each ``feed``: ``usage`` (once a terminal event brought it), ``final_event``
    (which terminal event came), ``content_events``, ``output_text()`` and
    ``output_text_truncated``, ``error`` (an ``error`` event's fields), ``events_seen`` and
    ``malformed_events``.
    """

    __slots__ = (
        "_data_lines",
        "_event",
        "_finished",
        "_head",
        "_kind",
        "_max_text",
        "_name",
        "_skip_space",
        "_text_len",
        "content_events",
        "error",
        "events_seen",
        "final_event",
        "malformed_events",
        "output_text_truncated",
        "text_parts",
        "usage",
    )

    def __init__(self, *, max_text_chars: int = DEFAULT_MAX_TEXT_CHARS) -> None:
        self._max_text = max_text_chars
        self._kind = _UNDECIDED
        self._head = bytearray()  # a line's start, until its field is known
        self._skip_space = False  # the space after a field's colon is not its value
        self._name = bytearray()  # the pending event's name
        self._event: JsonPathCapture | None = None  # the pending event's data
        self._data_lines = 0
        self._finished = False
        self._text_len = 0
        self.text_parts: list[str] = []
        self.output_text_truncated = False
        self.content_events = 0
        self.events_seen = 0
        self.malformed_events = 0
        self.usage: ResponsesUsage | None = None
        self.final_event: str | None = None
        self.error: dict[str, Any] | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held besides retained text (a partial line's start, an event's values)."""
        held = len(self._head) + len(self._name)
        return held + (self._event.buffered_bytes if self._event is not None else 0)

    def output_text(self) -> str:
        """Generated text seen so far (at most ``max_text_chars``)."""
        return "".join(self.text_parts)

    def feed(self, chunk: bytes) -> None:
        if self._finished:
            raise RuntimeError("ResponsesStreamReader.feed() called after finish()")
        pos, end = 0, len(chunk)
        while pos < end:
            newline = chunk.find(b"\n", pos)
            stop = end if newline < 0 else newline
            self._line_part(chunk, pos, stop)
            if newline < 0:
                return
            self._line_end()
            pos = newline + 1

    def finish(self) -> None:
        """End of stream: an unterminated last event is still read (idempotent)."""
        if self._finished:
            return
        self._finished = True
        if self._kind != _UNDECIDED or self._head:
            self._line_end()
        self._dispatch()

    # ------------------------------------------------------------------ lines

    def _line_part(self, data: bytes, pos: int, stop: int) -> None:
        if self._kind == _UNDECIDED:
            colon = data.find(b":", pos, stop)
            if colon < 0:
                if len(self._head) + (stop - pos) > _MAX_FIELD:
                    self._kind = _IGNORED
                    self._head.clear()
                else:
                    self._head += data[pos:stop]
                return
            self._head += data[pos:colon]
            field = bytes(self._head)
            self._head.clear()
            self._kind = _DATA if field == b"data" else _EVENT if field == b"event" else _IGNORED
            self._skip_space = True
            pos = colon + 1
            if self._kind == _DATA:
                if self._event is None:
                    self._event = JsonPathCapture(_EVENT_PATHS)
                elif self._data_lines:
                    self._event.feed(b"\n")  # SSE joins data lines with a newline
        if self._skip_space and pos < stop:
            self._skip_space = False
            if data[pos] == 0x20:
                pos += 1
        if pos >= stop:
            return
        if self._kind == _DATA:
            assert self._event is not None
            self._event.feed(memoryview(data)[pos:stop])
        elif self._kind == _EVENT and len(self._name) + (stop - pos) <= _MAX_NAME:
            self._name += data[pos:stop]

    def _line_end(self) -> None:
        kind = self._kind
        head = self._head
        if kind == _UNDECIDED and (not head or head == b"\r"):
            self._dispatch()  # a blank line ends the event
        elif kind == _DATA:
            self._data_lines += 1
        self._kind = _UNDECIDED
        self._skip_space = False
        head.clear()

    # ------------------------------------------------------------------ events

    def _dispatch(self) -> None:
        event, self._event = self._event, None
        name = bytes(self._name).strip().decode("utf-8", "replace")
        self._name.clear()
        self._data_lines = 0
        if event is None:
            return  # comments or fields without data
        self.events_seen += 1
        if not event.complete:
            self.malformed_events += 1
        values = event.values
        kind = values.get(_TYPE)
        if type(kind) is not str:
            kind = name
        if kind in TEXT_DELTA_EVENTS:
            self.content_events += 1
            delta = values.get(_DELTA)
            if type(delta) is str:
                self._keep_text(delta)
            elif _DELTA in event.oversized:
                self.output_text_truncated = True  # output whose text kvgate could not keep
        elif kind in TERMINAL_EVENTS:
            if event.complete:
                self.final_event = kind
            usage = responses_usage(values.get(_RESPONSE_USAGE))
            if usage is not None:
                self.usage = usage
        elif kind == "error":
            error = values.get(("error",))
            if type(error) is dict:
                self.error = error
            else:
                self.error = {
                    key: values.get((key,))
                    for key in ("code", "message")
                    if values.get((key,)) is not None
                }

    def _keep_text(self, text: str) -> None:
        if not text or self.output_text_truncated:
            return
        room = self._max_text - self._text_len
        if len(text) > room:
            text = text[:room]
            self.output_text_truncated = True
        if text:
            self.text_parts.append(text)
            self._text_len += len(text)
