"""Reading chosen values out of one JSON object fed in pieces, in bounded memory.

An answer can be one large object (a Responses ``output`` holds the whole generated text,
a stream's last event repeats it; an Anthropic ``message`` holds tool inputs as JSON
objects a client can steer) of which a meter wants a few small values: the top-level
``usage`` of a body, an event's ``type``, ``delta`` and ``response.usage``.
:class:`JsonPathCapture` is given the key paths it wants; it walks the objects on those
paths key by key, skips every other value by regex without keeping it
(strings, escapes and nesting are tracked, so a ``"usage"`` inside a string or another
object is never taken), and keeps the raw bytes of a wanted value up to
``max_capture_bytes``, decoding it once it ends. Lenient: it is a meter, not a validator
(numbers and literals are not checked); malformed structure stops it (``dead``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["DEFAULT_MAX_CAPTURE_BYTES", "JsonPathCapture", "Path"]

Path = tuple[str, ...]

#: Largest value kept (a usage object is a few hundred bytes, a stream delta a few tokens).
DEFAULT_MAX_CAPTURE_BYTES: Final = 64 * 1024
# Keys longer than this are no key looked for: not kept.
_MAX_KEY: Final = 64

# Inside a skipped container: scalars and complete strings in one C-level match, stopping
# at a bracket or at a string cut by the end of the piece.
_SKIP: Final = re.compile(rb'(?:[^"{}\[\]]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.S)
# The rest of a string: stops at its closing quote, or before a backslash that is the
# piece's last byte.
_STR_BODY: Final = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)
_WS: Final = re.compile(rb"[ \t\r\n]*+")
_SCALAR: Final = re.compile(rb"[^,}\] \t\r\n]*+")

_QUOTE, _BACKSLASH, _LBRACE, _RBRACE, _LBRACKET, _COLON, _COMMA = b'"\\{}[:,'

# Modes.
_START, _STRUCT, _KEY, _STRING, _CONTAINER, _SCALAR_MODE, _DONE, _DEAD = range(8)
# Where the next token is in a walked object.
_ST_KEY, _ST_COLON, _ST_VALUE, _ST_AFTER = range(4)


class JsonPathCapture:
    """The values at ``paths`` (key paths from the root object) of one JSON object fed as
    byte pieces. After each ``feed``: ``values`` (path -> the last decoded value there),
    ``oversized`` (paths whose value outgrew ``max_capture_bytes``: not kept),
    ``complete`` (the root object closed) and ``dead`` (not a JSON object)."""

    __slots__ = (
        "_cap",
        "_cap_over",
        "_cap_path",
        "_depth",
        "_esc",
        "_frames",
        "_in_str",
        "_key",
        "_key_buf",
        "_key_over",
        "_max",
        "_mode",
        "_paths",
        "_prefixes",
        "_st",
        "oversized",
        "values",
    )

    def __init__(
        self, paths: Iterable[Path], *, max_capture_bytes: int = DEFAULT_MAX_CAPTURE_BYTES
    ) -> None:
        self._paths = frozenset(paths)
        self._prefixes = frozenset(p[:i] for p in self._paths for i in range(1, len(p)))
        self._max = max_capture_bytes
        self._mode = _START
        self._frames: list[Path] = []  # the walked objects, root first
        self._st = _ST_KEY
        self._key: str | None = None
        self._key_buf = bytearray()
        self._key_over = False
        self._depth = 0  # open containers in a skipped or captured value
        self._in_str = False  # inside a string of a skipped or captured container
        self._esc = False  # the last piece ended on a backslash inside a string
        self._cap: bytearray | None = None  # the raw bytes of the value being captured
        self._cap_path: Path = ()
        self._cap_over = False
        self.values: dict[Path, Any] = {}
        self.oversized: set[Path] = set()

    @property
    def complete(self) -> bool:
        return self._mode == _DONE

    @property
    def dead(self) -> bool:
        return self._mode == _DEAD

    @property
    def buffered_bytes(self) -> int:
        return len(self._key_buf) + (len(self._cap) if self._cap is not None else 0)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        data = bytes(data) if type(data) is memoryview else data
        pos, end = 0, len(data)
        while pos < end:
            mode = self._mode
            if mode == _STRUCT:
                pos = self._struct(data, pos, end)
            elif mode == _CONTAINER:
                pos = self._container(data, pos, end)
            elif mode in (_STRING, _KEY):
                pos = self._string(data, pos, end)
            elif mode == _SCALAR_MODE:
                pos = self._scalar(data, pos, end)
            elif mode == _START:
                pos = _WS.match(data, pos).end()  # type: ignore[union-attr]
                if pos < end:
                    if data[pos] != _LBRACE:
                        self._mode = _DEAD
                        return
                    self._frames.append(())
                    self._st = _ST_KEY
                    self._mode = _STRUCT
                    pos += 1
            else:
                return  # done, or dead: the rest is not looked at

    # ------------------------------------------------------------------ walked objects

    def _struct(self, data: bytes | bytearray, pos: int, end: int) -> int:
        while True:
            pos = _WS.match(data, pos).end()  # type: ignore[union-attr]
            if pos >= end:
                return pos
            char = data[pos]
            st = self._st
            if st in (_ST_KEY, _ST_AFTER):
                if char == _RBRACE:
                    self._frames.pop()
                    if not self._frames:
                        self._mode = _DONE
                        return end
                    self._st = _ST_AFTER
                    pos += 1
                elif st == _ST_KEY and char == _QUOTE:
                    self._mode = _KEY
                    self._key_buf.clear()
                    self._key_over = False
                    return pos + 1
                elif st == _ST_AFTER and char == _COMMA:
                    self._st = _ST_KEY
                    pos += 1
                else:
                    self._mode = _DEAD
                    return end
            elif st == _ST_COLON:
                if char != _COLON:
                    self._mode = _DEAD
                    return end
                self._st = _ST_VALUE
                pos += 1
            else:
                return self._value_start(data, pos)

    def _value_start(self, data: bytes | bytearray, pos: int) -> int:
        key = self._key
        path = (*self._frames[-1], key) if key is not None else None
        char = data[pos]
        if path is not None and path in self._paths:
            self._cap = bytearray()
            self._cap_path = path
            self._cap_over = False
        elif path is not None and char == _LBRACE and path in self._prefixes:
            self._frames.append(path)
            self._st = _ST_KEY
            return pos + 1
        if char in (_LBRACE, _LBRACKET):
            self._mode = _CONTAINER
            self._depth = 1
            self._in_str = False
            self._keep(data, pos, pos + 1)
            return pos + 1
        if char == _QUOTE:
            self._mode = _STRING
            self._keep(data, pos, pos + 1)
            return pos + 1
        self._mode = _SCALAR_MODE
        return pos

    def _value_done(self) -> None:
        cap = self._cap
        if cap is not None:
            self._cap = None
            if self._cap_over:
                self.oversized.add(self._cap_path)
            else:
                with contextlib.suppress(ValueError, RecursionError):
                    self.values[self._cap_path] = json.loads(cap)
        self._mode = _STRUCT
        self._st = _ST_AFTER

    def _keep(self, data: bytes | bytearray, start: int, stop: int) -> None:
        if self._mode == _KEY:
            if not self._key_over:
                if len(self._key_buf) + (stop - start) > _MAX_KEY:
                    self._key_over = True
                    self._key_buf.clear()
                else:
                    self._key_buf += data[start:stop]
            return
        cap = self._cap
        if cap is None or self._cap_over:
            return
        if len(cap) + (stop - start) > self._max:
            self._cap_over = True
            cap.clear()
            return
        cap += data[start:stop]

    # ------------------------------------------------------------------ values

    def _string(self, data: bytes | bytearray, pos: int, end: int) -> int:
        """A key or a string value, from inside it."""
        start = pos
        if self._esc:
            self._esc = False
            pos += 1
        if pos < end:
            pos = _STR_BODY.match(data, pos).end()  # type: ignore[union-attr]
        if pos < end and data[pos] == _QUOTE:
            pos += 1
            if self._mode == _KEY:
                self._keep(data, start, pos - 1)
                self._key = None if self._key_over else self._key_buf.decode("utf-8", "replace")
                self._mode = _STRUCT
                self._st = _ST_COLON
            else:
                self._keep(data, start, pos)
                self._value_done()
            return pos
        if pos < end:  # a backslash, the piece's last byte
            pos += 1
            self._esc = True
        self._keep(data, start, pos)
        return pos

    def _container(self, data: bytes | bytearray, pos: int, end: int) -> int:
        start = pos
        depth = self._depth
        while pos < end:
            if self._in_str:
                if self._esc:
                    self._esc = False
                    pos += 1
                    continue
                pos = _STR_BODY.match(data, pos).end()  # type: ignore[union-attr]
                if pos >= end:
                    break
                if data[pos] == _QUOTE:
                    self._in_str = False
                else:
                    self._esc = True  # a backslash, the piece's last byte
                pos += 1
                continue
            pos = _SKIP.match(data, pos).end()  # type: ignore[union-attr]
            if pos >= end:
                break
            char = data[pos]
            pos += 1
            if char == _QUOTE:
                self._in_str = True
            elif char in (_LBRACE, _LBRACKET):
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self._depth = 0
                    self._keep(data, start, pos)
                    self._value_done()
                    return pos
        self._depth = depth
        self._keep(data, start, pos)
        return pos

    def _scalar(self, data: bytes | bytearray, pos: int, end: int) -> int:
        stop = _SCALAR.match(data, pos).end()  # type: ignore[union-attr]
        self._keep(data, pos, stop)
        if stop < end:
            self._value_done()
        return stop
