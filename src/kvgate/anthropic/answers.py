"""Reading Anthropic Messages answers for the bill, in bounded memory.

A non-streamed answer is one ``message`` object whose top-level ``usage`` holds
``input_tokens`` and ``output_tokens`` (vLLM adds ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` when it reports prompt-token details; Anthropic's total
prompt is their sum). The body is walked as it passes and only the root object's ``usage``
is kept (:class:`MessageUsageScanner`): a ``tool_use`` block's ``input`` is a JSON object,
and a ``"usage"`` a client steers into it is never read as the answer's.

A stream is a sequence of named SSE events (:class:`MessagesStreamReader`):
``message_start`` carries the prompt's usage (``message.usage.input_tokens``),
``content_block_start``/``content_block_delta``/``content_block_stop`` the content,
``message_delta`` the final ``usage.output_tokens`` (vLLM's also repeats the input),
``message_stop`` the end; ``ping`` keeps the connection alive and ``error`` reports a
failure mid-stream. An event is held whole only up to ``max_event_bytes``; a larger one
is skipped as it passes (what it was is read from its start), so nothing it carried is
kept. The generated text (text, thinking, tool input JSON, tool names) is kept up to
``max_text_chars`` for counting the output of a stream that ends without its usage.

``content_events`` counts ``content_block_delta`` events that carry generated output
(every kind but ``signature_delta``, which vLLM makes up): vLLM writes one for each chat
chunk that had content, so each is at least one output token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from kvgate.json_capture import JsonPathCapture

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_TEXT_CHARS",
    "MessageUsage",
    "MessageUsageScanner",
    "MessagesStreamReader",
    "message_usage",
]

#: Largest event held whole; vLLM's events are a few hundred bytes.
DEFAULT_MAX_EVENT_BYTES: Final = 64 * 1024
#: Generated text retained for counting a stream without usage (characters).
DEFAULT_MAX_TEXT_CHARS: Final = 1024 * 1024

_BOUNDARY: Final = re.compile(rb"\r?\n\r?\n")
# A boundary is at most 4 bytes: after a failed search one can only begin in the last 3.
_OVERLAP: Final = 3
_USAGE_PATH: Final = ("usage",)
# The event a skipped large event was: its "event:" line, or the "type" its data starts with.
_EVENT_NAME: Final = re.compile(rb"^event:[ ]?([A-Za-z_]+)", re.M)
_DATA_TYPE: Final = re.compile(rb'"type"\s*:\s*"([A-Za-z_]+)"')
_PEEK_BYTES: Final = 512
_NO_CONTENT_DELTAS: Final = frozenset({"signature_delta"})
_TEXT_FIELDS: Final = ("text", "thinking", "partial_json")


@dataclass(frozen=True, slots=True)
class MessageUsage:
    """Anthropic's usage, as the prompt kvgate bills: ``input_tokens`` excludes the
    cached parts, so the prompt is their sum."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens


def _count(value: object) -> int | None:
    # bool is an int subclass: true/false are no token counts.
    return value if type(value) is int and value >= 0 else None


def _cache_counts(usage: dict[str, Any]) -> tuple[int, int]:
    read = usage.get("cache_read_input_tokens")
    created = usage.get("cache_creation_input_tokens")
    return _count(read) or 0, _count(created) or 0


def message_usage(usage: object) -> MessageUsage | None:
    """The usage of an answer from a decoded ``usage`` object, or None if it is not one
    (``input_tokens`` and ``output_tokens`` are required)."""
    if type(usage) is not dict:
        return None
    prompt = _count(usage.get("input_tokens"))
    output = _count(usage.get("output_tokens"))
    if prompt is None or output is None:
        return None
    read, created = _cache_counts(usage)
    return MessageUsage(prompt, output, read, created)


class MessageUsageScanner:
    """The top-level usage of a non-streamed ``message`` body fed in chunks, whatever its
    size. Only the root object's own ``usage`` is taken: a tool's ``input`` is a JSON object
    the client can steer, and a ``"usage"`` inside it must never be billed."""

    __slots__ = ("_scan", "bytes_seen")

    def __init__(self) -> None:
        self._scan = JsonPathCapture((_USAGE_PATH,))
        self.bytes_seen = 0

    def feed(self, chunk: bytes) -> None:
        self.bytes_seen += len(chunk)
        self._scan.feed(chunk)

    @property
    def buffered_bytes(self) -> int:
        return self._scan.buffered_bytes

    @property
    def usage(self) -> MessageUsage | None:
        return message_usage(self._scan.values.get(_USAGE_PATH))


class MessagesStreamReader:
    """Reads a Messages SSE stream fed chunk by chunk (chunks need not align with events).

    After each ``feed``: ``usage`` (once ``message_delta`` brought the output count),
    ``content_events``, ``output_text()`` and ``output_text_truncated``, ``started``
    (``message_start`` seen), ``stopped`` (``message_stop`` seen), ``error`` (an
    ``error`` event's error object), ``events_seen``, ``large_events`` and
    ``malformed_events``.
    """

    __slots__ = (
        "_buf",
        "_finished",
        "_input",
        "_large",
        "_large_name",
        "_max_event",
        "_max_text",
        "_output",
        "_scan_from",
        "_tail",
        "_text_len",
        "content_events",
        "error",
        "events_seen",
        "large_events",
        "malformed_events",
        "output_text_truncated",
        "started",
        "stopped",
        "text_parts",
    )

    def __init__(
        self,
        *,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    ) -> None:
        self._max_event = max_event_bytes
        self._max_text = max_text_chars
        self._buf = bytearray()  # the pending event, while small enough to hold
        self._scan_from = 0  # where the boundary search resumes in _buf
        self._large = False  # the pending event outgrew _max_event: skipped as it passes
        self._large_name: bytes | None = None
        self._tail = b""  # a skipped event's last bytes: a blank line may straddle chunks
        self._finished = False
        self._text_len = 0
        # (input, cache read, cache creation) from message_start or message_delta.
        self._input: tuple[int, int, int] | None = None
        self._output: int | None = None
        self.text_parts: list[str] = []
        self.output_text_truncated = False
        self.content_events = 0
        self.events_seen = 0
        self.large_events = 0
        self.malformed_events = 0
        self.started = False
        self.stopped = False
        self.error: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public

    @property
    def usage(self) -> MessageUsage | None:
        """The answer's usage, once the output count arrived (``message_delta``)."""
        if self._output is None or self._input is None:
            return None
        prompt, read, created = self._input
        return MessageUsage(prompt, self._output, read, created)

    @property
    def buffered_bytes(self) -> int:
        """Bytes held besides retained text (a partial event)."""
        return len(self._buf) + len(self._tail)

    def output_text(self) -> str:
        """Generated text seen so far (at most ``max_text_chars``)."""
        return "".join(self.text_parts)

    def feed(self, chunk: bytes) -> None:
        if self._finished:
            raise RuntimeError("MessagesStreamReader.feed() called after finish()")
        if not chunk:
            return
        if self._large:
            joint = self._tail + chunk
            found = _BOUNDARY.search(joint)
            if found is None:
                self._tail = joint[-_OVERLAP:]
                return
            self._end_large()
            chunk = joint[found.end() :]
        buf = self._buf
        buf += chunk
        pos = 0
        while True:
            found = _BOUNDARY.search(buf, max(pos, self._scan_from))
            if found is None:
                break
            self._on_event(bytes(buf[pos : found.start()]))
            pos = found.end()
        if pos:
            del buf[:pos]
        self._scan_from = max(0, len(buf) - _OVERLAP)
        if len(buf) > self._max_event:
            self._large = True
            head = bytes(buf[:_PEEK_BYTES])
            name = _EVENT_NAME.search(head) or _DATA_TYPE.search(head)
            self._large_name = name.group(1) if name is not None else None
            self._tail = bytes(buf[-_OVERLAP:])
            buf.clear()
            self._scan_from = 0

    def finish(self) -> None:
        """End of stream: an unterminated last event is still read (idempotent)."""
        if self._finished:
            return
        self._finished = True
        if self._large:
            self._end_large()
            return
        rest = bytes(self._buf).rstrip(b"\r\n")
        self._buf.clear()
        if rest:
            self._on_event(rest)

    # ------------------------------------------------------------------ events

    def _end_large(self) -> None:
        self._large = False
        self._tail = b""
        self.large_events += 1
        self.events_seen += 1
        if self._large_name == b"content_block_delta":
            # Output whose text kvgate could not keep.
            self.content_events += 1
            self.output_text_truncated = True
        self._large_name = None

    def _on_event(self, raw: bytes) -> None:
        name: str | None = None
        data: list[bytes] = []
        for line in raw.split(b"\n"):
            line = line.removesuffix(b"\r")
            field, colon, value = line.partition(b":")
            if not colon:
                field, value = line, b""
            value = value.removeprefix(b" ")
            if field == b"data":
                data.append(value)
            elif field == b"event":
                name = value.decode("utf-8", "replace")
        if not data:
            return  # comments or other fields only
        self.events_seen += 1
        try:
            obj = json.loads(b"\n".join(data))
        except (ValueError, RecursionError):
            self.malformed_events += 1
            return
        if type(obj) is not dict:
            self.malformed_events += 1
            return
        kind = obj.get("type")
        if type(kind) is not str:
            kind = name
        if kind == "content_block_delta":
            self._on_delta(obj.get("delta"))
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if type(block) is dict:
                for key in ("name", "text", "thinking"):
                    self._keep_text(block.get(key))
        elif kind == "message_start":
            self.started = True
            message = obj.get("message")
            if type(message) is dict:
                self._on_usage(message.get("usage"), output=False)
        elif kind == "message_delta":
            self._on_usage(obj.get("usage"), output=True)
        elif kind == "message_stop":
            self.stopped = True
        elif kind == "error":
            error = obj.get("error")
            self.error = error if type(error) is dict else {"message": str(error)}

    def _on_delta(self, delta: object) -> None:
        if type(delta) is not dict or delta.get("type") in _NO_CONTENT_DELTAS:
            return
        self.content_events += 1
        for key in _TEXT_FIELDS:
            self._keep_text(delta.get(key))

    def _on_usage(self, usage: object, *, output: bool) -> None:
        if type(usage) is not dict:
            return
        prompt = _count(usage.get("input_tokens"))
        if prompt is not None:
            read, created = _cache_counts(usage)
            self._input = (prompt, read, created)
        if output:
            generated = _count(usage.get("output_tokens"))
            if generated is not None:
                self._output = generated

    def _keep_text(self, text: object) -> None:
        if type(text) is not str or not text or self.output_text_truncated:
            return
        room = self._max_text - self._text_len
        if len(text) > room:
            text = text[:room]
            self.output_text_truncated = True
        if text:
            self.text_parts.append(text)
            self._text_len += len(text)
