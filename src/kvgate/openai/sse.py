"""Incremental decoder/filter for a streamed (SSE) OpenAI/vLLM response body.

Envoy hands kvgate the response body in STREAMED mode, one chunk per message,
and forwards each chunk only once kvgate has replied. Chunks do not align with
SSE events: one event may be split across chunks and one chunk may hold many.

:class:`SseStreamFilter` is fed every chunk and

* returns the bytes to forward (the chunk itself, untouched, unless an event has
  to be removed),
* tracks what settlement needs: the engine's ``usage`` (the last non-null one
  seen; vLLM's final usage event has ``"choices": []``), the generated text (to
  count output tokens when the stream is cut before the usage event), whether
  ``data: [DONE]`` arrived, and any in-band error,
* optionally strips the usage-only event when kvgate, not the client, asked for
  it (``strip_usage_event=True``), so the client sees the stream it requested.

Framing: events end at a blank line. Line endings may be LF or CRLF (or mixed);
a lone CR as line ending (allowed by the SSE spec, used by no OpenAI-compatible
server) is not supported. Fields other than ``data`` (``event:``, ``id:``,
``retry:``, ``:`` comments) are ignored; several ``data:`` lines are joined with
``\\n`` as the SSE spec says.

Cost: each chunk is scanned for boundaries once (bytes.find, or a regex when the
unscanned bytes contain a CR), resuming where the previous scan stopped, never
from the start of the buffer; each data event is JSON-decoded exactly once. With
``track_text=False`` only events that can carry usage or an error (a cheap
substring test) are decoded.
"""

from __future__ import annotations

import json
import re
from json.scanner import make_scanner
from typing import Any, Final

from .responses import Usage, usage_from_mapping

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SseStreamFilter"]

# A blank line: the end of the last line (LF or CRLF) followed by an empty line.
_BOUNDARY: Final = re.compile(rb"\r?\n\r?\n")
# Longest boundary is 4 bytes: after a failed search, a boundary can only begin
# in the last 3 bytes, so the next search resumes there.
_BOUNDARY_OVERLAP: Final = 3
_DATA: Final = b"data:"
_DONE: Final = b"[DONE]"

#: A partial event larger than this makes the filter give up (see ``degraded``):
#: vLLM events are a few hundred bytes (a few KB with logprobs), so this only
#: bounds memory against a broken or hostile upstream.
DEFAULT_MAX_EVENT_BYTES: Final = 4 * 1024 * 1024


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


_scan_once: Final = make_scanner(json.JSONDecoder())
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
            event per chunk).
        track_text: collect generated text (for counting output tokens when the
            stream is cut before usage arrives). When False, only events that may
            hold usage or an error are decoded.
        max_event_bytes: bound on a buffered partial event; beyond it the filter
            forwards everything it holds, stops parsing and sets ``degraded``.

    State after each ``feed``:
        ``usage``: last well-formed non-null usage seen (the final usage event
        overrides continuous stats) or None. ``text_parts`` / ``output_text()``:
        generated text, see :meth:`output_text`. ``done``: ``data: [DONE]`` seen.
        ``events_seen``: events with a data field ([DONE] included).
        ``stripped_events``: events removed. ``malformed_events``: data that was
        not a JSON object. ``error``: the ``error`` object of an in-band error
        event (vLLM reports failures mid-stream that way), else None.
    """

    __slots__ = (
        "_buf",
        "_finished",
        "_max_event",
        "_scan",
        "_strip",
        "_track_text",
        "degraded",
        "done",
        "error",
        "events_seen",
        "malformed_events",
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
    ) -> None:
        self._strip = strip_usage_event
        self._track_text = track_text
        self._max_event = max_event_bytes
        self._buf = bytearray()  # start of the event not yet complete
        self._scan = 0  # where the boundary search resumes inside _buf
        self._finished = False
        self.usage: Usage | None = None
        self.text_parts: list[str] = []
        self.done = False
        self.events_seen = 0
        self.stripped_events = 0
        self.malformed_events = 0
        self.error: dict[str, Any] | None = None
        self.degraded = False

    # ------------------------------------------------------------------ public

    def feed(self, chunk: bytes) -> bytes:
        """Process one body chunk; return the bytes to forward in its place."""
        if self._finished:
            raise RuntimeError("SseStreamFilter.feed() called after finish()")
        if not chunk or self.degraded:
            return chunk
        buf = self._buf
        data: bytes | bytearray
        if buf:
            buf += chunk
            data, pos = buf, self._scan
        else:
            # Fast path: nothing pending, work on the chunk itself (no copy).
            data, pos = chunk, 0
        start = 0  # beginning of the current event
        removed: list[tuple[int, int]] | None = None
        for stop, end in _boundaries(data, pos):
            if self._on_event(data, start, stop) and self._strip:
                if removed is None:
                    removed = [(start, end)]
                else:
                    removed.append((start, end))
            start = end
        size = len(data)
        overflow = size - start > self._max_event

        if not self._strip:
            if overflow:
                self._degrade()
            else:
                self._keep_tail(data, start, size)
            return chunk

        # Stripping: forward complete events (minus removed ones), hold the tail.
        cut = size if overflow else start
        if removed is None:
            out = chunk if (data is chunk and cut == size) else bytes(data[:cut])
        else:
            self.stripped_events += len(removed)
            parts: list[bytes | bytearray] = []
            prev = 0
            for a, b in removed:
                parts.append(data[prev:a])
                prev = b
            parts.append(data[prev:cut])
            out = b"".join(parts)
        if overflow:
            self._degrade()
        else:
            self._keep_tail(data, start, size)
        return out

    def finish(self) -> bytes:
        """End of stream: return any held bytes still to forward (idempotent).

        An unterminated last event (no blank line before end of stream) is still
        parsed for accounting; with stripping it is dropped if it is the usage
        event, otherwise forwarded as it came.
        """
        if self._finished:
            return b""
        self._finished = True
        rest = bytes(self._buf)
        self._buf.clear()
        if not rest:
            return b""
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
        """Generated text seen so far, all choices concatenated.

        Counted: chat ``choices[*].delta.content``; ``delta.reasoning`` (or, if
        absent, the older ``delta.reasoning_content``, never both: vLLM may send
        the same text under both names); tool-call ``function.name`` and
        ``function.arguments`` in ``delta.tool_calls`` and the legacy
        ``delta.function_call``; completions ``choices[*].text`` (which includes
        the prompt when the request set ``echo``). The role chunk and logprobs are
        not text. This approximates completion tokens when no usage arrives.
        """
        return "".join(self.text_parts)

    # ------------------------------------------------------------------ internals

    def _keep_tail(self, data: bytes | bytearray, start: int, size: int) -> None:
        buf = self._buf
        if data is buf:
            if start:
                del buf[:start]
        elif start < size:
            buf += memoryview(data)[start:]
        self._scan = max(0, size - start - _BOUNDARY_OVERLAP)

    def _degrade(self) -> None:
        self.degraded = True
        self._buf.clear()
        self._scan = 0

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
            if self._track_text and type(choices) is list:
                self._collect_text(choices)
        elif (err := obj.get("error")) is not None or obj.get("object") == "error":
            # vLLM: {"error": {...}} (older: {"object": "error", "message": ...}).
            if err is None:
                err = obj
            self.error = err if type(err) is dict else {"message": str(err)}
        return raw_usage is not None and not choices

    def _collect_text(self, choices: list[Any]) -> None:
        parts = self.text_parts
        for choice in choices:
            if type(choice) is not dict:
                continue
            delta = choice.get("delta")
            if delta is None:  # completions: {"text": ...}
                text = choice.get("text")
                if type(text) is str and text:
                    parts.append(text)
                continue
            if type(delta) is not dict:
                continue
            text = delta.get("content")
            if type(text) is str and text:
                parts.append(text)
            reasoning = delta.get("reasoning")
            if type(reasoning) is not str:
                reasoning = delta.get("reasoning_content")
            if type(reasoning) is str and reasoning:
                parts.append(reasoning)
            calls = delta.get("tool_calls")
            if type(calls) is list:
                for call in calls:
                    if type(call) is dict:
                        self._collect_function(call.get("function"))
            legacy = delta.get("function_call")
            if legacy is not None:
                self._collect_function(legacy)

    def _collect_function(self, function: Any) -> None:
        if type(function) is not dict:
            return
        for key in ("name", "arguments"):
            value = function.get(key)
            if type(value) is str and value:
                self.text_parts.append(value)
