"""Counting engines: how many tokens a piece of text without added tokens encodes to.

Two engines count the same thing:

* ``ReferenceEngine`` runs the model's own ``tokenizer.json`` through Hugging Face
  ``tokenizers``: exact for every vocabulary, but its pre-tokenizer regex dominates the cost
  of a large prompt.
* ``CompiledBpeEngine`` runs the same byte-level BPE vocabulary and split regex in tiktoken's
  compiled BPE, 7-9x faster on this machine.

``choose_engine`` builds the compiled engine only when the tokenizer's shape is one whose
output it provably reproduces, and then checks it against the reference on a probe corpus;
anything else keeps the reference engine (and says why). The conditions, with the reason for
each, are in ``_compiled_ranks``.
"""

from __future__ import annotations

import itertools
import os
import random
import unicodedata
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers import Tokenizer

# GPT-2's byte-to-unicode table: byte-level BPE vocabularies spell every byte as one
# printable character; the compiled engine works on the bytes themselves.


def _byte_level_alphabet() -> dict[str, int]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


_CHAR_TO_BYTE = _byte_level_alphabet()
# str.translate + latin-1 turns a vocabulary entry into its bytes in C, not char by char.
_TO_LATIN1 = {ord(char): byte for char, byte in _CHAR_TO_BYTE.items()}

# The split regex ByteLevel(use_regex=True) applies (GPT-2's), for vocabularies that do
# not spell it out as a Split pre-tokenizer.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# cl100k's split regex, which Llama 3 uses too, and Qwen2's (single digits).
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# In these patterns no alternative matches a letter followed by whitespace, and none looks
# behind: a pre-token always ends between a letter and a space. So a text cut right before
# " x" (letter, space, letter) pre-tokenizes into the same pieces as the whole, and NFC does
# not compose across a space, so each part can be counted on its own, in parallel.
_CUTTABLE_PATTERNS = frozenset({GPT2_PATTERN, CL100K_PATTERN, QWEN2_PATTERN})
# A segment this long is counted in parts on several threads (about 2 ms of BPE per part).
PARALLEL_MIN_CHARS = 64 * 1024
# How far past a planned cut to look for a letter-space-letter spot before giving up on it.
_CUT_SEARCH_CHARS = 4096
_ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Threads start on first use; tiktoken releases the GIL while it encodes.
_PARALLEL_POOL = ThreadPoolExecutor(
    max_workers=os.cpu_count() or 2, thread_name_prefix="kvgate-bpe"
)


def cut_between_words(text: str, parts: int) -> list[str]:
    """``text`` in up to ``parts`` pieces, each cut right before an ASCII space that has an
    ASCII letter on both sides (where the cuttable patterns always end a pre-token)."""
    cuts = [0]
    for i in range(1, parts):
        start = max(cuts[-1] + 1, len(text) * i // parts)
        space = text.find(" ", start, start + _CUT_SEARCH_CHARS)
        while space != -1:
            if (
                0 < space < len(text) - 1
                and text[space - 1] in _ASCII_LETTERS
                and text[space + 1] in _ASCII_LETTERS
            ):
                cuts.append(space)
                break
            space = text.find(" ", space + 1, start + _CUT_SEARCH_CHARS)
    cuts.append(len(text))
    return [text[a:b] for a, b in itertools.pairwise(cuts) if b > a]


class CountingEngine(Protocol):
    """Counts the tokens of a text that holds no added (special) tokens."""

    name: str

    def count(self, text: str) -> int: ...


class ReferenceEngine:
    """The model's tokenizer.json, run by Hugging Face ``tokenizers``."""

    name = "reference"

    def __init__(self, tokenizer: Tokenizer) -> None:
        # The batch entry point releases the GIL while Rust works (plain ``encode`` does
        # not); the "fast" variant skips offsets, which counting never needs.
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def ids(self, text: str) -> list[int]:
        ids: list[int] = self._encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def count(self, text: str) -> int:
        return len(self.ids(text))


class CompiledBpeEngine:
    """The same vocabulary in tiktoken's compiled BPE (ranks = merge priorities).

    tiktoken releases the GIL while it encodes, like ``tokenizers``' batch API. Its ids are
    merge ranks, not the model's ids: only their number is used.
    """

    name = "compiled-bpe"

    def __init__(self, pattern: str, ranks: dict[bytes, int], *, nfc: bool) -> None:
        import tiktoken  # a declared dependency; imported here to keep start-up lean

        self._encoding = tiktoken.Encoding(
            "kvgate-compiled-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
        self._nfc = nfc
        self._cuttable = pattern in _CUTTABLE_PATTERNS
        self._threads = os.cpu_count() or 1

    def count(self, text: str) -> int:
        if self._cuttable and self._threads > 1 and len(text) >= PARALLEL_MIN_CHARS:
            parts = cut_between_words(
                text, min(self._threads, len(text) // (PARALLEL_MIN_CHARS // 2))
            )
            if len(parts) > 1:
                return sum(_PARALLEL_POOL.map(self._count_whole, parts))
        return self._count_whole(text)

    def _count_whole(self, text: str) -> int:
        if self._nfc and not text.isascii():  # ASCII is always NFC: skip the check
            text = unicodedata.normalize("NFC", text)
        return len(self._encoding.encode_ordinary(text))


@dataclass(frozen=True)
class EngineChoice:
    engine: CountingEngine
    # Why the compiled engine was not taken ("" when it was).
    reason: str


class _Unsupported(Exception):
    """The vocabulary is outside what the compiled engine reproduces exactly."""


# Checked once per tokenizer.json content in a process (a reload or a test that loads the
# same directory again takes the verdict): fingerprint -> compiled engine, or why not.
_verdicts: dict[str, CompiledBpeEngine | str] = {}


def choose_engine(
    tokenizer: Tokenizer,
    load_spec: Callable[[], Mapping[str, Any]],
    *,
    prefer: str = "auto",
    fingerprint: str | None = None,
) -> EngineChoice:
    """The fastest engine that counts exactly like ``tokenizer``.

    ``load_spec`` returns the parsed tokenizer.json (only read when the verdict is not
    known yet); ``prefer`` is "auto" (compiled when it passes every check) or "reference";
    ``fingerprint`` (a digest of tokenizer.json) lets a process check each vocabulary once.
    """
    reference = ReferenceEngine(tokenizer)
    if prefer == "reference":
        return EngineChoice(reference, "configured")
    verdict = _verdicts.get(fingerprint) if fingerprint else None
    if verdict is None:
        verdict = _check_compiled(tokenizer, load_spec(), reference)
        if fingerprint:
            _verdicts[fingerprint] = verdict
    if isinstance(verdict, str):
        return EngineChoice(reference, verdict)
    return EngineChoice(verdict, "")


def _check_compiled(
    tokenizer: Tokenizer, spec: Mapping[str, Any], reference: ReferenceEngine
) -> CompiledBpeEngine | str:
    try:
        pattern, ranks, nfc = _compiled_ranks(tokenizer, spec)
        compiled = CompiledBpeEngine(pattern, ranks, nfc=nfc)
    except _Unsupported as exc:
        return str(exc)
    except Exception as exc:  # tiktoken rejects the pattern or the ranks
        return f"tiktoken cannot load it: {exc}"
    for probe in probe_corpus():
        expected, got = reference.count(probe), compiled.count(probe)
        if expected != got:
            return f"self-check: {got} tokens instead of {expected} on {probe[:40]!r}"
    return compiled


def _compiled_ranks(
    tokenizer: Tokenizer, spec: Mapping[str, Any]
) -> tuple[str, dict[bytes, int], bool]:
    """(split pattern, mergeable ranks, NFC?) when tiktoken reproduces this BPE exactly.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank;
    a BPE model merges the adjacent pair listed earliest in its merges. They agree when:

    1. the text reaches the BPE the same way: no normalizer or NFC (done in Python), a split
       regex then the byte-level mapping, no prefix space, no dropout, unknown-token or
       continuing-subword decorations;
    2. every byte is a token, and a token's rank is the first merge that makes it (bytes rank
       below every merge);
    3. a token's merges are contiguous in the merge list, so one rank orders them all;
    4. every split of a token into two tokens is one of its merges (no "shadow" pair that
       tiktoken would merge and the BPE model would not);
    5. unless the model sets ``ignore_merges``, every token encodes to itself by merges
       alone (tiktoken looks a whole pre-token up first, as ``ignore_merges`` does).
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise _Unsupported(f"model type {model.get('type')!r} is not BPE")
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise _Unsupported(f"BPE sets {key}")
    if model.get("byte_fallback"):
        raise _Unsupported("BPE uses byte_fallback (not byte-level)")

    nfc = _normalizer_is_nfc(spec.get("normalizer"))
    pattern = _split_pattern(spec.get("pre_tokenizer"))

    vocab: Mapping[str, int] = model.get("vocab") or {}
    merges = [_merge_pair(m) for m in model.get("merges") or []]
    try:
        to_bytes = {token: token.translate(_TO_LATIN1).encode("latin-1") for token in vocab}
    except UnicodeEncodeError:
        raise _Unsupported("the vocabulary is not spelled in the byte-level alphabet") from None
    spelled = set(to_bytes.values())
    ranks: dict[bytes, int] = {}
    for byte in range(256):
        if bytes([byte]) not in spelled:
            raise _Unsupported(f"byte {byte} is not a token")
        ranks[bytes([byte])] = byte
    pairs: set[tuple[bytes, bytes]] = set()
    last_rank_of: dict[bytes, int] = {}
    for index, (left, right) in enumerate(merges):
        if left not in to_bytes or right not in to_bytes or left + right not in vocab:
            raise _Unsupported(f"merge {left!r} + {right!r} names a token not in the vocabulary")
        a, b = to_bytes[left], to_bytes[right]
        merged = a + b
        rank = 256 + index
        if merged not in ranks:
            ranks[merged] = rank
        elif last_rank_of.get(merged) != rank - 1:
            raise _Unsupported(f"the merges making {merged!r} are not contiguous")
        last_rank_of[merged] = rank
        pairs.add((a, b))
    for token in ranks:
        for cut in range(1, len(token)):
            left_part, right_part = token[:cut], token[cut:]
            if left_part in ranks and right_part in ranks and (left_part, right_part) not in pairs:
                raise _Unsupported(f"{token!r} splits into tokens that are not one of its merges")
    if model.get("ignore_merges"):
        # The BPE takes a whole pre-token found in the vocabulary; tiktoken only knows ranks.
        if len(spelled - ranks.keys()) > 0:
            raise _Unsupported("ignore_merges with tokens no merge makes")
    else:
        reachable = tokenizer.model
        for token_text, token_bytes in to_bytes.items():
            if (
                len(token_bytes) > 1
                and token_bytes in ranks
                and len(reachable.tokenize(token_text)) != 1
            ):
                raise _Unsupported(f"{token_bytes!r} is not reached by merges alone")
    return pattern, ranks, nfc


def _merge_pair(merge: Any) -> tuple[str, str]:
    # tokenizers writes merges as "a b" (older files) or ["a", "b"].
    if isinstance(merge, str):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise _Unsupported(f"unreadable merge {merge!r}")
        return left, right
    if isinstance(merge, list | tuple) and len(merge) == 2:
        return str(merge[0]), str(merge[1])
    raise _Unsupported(f"unreadable merge {merge!r}")


def _normalizer_is_nfc(normalizer: Any) -> bool:
    if normalizer is None:
        return False
    kind = normalizer.get("type")
    if kind == "NFC":
        return True
    if kind == "Sequence":
        steps = normalizer.get("normalizers") or []
        if not steps:
            return False
        if len(steps) == 1:
            return _normalizer_is_nfc(steps[0])
    raise _Unsupported(f"normalizer {kind!r}")


def _split_pattern(pre_tokenizer: Any) -> str:
    """The regex the text is split by before the byte-level mapping."""
    if not isinstance(pre_tokenizer, Mapping):
        raise _Unsupported("no pre-tokenizer: not a byte-level BPE")
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        _check_byte_level(pre_tokenizer, with_regex=True)
        return GPT2_PATTERN
    if kind != "Sequence":
        raise _Unsupported(f"pre-tokenizer {kind!r}")
    steps = pre_tokenizer.get("pretokenizers") or []
    if len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        raise _Unsupported("pre-tokenizer is not Split + ByteLevel")
    split = steps[0]
    regex = (split.get("pattern") or {}).get("Regex")
    if not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert"):
        raise _Unsupported("the Split pre-tokenizer is not an isolating regex")
    _check_byte_level(steps[1], with_regex=False)
    return regex


def _check_byte_level(step: Mapping[str, Any], *, with_regex: bool) -> None:
    if step.get("add_prefix_space"):
        raise _Unsupported("ByteLevel adds a prefix space")
    if bool(step.get("use_regex", True)) != with_regex:
        raise _Unsupported("ByteLevel's own regex is combined with another split")


# -- the self-check's probe corpus ------------------------------------------------------------

_PROBES = (
    "Hello, world! It's a test: don't, WON'T, they'RE, I'd've.",
    "def count(self, text: str) -> int:\n    return len(self._ids(text))  # why\n\n\n",
    "    indented\n\t\ttabs\r\n\r\n  trailing   \n \n",
    "数字 123456789 0.5e-10 1,234,567 ½ ² ٣٤٥ १२३",
    "中文的文本\uff0c包含标点。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
    "Ελληνικά κείμενο, русский текст, עברית, العربية, हिन्दी, ไทย",
    "café cafe\u0301 A\u030a \u212b e\u0301\u0301 \u1e9b\u0323 \ufb01 \uff46\uff55\uff4c\uff4c",
    "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 ❤️ \U0001f600\U0001f600",
    "<|im_start|user <|im_end| <|endoftext||> <tool_call > </tools>",
    "a" * 700 + " " * 300 + "ab" * 200 + "\n" * 50 + "🙂" * 40,
    "\u00a0\u2009\u3000\u200b\ufeff\u2028\u0085 nbsp and friends\u00a0",
    '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}',
)


def probe_corpus() -> list[str]:
    """Fixed texts plus seeded random Unicode, so every start checks the same inputs."""
    rng = random.Random(20261201)
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x370, 0x52F),
        (0x600, 0x6FF),
        (0x900, 0x97F),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F64F),
    ]
    randoms = []
    for _ in range(24):
        chars = []
        for _ in range(rng.randint(50, 400)):
            low, high = rng.choice(ranges)
            chars.append(chr(rng.randint(low, high)))
            if rng.random() < 0.15:
                chars.append(rng.choice([" ", "  ", "\n", "\t", "'s", "'LL", "0", "\r\n"]))
        randoms.append("".join(chars))
    return [*_PROBES, *randoms]
