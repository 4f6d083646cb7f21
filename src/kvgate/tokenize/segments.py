"""A prompt's count as the sum of its segments' counts, each segment counted once.

``tokenizers`` first cuts the input at every added token (``<|im_start|>``, ``<|im_end|>``,
…), each of which is one token, and only then normalizes, pre-tokenizes and runs the BPE on
the text between them. So the count of a rendered chat prompt is the number of added tokens
plus the count of every segment between them, and a segment's count never depends on its
neighbours. A conversation resent with one more turn is its old segments plus new ones:
caching counts per segment digest makes the history and a shared system prompt free after
their first appearance.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import AddedToken

# Segments shorter than this are counted directly: hashing and the lock cost about as much.
MIN_CACHED_CHARS = 64


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    capacity: int


class SegmentCountCache:
    """A thread-safe LRU of segment digest -> token count, shared by every model.

    Keys are keyed BLAKE2b digests (one key per tokenizer), so two models never share an
    entry and a reloaded tokenizer starts empty. Entries are small and fixed-size: memory is
    bounded by ``capacity``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> int | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, value: int) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = capacity
            while len(self._data) > max(capacity, 0):
                self._data.popitem(last=False)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, len(self._data), self.capacity)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def segment_key(scope: bytes, segment: str) -> bytes:
    # surrogatepass: generated text from a backend may hold lone surrogates.
    data = segment.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16, key=scope).digest()


class AddedTokenSplitter:
    """Cuts text at added tokens the way ``tokenizers`` does.

    ``tokenizers`` matches the tokens that are not ``normalized`` first, then, in the text
    between them, the ``normalized`` ones (after normalization; only allowed here when the
    model has no normalizer, so that text is the same). Each pass is leftmost-longest.
    """

    def __init__(self, raw: Iterable[str], normalized: Iterable[str] = ()) -> None:
        self._passes = [p for p in (_alternation(raw), _alternation(normalized)) if p]

    def split(self, text: str) -> tuple[int, list[str]]:
        """(number of added tokens, the non-empty segments between them)."""
        added = 0
        segments = [text] if text else []
        for pattern in self._passes:
            next_segments: list[str] = []
            for segment in segments:
                parts = pattern.split(segment)
                # re.split with one group alternates text, token, text, ..., text.
                added += len(parts) // 2
                next_segments.extend(p for p in parts[::2] if p)
            segments = next_segments
        return added, segments

    @classmethod
    def from_added_tokens(
        cls, added_tokens: Iterable[AddedToken], *, has_normalizer: bool
    ) -> AddedTokenSplitter | None:
        """None when an added token matches in a way plain splitting cannot reproduce.

        ``lstrip``/``rstrip`` eat neighbouring whitespace, ``single_word`` needs word
        boundaries, and ``normalized`` tokens of a model with a normalizer match normalized
        text; the counter then hands whole texts to the reference tokenizer.
        """
        raw: list[str] = []
        normalized: list[str] = []
        for token in added_tokens:
            if token.lstrip or token.rstrip or token.single_word:
                return None
            if token.normalized:
                if has_normalizer:
                    return None
                normalized.append(token.content)
            else:
                raw.append(token.content)
        return cls(raw, normalized)


def _alternation(contents: Iterable[str]) -> re.Pattern[str] | None:
    # Longest first: Python's alternation takes the first alternative that matches, so
    # this is leftmost-longest, as the Aho-Corasick matcher in tokenizers.
    ordered = sorted({c for c in contents if c}, key=len, reverse=True)
    if not ordered:
        return None
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")")
