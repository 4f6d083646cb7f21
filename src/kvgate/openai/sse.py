"""Incremental decoder/filter for a streamed (SSE) OpenAI/vLLM response body.

Envoy hands kvgate the response body in STREAMED mode, one chunk per message,
and forwards each chunk only once kvgate has replied. Chunks do not align with
SSE events: one event may be split across chunks and one chunk may hold many.

:class:`SseStreamFilter` is fed every chunk and

* returns the bytes to forward (the chunk itself, untouched, unless an event has
  to be removed),
* tracks what settlement needs: the engine's ``usage`` (the last non-null one
  seen; vLLM's final usage event has ``"choices": []``), the generated text and
  the number of content events (to bound output tokens from below when the
  stream is cut before the usage event), whether ``data: [DONE]`` arrived, and
  any in-band error,
* optionally strips the usage-only event when kvgate, not the client, asked for
  it (``strip_usage_event=True``), so the client sees the stream it requested.

Memory is bounded per stream whatever the event sizes (``logprobs``, ``n`` and
``echo`` make events as large as a client likes): an event is held whole only
while it is at most ``max_event_bytes`` (64 KiB). A larger one cannot be vLLM's
usage-only event (~200 bytes), so it is forwarded as it arrives and scanned
incrementally (:class:`kvgate.openai.responses._JsonScan`): its top-level
``usage`` (vLLM's ``continuous_usage_stats`` puts one on every chunk), ``error``,
generated text and content choices are still read, nothing else is kept. The
retained text is capped too (``max_text_chars``, ``output_text_truncated``).

Framing: events end at a blank line. Line endings may be LF or CRLF (or mixed);
a lone CR as line ending (allowed by the SSE spec, used by no OpenAI-compatible
server) is not supported. Fields other than ``data`` (``event:``, ``id:``,
``retry:``, ``:`` comments) are ignored; several ``data:`` lines are joined with
``\\n`` as the SSE spec says.

Cost: each chunk is scanned for boundaries once (bytes.find, or a regex when the
unscanned bytes contain a CR), never rescanning held bytes; each small data
event is JSON-decoded exactly once by the C scanner; a large event is scanned
once, by regexes that skip uninteresting subtrees (logprobs) at C speed. With
``track_text=False`` only small events that can carry usage or an error (a cheap
substring test) are decoded.
"""

from __future__ import annotations

import json
import re
from json.scanner import make_scanner
from typing import Any, Final

from .responses import Usage, _JsonScan, usage_from_mapping

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "DEFAULT_MAX_TEXT_CHARS", "SseStreamFilter"]

# A blank line: the end of the last line (LF or CRLF) followed by an empty line.
_BOUNDARY: Final = re.compile(rb"\r?\n\r?\n")
# Longest boundary is 4 bytes: after a failed search, a boundary can only begin
# in the last 3 bytes, so the next search resumes there.
_BOUNDARY_OVERLAP: Final = 3
_DATA: Final = b"data:"
_DONE: Final = b"[DONE]"

#: Largest event held whole (to decode it at once, or to strip it). vLLM's
#: usage-only event is ~200 bytes and a content event a few hundred (a few KB
#: with logprobs); larger events are streamed through and scanned incrementally.
DEFAULT_MAX_EVENT_BYTES: Final = 64 * 1024
#: Generated text retained for counting a cut stream (characters).
DEFAULT_MAX_TEXT_CHARS: Final = 1024 * 1024


def _boundaries(data: bytes | bytearray, pos: int) -> list[tuple[int, int]]:
    """(event end, boundary end) of every blank line in ``data[pos:]``, in order."""
    if data.find(b"\r", pos) < 0:
        # LF-only (vLLM's framing): bytes.find is several times cheaper than the
        # regex and, without any CR, finds exactly the same boundaries.
        found = []
        find = data.find
        i = find(b"\n\n", pos)
        while i >= 0:
            found.append((i, i + 2))
            i = find(b"\n\n", i + 2)
        return found
    return [m.span() for m in _BOUNDARY.finditer(data, pos)]


def _first_boundary(data: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """(event end, boundary end) of the first blank line in ``data[pos:]``."""
    i = data.find(b"\n\n", pos)
    # A boundary other than LF LF holds a CR, before i if it starts before i.
    if data.find(b"\r", pos, len(data) if i < 0 else i) < 0:
        return None if i < 0 else (i, i + 2)
    m = _BOUNDARY.search(data, pos)
    return None if m is None else m.span()


def _data_of(event: bytes | bytearray) -> bytes | bytearray | None:
    """Joined ``data`` field of a multi-line event, or None if it has none."""
    values: list[bytes | bytearray] | None = None
    for line in event.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.startswith(b"data"):
            continue  # a comment or another field
        if len(line) == 4:
            value = line[4:]  # "data" alone: empty value
        elif line[4] == 0x3A:  # ':'
            value = line[6:] if line.startswith(b" ", 5) else line[5:]
        else:
            continue  # e.g. "dataset: x" is another field
        if values is None:
            values = [value]
        else:
            values.append(value)
    if values is None:
        return None
    return values[0] if len(values) == 1 else b"\n".join(values)


# typeshed types the scanner's context as a make_scanner; it takes any object with a
# decoder's attributes, as json.JSONDecoder itself passes (its own scan_once).
_scan_once: Final = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_JSON_WS: Final = " \t\r\n"


def _decode_object(payload: bytes | bytearray) -> dict[str, Any] | None:
    """Decode one event's JSON object, or None if it is not one.

    Calls the C scanner directly: json.loads would first sniff the encoding and
    run two whitespace regexes, about a third of the cost for a typical event.
    """
    try:
        text = payload.decode("utf-8")
        start = 0
        if text[:1] in _JSON_WS:
            start = len(text) - len(text.lstrip(_JSON_WS))
        obj, end = _scan_once(text, start)
    except (ValueError, RecursionError, StopIteration):
        return None
    if end != len(text) and text[end:].strip(_JSON_WS):
        return None  # trailing garbage
    return obj if type(obj) is dict else None


_LINE_START, _LINE_DATA, _LINE_OTHER = range(3)


class _LargeEvent:
    """SSE fields of one event too large to hold, parsed as its pieces stream by.

    ``data`` values (joined with LF as the SSE spec says) go to a JSON scanner;
    other fields and comments are ignored. Holds at most a 6-byte line prefix.
    """

    __slots__ = ("data_lines", "prefix", "scan", "state")

    def __init__(self, scan: _JsonScan) -> None:
        self.scan = scan
        self.state = _LINE_START
        self.prefix = bytearray()  # start of a line, until its field name is known
        self.data_lines = 0

    def feed(self, data: bytes | bytearray, pos: int, end: int) -> None:
        scan = self.scan
        while pos < end:
            if self.state != _LINE_START:
                nl = data.find(b"\n", pos, end)
                stop = end if nl < 0 else nl
                if self.state == _LINE_DATA and stop > pos:
                    scan.feed(data, pos, stop)  # a CR before LF is JSON whitespace
                if nl < 0:
                    return
                pos = nl + 1
                self.state = _LINE_START
                self.prefix.clear()
                continue
            prefix = self.prefix
            while pos < end and len(prefix) < 6 and data[pos] != 0x0A:
                prefix.append(data[pos])
                pos += 1
            at_eol = pos < end and data[pos] == 0x0A
            if not at_eol and len(prefix) < 6:
                return  # the field name is not known yet
            line = bytes(prefix)
            if at_eol and line.endswith(b"\r"):
                line = line[:-1]
            if line.startswith(_DATA):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
            elif at_eol and line == b"data":
                value = b""
            else:
                self.state = _LINE_OTHER
                continue
            if self.data_lines:
                scan.feed(b"\n")
            self.data_lines += 1
            self.state = _LINE_DATA
            if value:
                scan.feed(value)


class SseStreamFilter:
    """Feed it every response chunk in order; forward what it returns.

    Parameters:
        strip_usage_event: remove the usage-only event (``usage`` non-null and
            ``choices`` empty or absent) from the forwarded bytes. Use when the
            gateway forced ``include_usage`` on a client that did not ask for it.
            Other chunks carrying usage (vLLM's ``continuous_usage_stats``, or
            ``"usage": null`` on every chunk) are forwarded untouched.
            To decide, a trailing partial event is held back until its blank line
            arrives; events that end inside the chunk are forwarded at once, so
            this adds no latency when chunks hold whole events (vLLM writes one
            event per chunk). An event is removed whole or forwarded whole.
        track_text: collect generated text (for counting output tokens when the
            stream is cut before usage arrives). When False, only small events
            that may hold usage or an error are decoded, and ``content_events``
            is estimated from a substring test.
        max_event_bytes: largest event held whole. A larger event is forwarded
            as it arrives and scanned incrementally (usage, error, text and
            content are still read); it is never stripped (it cannot be vLLM's
            ~200-byte usage event). ``buffered_bytes`` stays at most this plus a
            captured usage/error value (``DEFAULT_MAX_CAPTURE_BYTES``).
        max_text_chars: cap on the retained generated text.

    State after each ``feed``:
        ``usage``: last well-formed non-null usage seen (the final usage event
        overrides continuous stats) or None: None at the end means the engine's
        count is unknown. ``text_parts`` / ``output_text()``: generated text, see
        :meth:`output_text`; ``output_text_truncated``: some was not retained.
        ``content_events``: see below. ``done``: ``data: [DONE]`` seen.
        ``events_seen``: events with a data field ([DONE] included).
        ``stripped_events``: events removed. ``large_events``: events scanned
        incrementally. ``malformed_events``: data that was not a JSON object.
        ``error``: the ``error`` object of an in-band error event (vLLM reports
        failures mid-stream that way), else None.

    ``content_events`` counts events in which some choice carries generated
    output: a completions choice with a ``text`` string, or a chat choice with a
    ``delta`` object, except vLLM's role announcement (a delta with ``role`` and
    no text). Empty text counts: vLLM sends an event whenever the engine
    produced tokens for a choice, even if they decode to no text (special
    tokens, a partial UTF-8 character, a held-back stop string); it skips only
    the no-token chunked-prefill step. A tool/reasoning parser may swallow a
    step (no event), and one event may carry several tokens, so each content
    event is at least one output token, never more than the truth. Exception:
    chat ``echo`` sends the last message once per choice as a content event.
    """

    __slots__ = (
        "_buf",
        "_finished",
        "_large",
        "_max_event",
        "_max_text",
        "_pending",
        "_strip",
        "_tail",
        "_text_len",
        "_track_text",
        "content_events",
        "done",
        "error",
        "events_seen",
        "large_events",
        "malformed_events",
        "output_text_truncated",
        "stripped_events",
        "text_parts",
        "usage",
    )

    def __init__(
        self,
        strip_usage_event: bool = False,
        *,
        track_text: bool = True,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    ) -> None:
        self._strip = strip_usage_event
        self._track_text = track_text
        self._max_event = max_event_bytes
        self._max_text = max_text_chars
        self._buf = bytearray()  # the pending event while it is small enough to hold
        self._large: _LargeEvent | None = None  # the pending event, streamed through
        self._pending = False  # an event has begun and not ended
        self._tail = b""  # its last <= 3 bytes: a blank line may straddle chunks
        self._finished = False
        self._text_len = 0
        self.usage: Usage | None = None
        self.text_parts: list[str] = []
        self.output_text_truncated = False
        self.content_events = 0
        self.done = False
        self.events_seen = 0
        self.stripped_events = 0
        self.large_events = 0
        self.malformed_events = 0
        self.error: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public

    @property
    def buffered_bytes(self) -> int:
        """Bytes held besides retained text (a partial event, a partial usage value)."""
        held = len(self._buf)
        if self._large is not None:
            held += self._large.scan.buffered_bytes + len(self._large.prefix)
        return held

    def feed(self, chunk: bytes) -> bytes:
        """Process one body chunk; return the bytes to forward in its place."""
        if self._finished:
            raise RuntimeError("SseStreamFilter.feed() called after finish()")
        if not chunk:
            return chunk
        strip = self._strip
        size = len(chunk)
        before: list[bytes | bytearray] | None = None  # held bytes released (strip)
        pos = 0
        if self._pending:
            found = self._pending_boundary(chunk)
            if found is None:
                released = self._continue_pending(chunk)
                if not strip:
                    return chunk
                return released if released is not None else b""
            stop, pos = found
            held = self._end_pending(chunk, stop)
            if strip:
                before = [] if held is None else [held, chunk[:pos]]

        start = pos  # beginning of the current event
        removed: list[tuple[int, int]] | None = None
        for stop, end in _boundaries(chunk, pos):
            if stop - start <= self._max_event:
                if self._on_event(chunk, start, stop) and strip:
                    if removed is None:
                        removed = [(start, end)]
                    else:
                        removed.append((start, end))
            else:
                large = self._new_large()
                large.feed(chunk, start, stop)
                self._end_large(large)
            start = end

        cut = size  # forwarded up to here (strip mode)
        if start < size:
            self._pending = True
            self._tail = chunk[max(start, size - 3) :]
            if size - start <= self._max_event:
                self._buf += memoryview(chunk)[start:]
                cut = start
            else:
                self._large = self._new_large()
                self._large.feed(chunk, start, size)

        if not strip:
            return chunk
        if before is None and removed is None and cut == size:
            return chunk
        parts: list[bytes | bytearray] = before if before is not None else []
        prev = pos
        if removed is not None:
            self.stripped_events += len(removed)
            for a, b in removed:
                parts.append(chunk[prev:a])
                prev = b
        parts.append(chunk[prev:cut])
        return b"".join(parts)

    def finish(self) -> bytes:
        """End of stream: return any held bytes still to forward (idempotent).

        An unterminated last event (no blank line before end of stream) is still
        parsed for accounting; with stripping it is dropped if it is the usage
        event, otherwise forwarded as it came.
        """
        if self._finished:
            return b""
        self._finished = True
        if not self._pending:
            return b""
        self._pending = False
        large = self._large
        if large is not None:
            self._large = None
            self._end_large(large)
            return b""  # already forwarded
        rest = bytes(self._buf)
        self._buf.clear()
        end = len(rest)
        while end and rest[end - 1] in b"\r\n":
            end -= 1
        is_usage_only = end > 0 and self._on_event(rest, 0, end)
        if not self._strip:
            return b""  # already forwarded as it arrived
        if is_usage_only:
            self.stripped_events += 1
            return b""
        return rest

    def output_text(self) -> str:
        """Generated text seen so far (at most ``max_text_chars``), all choices.

        Counted: chat ``choices[*].delta.content``; ``delta.reasoning`` (or, if
        absent, the older ``delta.reasoning_content``, never both: vLLM may send
        the same text under both names); tool-call ``function.name`` and
        ``function.arguments`` in ``delta.tool_calls`` and the legacy
        ``delta.function_call``; completions ``choices[*].text`` (which includes
        the prompt when the request set ``echo``). The role chunk and logprobs are
        not text. This approximates completion tokens when no usage arrives;
        when ``output_text_truncated``, it is only a prefix of the text.
        """
        return "".join(self.text_parts)

    # ------------------------------------------------------------------ pending event

    def _pending_boundary(self, chunk: bytes) -> tuple[int, int] | None:
        """First blank line ending the pending event, in chunk offsets (the event
        end is negative when the blank line began in the previous chunk)."""
        tail = self._tail
        if tail:
            joint = tail + chunk[:3]
            found = _first_boundary(joint, 0)
            if found is not None:
                n = len(tail)
                return found[0] - n, found[1] - n
        return _first_boundary(chunk, 0)

    def _continue_pending(self, chunk: bytes) -> bytes | None:
        """The pending event goes on past ``chunk``; return the bytes now
        released for forwarding in strip mode (None: all still held)."""
        self._tail = chunk[-3:] if len(chunk) >= 3 else (self._tail + chunk)[-3:]
        large = self._large
        if large is not None:
            large.feed(chunk, 0, len(chunk))
            return chunk
        buf = self._buf
        if len(buf) + len(chunk) <= self._max_event:
            buf += chunk
            return None
        # Too large to hold: forward what was held and stream the rest through.
        held = bytes(buf)
        buf.clear()
        large = self._large = self._new_large()
        large.feed(held, 0, len(held))
        large.feed(chunk, 0, len(chunk))
        return held + chunk if self._strip else None

    def _end_pending(self, chunk: bytes, stop: int) -> bytes | None:
        """The pending event ends at ``chunk[stop]``. Return the held bytes to
        forward before ``chunk`` (strip mode), or None if the event is stripped."""
        self._pending = False
        self._tail = b""
        large = self._large
        if large is not None:
            self._large = None
            if stop > 0:
                large.feed(chunk, 0, stop)
            self._end_large(large)
            return b""
        held = bytes(self._buf)
        self._buf.clear()
        size = len(held) + stop
        if size <= self._max_event:
            event = held[:size] if stop <= 0 else held + chunk[:stop]
            if self._on_event(event, 0, size) and self._strip:
                self.stripped_events += 1
                return None
            return held
        large = self._new_large()
        large.feed(held, 0, len(held))
        large.feed(chunk, 0, stop)
        self._end_large(large)
        return held

    # ------------------------------------------------------------------ large events

    def _new_large(self) -> _LargeEvent:
        track = self._track_text
        return _LargeEvent(
            _JsonScan(
                track_choices=True,
                text_room=self._text_room if track else None,
                emit_text=self._emit_text if track else None,
            )
        )

    def _end_large(self, large: _LargeEvent) -> None:
        self.large_events += 1
        scan = large.scan
        if large.data_lines:
            self.events_seen += 1
            if not scan.complete:
                self.malformed_events += 1
        if scan.usage is not None:
            self.usage = scan.usage
        if scan.error is not None:
            self.error = scan.error
        if scan.content:
            self.content_events += 1

    # ------------------------------------------------------------------ text

    def _text_room(self) -> int:
        return 0 if self.output_text_truncated else self._max_text - self._text_len

    def _emit_text(self, text: str, cut: bool) -> None:
        room = self._text_room()
        if len(text) > room:
            text = text[:room]
            cut = True
        if text:
            self.text_parts.append(text)
            self._text_len += len(text)
        if cut:
            self.output_text_truncated = True  # a prefix only from now on

    # ------------------------------------------------------------------ small events

    def _on_event(self, data: bytes | bytearray, start: int, end: int) -> bool:
        """Account for the event ``data[start:end]``; True if it is usage-only."""
        payload: bytes | bytearray | None
        if data.startswith(_DATA, start) and data.find(b"\n", start, end) < 0:
            # The common case: one "data: {...}" line.
            p = start + 5
            if p < end and data[p] == 0x20:
                p += 1
            payload = data[p:end]
        else:
            payload = _data_of(data[start:end])
            if payload is None:
                return False  # only comments / other fields: nothing to count
        self.events_seen += 1
        if payload == _DONE:
            self.done = True
            return False
        if not self._track_text and b'"usage"' not in payload and b'"error"' not in payload:
            if b'"role"' not in payload and (b'"delta"' in payload or b'"text"' in payload):
                self.content_events += 1  # estimate: not decoded
            return False
        obj = _decode_object(payload)
        if obj is None:
            self.malformed_events += 1
            return False

        raw_usage = obj.get("usage")
        if raw_usage is not None:
            usage = usage_from_mapping(raw_usage)
            if usage is not None:
                self.usage = usage
        choices = obj.get("choices")
        if choices:
            if type(choices) is list and self._collect_text(choices):
                self.content_events += 1
        elif (err := obj.get("error")) is not None or obj.get("object") == "error":
            # vLLM: {"error": {...}} (older: {"object": "error", "message": ...}).
            if err is None:
                err = obj
            self.error = err if type(err) is dict else {"message": str(err)}
        return raw_usage is not None and not choices

    def _collect_text(self, choices: list[Any]) -> bool:
        """Collect the text of ``choices``; True if one carries generated output."""
        track = self._track_text
        content = False
        for choice in choices:
            if type(choice) is not dict:
                continue
            delta = choice.get("delta")
            if delta is None:  # completions: {"text": ...}
                text = choice.get("text")
                if type(text) is str:
                    content = True
                    if text and track:
                        self._emit_text(text, False)
                continue
            if type(delta) is not dict:
                continue
            found = False
            text = delta.get("content")
            if type(text) is str and text:
                found = True
                if track:
                    self._emit_text(text, False)
            reasoning = delta.get("reasoning")
            if type(reasoning) is not str:
                reasoning = delta.get("reasoning_content")
            if type(reasoning) is str and reasoning:
                found = True
                if track:
                    self._emit_text(reasoning, False)
            calls = delta.get("tool_calls")
            if type(calls) is list:
                for call in calls:
                    if type(call) is dict and self._collect_function(call.get("function")):
                        found = True
            legacy = delta.get("function_call")
            if legacy is not None and self._collect_function(legacy):
                found = True
            # vLLM's role announcement ({"role":..,"content":""}) is no decode step.
            if found or "role" not in delta:
                content = True
        return content

    def _collect_function(self, function: Any) -> bool:
        if type(function) is not dict:
            return False
        found = False
        for key in ("name", "arguments"):
            value = function.get(key)
            if type(value) is str and value:
                found = True
                if self._track_text:
                    self._emit_text(value, False)
        return found
