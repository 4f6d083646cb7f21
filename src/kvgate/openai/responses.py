"""Token usage reported by the engine in OpenAI-style responses.

vLLM (like OpenAI) reports ``usage`` in the final JSON of a non-streaming
response and, when ``stream_options.include_usage`` is set, in a last
``"choices": []`` event of a stream (see :mod:`kvgate.openai.sse`). Settlement
prefers these engine-counted numbers over kvgate's own estimate.

A response can be arbitrarily large (``logprobs``, ``n``, ``echo``), so besides
the whole-body helpers there is an incremental byte scanner
(:class:`JsonUsageScanner`) that finds the top-level ``usage`` of a body of any
size with bounded memory; :mod:`kvgate.openai.sse` reuses it for huge events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # there, but not in typeshed
from typing import Any, Final

__all__ = [
    "DEFAULT_HOLD_BYTES",
    "DEFAULT_MAX_CAPTURE_BYTES",
    "JsonUsageScanner",
    "Usage",
    "usage_from_json_body",
    "usage_from_mapping",
]


@dataclass(frozen=True, slots=True)
class Usage:
    """Engine-reported token counts for one request (all sequences together)."""

    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens served from the prefix cache (``prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _count(value: object) -> int | None:
    # bool is an int subclass: true/false are not token counts.
    if type(value) is int and value >= 0:
        return value
    return None


def usage_from_mapping(usage: Any) -> Usage | None:
    """Build :class:`Usage` from a decoded ``usage`` object, or None if it is not one.

    ``prompt_tokens`` is required; ``completion_tokens`` may be missing or null
    (vLLM's UsageInfo allows it) and then counts as 0; ``cached_tokens`` comes from
    ``prompt_tokens_details`` when present and well-formed.
    """
    if type(usage) is not dict:
        return None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        return None
    raw_completion = usage.get("completion_tokens")
    completion = 0 if raw_completion is None else _count(raw_completion)
    if completion is None:
        return None
    cached = 0
    details = usage.get("prompt_tokens_details")
    if type(details) is dict:
        cached = _count(details.get("cached_tokens")) or 0
    return Usage(prompt, completion, cached)


_USAGE_KEY: Final = b'"usage"'
_WS: Final = b" \t\r\n"
# Give up on the fast path after this many candidate keys and parse everything.
_FAST_PATH_TRIES: Final = 4
_RAW_DECODER: Final = json.JSONDecoder()


def _usage_fast(body: bytes) -> Usage | None:
    """Find the top-level usage object without decoding the whole body.

    OpenAI and vLLM serialise ``usage`` after ``choices``, so the last
    ``"usage"`` key is the top-level one, and only a handful of bytes follow it.
    Only a JSON *key* named usage can match ``"usage"`` + ``:`` (a string value is
    followed by , ] or }, and quotes inside strings are escaped); the candidate
    must also decode to a well-formed usage object. Anything else: None, and the
    caller falls back to a full parse.
    """
    end = len(body)
    for _ in range(_FAST_PATH_TRIES):
        idx = body.rfind(_USAGE_KEY, 0, end)
        if idx < 0:
            return None
        end = idx
        j = idx + len(_USAGE_KEY)
        while j < len(body) and body[j] in _WS:
            j += 1
        if j >= len(body) or body[j] != 0x3A:  # ':'
            continue
        j += 1
        while j < len(body) and body[j] in _WS:
            j += 1
        if j >= len(body) or body[j] != 0x7B:  # '{'
            continue
        try:
            # raw_decode stops after the object: the rest of the body is ignored.
            obj, _ = _RAW_DECODER.raw_decode(body[j:].decode("utf-8"))
        except (ValueError, RecursionError):
            continue
        usage = usage_from_mapping(obj)
        if usage is not None:
            return usage
    return None


def usage_from_json_body(body: bytes) -> Usage | None:
    """Usage from a non-streaming chat/completions response body, or None.

    None when the body is not JSON, is an error body, or has no (valid) usage.
    """
    if not body:
        return None
    usage = _usage_fast(body)
    if usage is not None:
        return usage
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    return usage_from_mapping(obj.get("usage"))


# --------------------------------------------------------------------------- incremental scanner

#: Bound on the raw bytes kept of one captured value (``usage``, ``error``): a
#: real usage object is ~200 bytes; a larger one is dropped, not buffered.
DEFAULT_MAX_CAPTURE_BYTES: Final = 16 * 1024
# Keys longer than this are no key kvgate looks for: not kept.
_MAX_KEY: Final = 32

# A complete JSON string (possessive: no backtracking on long bodies).
_STR: Final = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_FLAT_ARR: Final = rb"\[[^\"{}\[\]]*+\]"
_FLAT_OBJ: Final = rb'\{(?:[^"{}\[\]]++|' + _STR + rb"|" + _FLAT_ARR + rb")*+\}"
# Inside a skipped subtree: swallow scalars, strings and bracket-free containers
# (a logprobs entry, a token's byte list) in one C-level match, stopping at the
# next bracket that changes depth or at a string cut by the end of the piece.
_SKIP: Final = re.compile(
    rb'(?:[^"{}\[\]]++|' + _STR + rb"|" + _FLAT_ARR + rb"|" + _FLAT_OBJ + rb")*+", re.S
)
# The rest of a string body: stops at the closing quote, or before a backslash
# that is the last byte of the piece.
_STR_BODY: Final = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)
# Between structural characters: whitespace, numbers, literals.
_SCALARS: Final = re.compile(rb'[^{}\[\]",:]*+')

# Containers on the tracked path (anything else is skipped without key tracking).
_ROOT, _CHOICES, _CHOICE, _DELTA, _CALLS, _CALL, _FUNC = range(7)
_OBJECT_FRAMES: Final = frozenset({_ROOT, _CHOICE, _DELTA, _CALL, _FUNC})
_LBRACE, _LBRACKET, _QUOTE = 0x7B, 0x5B, 0x22
# (container, key) -> (child container, its opening bracket). None = array element.
_CHILDREN: Final[dict[tuple[int, bytes | None], tuple[int, int]]] = {
    (_ROOT, b"choices"): (_CHOICES, _LBRACKET),
    (_CHOICES, None): (_CHOICE, _LBRACE),
    (_CHOICE, b"delta"): (_DELTA, _LBRACE),
    (_DELTA, b"tool_calls"): (_CALLS, _LBRACKET),
    (_CALLS, None): (_CALL, _LBRACE),
    (_CALL, b"function"): (_FUNC, _LBRACE),
    (_DELTA, b"function_call"): (_FUNC, _LBRACE),
}
# String values that are generated text (see SseStreamFilter.output_text).
_TEXT_KEYS: Final = frozenset(
    {
        (_CHOICE, b"text"),
        (_DELTA, b"content"),
        (_DELTA, b"reasoning"),
        (_DELTA, b"reasoning_content"),
        (_FUNC, b"name"),
        (_FUNC, b"arguments"),
    }
)
_USAGE: Final = b"usage"
_ERROR: Final = b"error"

# Scanner modes.
_M_START, _M_STRUCT, _M_SKIP, _M_CAPTURE, _M_STRING, _M_DONE, _M_DEAD = range(7)
# Where the next token is in the current container.
_ST_KEY, _ST_COLON, _ST_VALUE, _ST_AFTER = range(4)
# What a string being read is.
_S_KEY, _S_TEXT, _S_IGNORE = range(3)

_JSON_WS_BYTES: Final = b" \t\r\n"
# Raw bytes of a text string decoded at a time (memory held for a huge string).
_TEXT_WINDOW: Final = 16 * 1024


def _decode_string(raw: bytes | bytearray) -> str:
    """Decode a whole JSON string body (no quotes); lenient on broken input."""
    text = raw.decode("utf-8", "replace")
    if 0x5C not in raw:
        return text
    try:
        value: str = scanstring(text + '"', 0, False)[0]
    except ValueError:
        return text
    return value


def _decode_prefix(raw: bytes | bytearray) -> tuple[str, int]:
    """Decode the longest prefix of a string body that ends on a whole character
    (not inside a UTF-8 sequence, an escape or a surrogate pair): (text, bytes used)."""
    size = len(raw)
    for used in range(size, max(size - 13, 0), -1):
        try:
            text = raw[:used].decode("utf-8")
            if 0x5C in raw:
                text = scanstring(text + '"', 0, False)[0]
        except ValueError:  # UnicodeDecodeError too
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":
            continue  # the low half of the pair is still to come
        return text, used
    return _decode_string(raw), size  # broken input: keep going, lossy


class _JsonScan:
    """Incremental scanner of one JSON object fed as byte pieces.

    Tracks strings, escapes and depth; keeps only what it is asked for:
    the value of a top-level ``usage`` (and ``error``) key, raw and bounded,
    and, with ``text_room``/``emit_text`` set, the generated text and the
    content-carrying choices of a chat/completions stream chunk. Every other
    subtree is skipped by regex without being kept. Lenient: this is a meter,
    not a validator (numbers and literals are not checked).
    """

    __slots__ = (
        "_cap",
        "_cap_key",
        "_cap_over",
        "_choice_content",
        "_delta_rc",
        "_delta_rc_cut",
        "_delta_rc_len",
        "_delta_reasoning",
        "_delta_role",
        "_delta_text",
        "_depth",
        "_emit",
        "_esc",
        "_frames",
        "_in_str",
        "_key",
        "_max_capture",
        "_mode",
        "_room",
        "_st",
        "_str_any",
        "_str_buf",
        "_str_cut",
        "_str_key",
        "_str_kind",
        "_track",
        "content",
        "error",
        "usage",
    )

    def __init__(
        self,
        *,
        track_choices: bool = False,
        text_room: Callable[[], int] | None = None,
        emit_text: Callable[[str, bool], None] | None = None,
        max_capture_bytes: int = DEFAULT_MAX_CAPTURE_BYTES,
    ) -> None:
        self._track = track_choices
        self._room = text_room
        self._emit = emit_text
        self._max_capture = max_capture_bytes
        self._mode = _M_START
        self._frames: list[int] = []
        self._st = _ST_KEY
        self._key: bytes | None = None
        self._depth = 0  # open containers inside a skipped/captured value
        self._in_str = False  # skipped/captured value: inside a string cut by a piece end
        self._esc = False  # the previous piece ended on a backslash inside a string
        self._cap = bytearray()
        self._cap_key = b""
        self._cap_over = False
        self._str_buf = bytearray()
        self._str_kind = _S_IGNORE
        self._str_key: bytes | None = None
        self._str_cut = False
        self._choice_content = False
        self._delta_role = False
        self._delta_text = False
        self._delta_reasoning = False
        self._delta_rc: list[str] | None = None  # held reasoning_content
        self._delta_rc_cut = False
        self._delta_rc_len = 0
        self._str_any = False  # the text string being read is not empty
        #: Last well-formed non-null top-level usage.
        self.usage: Usage | None = None
        #: Top-level ``error`` object, if any.
        self.error: dict[str, Any] | None = None
        #: Some choice carried generated output (see SseStreamFilter.content_events).
        self.content = False

    @property
    def complete(self) -> bool:
        """The top-level object was closed."""
        return self._mode == _M_DONE

    @property
    def buffered_bytes(self) -> int:
        """Bytes held besides retained text: a captured value and a partial key."""
        held = len(self._cap)
        if self._mode == _M_STRING and self._str_kind == _S_KEY:
            held += len(self._str_buf)
        return held

    def feed(self, data: bytes | bytearray, pos: int = 0, end: int | None = None) -> None:
        """Scan ``data[pos:end]`` (no copy is made of it)."""
        if end is None:
            end = len(data)
        while pos < end:
            mode = self._mode
            if mode == _M_STRUCT:
                pos = self._structure(data, pos, end)
            elif mode in (_M_SKIP, _M_CAPTURE):
                pos = self._skip(data, pos, end)
            elif mode == _M_STRING:
                pos = self._string(data, pos, end)
            elif mode == _M_START:
                while pos < end and data[pos] in _JSON_WS_BYTES:
                    pos += 1
                if pos < end:
                    if data[pos] != _LBRACE:
                        self._mode = _M_DEAD
                        return
                    self._frames.append(_ROOT)
                    self._st = _ST_KEY
                    self._mode = _M_STRUCT
                    pos += 1
            else:
                return  # done, or not an object: the rest is not looked at

    # ------------------------------------------------------------------ structure

    def _structure(self, data: bytes | bytearray, pos: int, end: int) -> int:
        frames = self._frames
        while True:
            m = _SCALARS.match(data, pos, end)
            assert m is not None  # the pattern matches the empty string
            pos = m.end()
            if pos >= end:
                return pos
            c = data[pos]
            pos += 1
            if c == _QUOTE:
                return self._string_start(data, pos, end)
            if c == 0x3A:  # ':'
                self._st = _ST_VALUE
            elif c == 0x2C:  # ','
                self._st = _ST_KEY if frames[-1] in _OBJECT_FRAMES else _ST_VALUE
            elif c in (_LBRACE, _LBRACKET):
                frame = frames[-1]
                key = self._key if frame in _OBJECT_FRAMES else None
                child = _CHILDREN.get((frame, key)) if self._track else None
                if child is not None and child[1] == c:
                    self._push(child[0])
                    self._st = _ST_KEY if c == _LBRACE else _ST_VALUE
                    continue
                self._depth = 1
                self._in_str = False
                if frame == _ROOT and c == _LBRACE and key in (_USAGE, _ERROR):
                    self._mode = _M_CAPTURE
                    self._cap_key = key
                    self._cap = bytearray(b"{")
                    self._cap_over = False
                else:
                    self._mode = _M_SKIP
                return pos
            else:  # '}' or ']'
                self._pop()
                self._st = _ST_AFTER
                if not frames:
                    self._mode = _M_DONE
                    return end

    def _push(self, frame: int) -> None:
        self._frames.append(frame)
        self._key = None
        if frame == _CHOICE:
            self._choice_content = False
        elif frame == _DELTA:
            self._delta_role = self._delta_text = self._delta_reasoning = False
            self._delta_rc = None
            self._delta_rc_cut = False
            self._delta_rc_len = 0

    def _pop(self) -> None:
        frame = self._frames.pop()
        if frame == _DELTA:
            if self._delta_rc is not None and not self._delta_reasoning:
                for text in self._delta_rc:
                    self._text(text, False)
                if self._delta_rc_cut:
                    self._text("", True)
            # vLLM's role announcement ({"role":..,"content":""}) is no decode step.
            if not self._delta_role or self._delta_text:
                self._choice_content = True
        elif frame == _CHOICE and self._choice_content:
            self.content = True

    # ------------------------------------------------------------------ strings

    def _string_start(self, data: bytes | bytearray, pos: int, end: int) -> int:
        frame = self._frames[-1]
        if self._st == _ST_KEY:
            m = _STR_BODY.match(data, pos, end)
            assert m is not None  # the pattern matches the empty string
            q = m.end()
            if q < end and data[q] == _QUOTE:  # the whole key is in this piece
                self._on_key(data[pos:q] if q - pos <= _MAX_KEY else b"")
                return q + 1
            kind = _S_KEY
            key = None
        else:
            key = self._key if frame in _OBJECT_FRAMES else None
            kind = _S_TEXT if self._track and (frame, key) in _TEXT_KEYS else _S_IGNORE
            self._st = _ST_AFTER
            if kind == _S_TEXT and frame == _CHOICE:
                self._choice_content = True  # completions: any "text" is a decode step
        self._mode = _M_STRING
        self._str_kind = kind
        self._str_key = key
        self._str_any = self._str_cut = self._esc = False
        self._str_buf = bytearray()
        return pos

    def _string(self, data: bytes | bytearray, pos: int, end: int) -> int:
        start = pos
        if self._esc:
            self._esc = False
            pos += 1  # the escaped character
            if pos >= end:
                self._keep_string(data, start, end)
                return end
        m = _STR_BODY.match(data, pos, end)
        assert m is not None  # the pattern matches the empty string
        q = m.end()
        if q >= end or data[q] != _QUOTE:
            self._esc = q < end  # stopped before a final backslash
            self._keep_string(data, start, end)
            return end
        self._keep_string(data, start, q)
        self._mode = _M_STRUCT
        if self._str_kind == _S_KEY:
            raw = self._str_buf
            self._on_key(raw if len(raw) <= _MAX_KEY else b"")
        elif self._str_kind == _S_TEXT:
            self._text_end()
        self._str_buf = bytearray()
        return q + 1

    def _keep_string(self, data: bytes | bytearray, pos: int, end: int) -> None:
        kind = self._str_kind
        if kind == _S_IGNORE or pos >= end:
            return
        buf = self._str_buf
        if kind == _S_KEY:
            if len(buf) <= _MAX_KEY:
                buf += data[pos : min(end, pos + _MAX_KEY + 1 - len(buf))]
            return
        self._str_any = True
        # Text: decoded in windows as it arrives, so only a window is ever held.
        while pos < end:
            if self._piece_room() <= 0:
                self._str_cut = True  # the text budget is spent: skip the rest
                buf.clear()
                return
            take = min(end, pos + _TEXT_WINDOW - len(buf))
            buf += data[pos:take]
            pos = take
            if len(buf) >= _TEXT_WINDOW:
                self._text_flush(final=False)

    def _text_flush(self, final: bool) -> None:
        raw = self._str_buf
        if not raw:
            return
        if final:
            text = _decode_string(raw)
            raw.clear()
        else:
            text, used = _decode_prefix(raw)
            del raw[:used]
        if not text:
            return
        if self._str_key == b"reasoning_content":
            # Counted only if the delta has no "reasoning" (vLLM may send both).
            room = self._piece_room()
            if len(text) > room:
                text = text[:room]
                self._delta_rc_cut = True
            if self._delta_rc is None:
                self._delta_rc = [text]
            else:
                self._delta_rc.append(text)
            self._delta_rc_len += len(text)
        else:
            self._text(text, False)

    def _text_end(self) -> None:
        self._text_flush(final=True)
        if self._frames[-1] == _DELTA:
            if self._str_any:
                self._delta_text = True
            if self._str_key == b"reasoning":
                self._delta_reasoning = True
            elif self._str_key == b"reasoning_content" and self._delta_rc is None:
                self._delta_rc = []
        if self._str_cut:
            if self._str_key == b"reasoning_content":
                self._delta_rc_cut = True
            else:
                self._text("", True)

    def _piece_room(self) -> int:
        room = self._room() if self._room is not None else 0
        if self._str_key == b"reasoning_content":
            room -= self._delta_rc_len
        return room

    def _on_key(self, key: bytes | bytearray) -> None:
        self._key = bytes(key)
        self._st = _ST_COLON
        if self._frames[-1] == _DELTA and key == b"role":
            self._delta_role = True

    def _text(self, text: str, cut: bool) -> None:
        if self._emit is not None and (text or cut):
            self._emit(text, cut)

    # ------------------------------------------------------------------ skipped values

    def _skip(self, data: bytes | bytearray, pos: int, end: int) -> int:
        start = pos
        done = False
        if self._in_str:
            if self._esc:
                self._esc = False
                pos += 1
            q = end
            if pos < end:
                m = _STR_BODY.match(data, pos, end)
                assert m is not None  # the pattern matches the empty string
                q = m.end()
            if q >= end or data[q] != _QUOTE:
                self._esc = q < end
                self._captured(data, start, end)
                return end
            pos = q + 1
            self._in_str = False
        depth = self._depth
        while True:
            m = _SKIP.match(data, pos, end)
            assert m is not None  # the pattern matches the empty string
            pos = m.end()
            if pos >= end:
                break
            c = data[pos]
            pos += 1
            if c == _QUOTE:  # a string cut by the end of the piece
                m = _STR_BODY.match(data, pos, end)
                assert m is not None  # the pattern matches the empty string
                q = m.end()
                if q < end and data[q] == _QUOTE:  # cannot happen: _SKIP takes whole strings
                    pos = q + 1
                    continue
                self._in_str = True
                self._esc = q < end
                pos = end
                break
            if c in (_LBRACE, _LBRACKET):
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    done = True
                    break
        self._depth = depth
        self._captured(data, start, pos)
        if done:
            if self._mode == _M_CAPTURE:
                self._capture_done()
            self._mode = _M_STRUCT
            self._st = _ST_AFTER
        return pos

    def _captured(self, data: bytes | bytearray, pos: int, end: int) -> None:
        if self._mode != _M_CAPTURE or self._cap_over:
            return
        if len(self._cap) + (end - pos) > self._max_capture:
            self._cap_over = True  # too big to be a usage object: not kept
            self._cap = bytearray()
            return
        self._cap += memoryview(data)[pos:end] if type(data) is bytes else data[pos:end]

    def _capture_done(self) -> None:
        raw = self._cap
        self._cap = bytearray()
        if self._cap_over:
            return
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return
        if self._cap_key == _USAGE:
            usage = usage_from_mapping(obj)
            if usage is not None:
                self.usage = usage
        elif type(obj) is dict:
            self.error = obj


#: A non-streamed body up to this size is held and read at the end by
#: :func:`usage_from_json_body` (a backwards search: microseconds); a larger one
#: is scanned incrementally as it arrives instead.
DEFAULT_HOLD_BYTES: Final = 64 * 1024


class JsonUsageScanner:
    """Top-level ``usage`` of a non-streamed JSON body of any size, fed in chunks.

    Memory is bounded whatever the body size: a body up to ``hold_bytes`` is
    held and read at the end with :func:`usage_from_json_body`; past that, the
    held bytes and every later chunk go through an incremental scanner that
    keeps only the ``usage`` value (at most ``max_usage_bytes``): ``choices``
    and everything else are skipped as they stream by. Strings, escapes and
    nesting are tracked, so a ``"usage"`` inside a string or a nested object is
    never taken. Both give the same result on a well-formed body; if the key
    occurs twice at top level, the last well-formed one wins.

    ``finish()`` returns the usage, or None when the body had none (not JSON,
    an error body, a body cut before its usage): then the engine's count is
    unknown and the caller must assume the worst case.
    """

    __slots__ = ("_held", "_hold", "_scan", "bytes_seen")

    def __init__(
        self,
        *,
        hold_bytes: int = DEFAULT_HOLD_BYTES,
        max_usage_bytes: int = DEFAULT_MAX_CAPTURE_BYTES,
    ) -> None:
        self._hold = hold_bytes
        self._held: bytearray | None = bytearray()  # None once scanning
        self._scan = _JsonScan(max_capture_bytes=max_usage_bytes)
        self.bytes_seen = 0

    def feed(self, chunk: bytes | bytearray) -> None:
        self.bytes_seen += len(chunk)
        held = self._held
        if held is not None:
            if len(held) + len(chunk) <= self._hold:
                held += chunk
                return
            self._held = None  # too large to hold: scan from here on
            self._scan.feed(held)
        self._scan.feed(chunk)

    def finish(self) -> Usage | None:
        """The body's usage, or None (call once the whole body was fed)."""
        return self.usage

    @property
    def usage(self) -> Usage | None:
        """Usage in the bytes fed so far (same as ``finish()``; a held body is
        read on each access, a scanned one as soon as its usage value ends)."""
        if self._held is not None:
            return usage_from_json_body(bytes(self._held))
        return self._scan.usage

    @property
    def scanning(self) -> bool:
        """The body outgrew ``hold_bytes`` and is being scanned incrementally."""
        return self._held is None

    @property
    def buffered_bytes(self) -> int:
        """Bytes currently held: at most ``hold_bytes`` + ``max_usage_bytes``."""
        return len(self._held) if self._held is not None else self._scan.buffered_bytes
