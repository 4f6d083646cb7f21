"""The compiled counting engine equals the reference tokenizer, or is not chosen.

The reference here is the model's tokenizer.json run whole by ``tokenizers`` (added tokens
matched in the text, as vLLM's encode does); kvgate's counter cuts at added tokens, caches
segments and counts them with tiktoken's compiled BPE when the vocabulary passes its checks.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

from kvgate.tokenize import PromptCounter
from kvgate.tokenize.engines import (
    GPT2_PATTERN,
    PARALLEL_MIN_CHARS,
    QWEN2_PATTERN,
    CompiledBpeEngine,
    choose_engine,
    cut_between_words,
    probe_corpus,
)
from kvgate.tokenize.segments import AddedTokenSplitter, SegmentCountCache
from tests.tokenize.conftest import CORPUS_PATH


def reference_count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def demo_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def cached_counter(model_dir: Path) -> PromptCounter:
    """A counter of its own with a segment cache, so repeats go through the cache too."""
    counter = PromptCounter.from_model_dir(model_dir)
    counter.use_cache(SegmentCountCache(4096))
    return counter


def test_demo_vocabulary_gets_the_compiled_engine(counter: PromptCounter) -> None:
    # The parity corpus (test_counter.py) and the e2e ledger tests run on this engine.
    assert counter.engine == "compiled-bpe", counter.engine_reason


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|extra_7|>"]
LOOKALIKES = ["<|im_start|", "<|im_end", "<|endoftext||>", "<| im_start|>", "<im_end>", "|>"]
SNIPPETS = [
    "def f(x):\n\treturn x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i]; }\r\n",
    "SELECT * FROM t WHERE id='O''Brien';",
    "It's, they're, WE'LL, i'D, don'T",
    "1234567890 3.14159 1e-9 0x1F",
    "naïve café Zürich São Paulo",
    "e\u0301 A\u030a \u212b \u1e9b\u0323 \ufb01",  # NFC changes these
    "日本語のテキスト、中文文本\uff0c한국어",
    "👩\u200d👩\u200d👧 🏳️\u200d🌈 ❤️",
    "\u00a0\u2009\u3000\u200b\ufeff\u2028\u0085",
]
UNICODE_RANGES = [
    (0x20, 0x7E),
    (0xA0, 0x2FF),
    (0x300, 0x36F),  # combining marks
    (0x370, 0x52F),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0x1100, 0x11FF),  # Hangul jamo (compose under NFC)
    (0x3000, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF),
    (0x10000, 0x1034F),
]


def random_text(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(1, 40)):
        kind = rng.random()
        if kind < 0.35:
            low, high = rng.choice(UNICODE_RANGES)
            parts.append("".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 30))))
        elif kind < 0.5:
            parts.append(rng.choice(SNIPPETS))
        elif kind < 0.65:
            parts.append("".join(rng.choice(" \t\n\r\u00a0") for _ in range(rng.randint(1, 40))))
        elif kind < 0.75:
            parts.append(rng.choice(SPECIALS))
        elif kind < 0.85:
            parts.append(rng.choice(LOOKALIKES))
        elif kind < 0.93:
            unit = rng.choice(["a", "ab", " ", "\n", "0", "🙂", "é", "==", "ab c"])
            parts.append(unit * rng.randint(50, 2000))
        else:
            parts.append("".join(chr(rng.randint(0x21, 0x7E)) for _ in range(rng.randint(1, 80))))
    return "".join(parts)


def test_randomized_differential(cached_counter: PromptCounter, demo_tokenizer: Tokenizer) -> None:
    rng = random.Random(11)
    texts = [random_text(rng) for _ in range(600)]
    for text in texts + texts[:100]:  # the repeats are answered from the segment cache
        assert cached_counter.count_text(text) == reference_count(demo_tokenizer, text), text
        assert cached_counter.count_completion(text) == reference_count(demo_tokenizer, text) + (
            cached_counter.special_tokens_added
        )


def test_segment_sums_equal_the_whole(
    cached_counter: PromptCounter, demo_tokenizer: Tokenizer
) -> None:
    """A conversation grown turn by turn: cached history plus new turns = the whole count."""
    rng = random.Random(5)
    history = [{"role": "system", "content": random_text(rng)}]
    for _ in range(12):
        history.append({"role": "user", "content": random_text(rng)})
        rendered = cached_counter.render_chat(history)
        assert cached_counter.count_chat(history) == reference_count(demo_tokenizer, rendered)
        history.append({"role": "assistant", "content": random_text(rng)})


def test_whole_corpus_on_both_engines(model_dir: Path, demo_tokenizer: Tokenizer) -> None:
    compiled = PromptCounter.from_model_dir(model_dir)
    reference = PromptCounter.from_model_dir(model_dir, counting_engine="reference")
    assert (compiled.engine, reference.engine) == ("compiled-bpe", "reference")
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    texts = [corpus, *corpus.split("}, {"), *probe_corpus()]
    for text in texts:
        expected = reference_count(demo_tokenizer, text)
        assert compiled.count_text(text) == reference.count_text(text) == expected


def test_hundred_thousand_token_prompt(counter: PromptCounter, demo_tokenizer: Tokenizer) -> None:
    words = random.Random(3).choices(["lorem", "ipsum", "dolor", "sit", "amet,", "42", "\n"], k=1)
    text = " ".join(words * 60_000)
    assert counter.count_text(text) == reference_count(demo_tokenizer, text) > 60_000


# -- engine choice: the compiled engine is only taken where it is exact --------------------


def byte_level_bpe(
    merges: list[tuple[str, str]],
    *,
    pattern: str = QWEN2_PATTERN,
    normalizer: Any = None,
    ignore_merges: bool = False,
) -> Tokenizer:
    """A byte-level BPE over the 256 byte symbols plus the given merges (ASCII only)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


def choice_for(tokenizer: Tokenizer) -> Any:
    import json

    return choose_engine(tokenizer, lambda: json.loads(tokenizer.to_str()))


def test_a_consistent_vocabulary_is_compiled() -> None:
    tokenizer = byte_level_bpe([("a", "b"), ("ab", "c"), ("Ġ", "ab")])
    choice = choice_for(tokenizer)
    assert choice.engine.name == "compiled-bpe", choice.reason
    for text in ["abc", "ab abc", "cab", "abcabc ab", "b c a"]:
        assert choice.engine.count(text) == reference_count(tokenizer, text)


def test_shadow_pair_keeps_the_reference() -> None:
    """'abc' is made from ab + c, but a + bc are tokens too: on "abc" the BPE merges b+c
    first and stops at [a, bc], where tiktoken would go on to 'abc'."""
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    tokenizer = byte_level_bpe(merges)
    choice = choice_for(tokenizer)
    assert choice.engine.name == "reference"
    assert "not one of its merges" in choice.reason
    assert reference_count(tokenizer, "abc") == 2
    # Why the check exists: tiktoken on the same ranks would count one token.
    ranks = {bytes([b]): b for b in range(256)}
    for index, (left, right) in enumerate(merges):
        ranks.setdefault((left + right).encode(), 256 + index)
    assert CompiledBpeEngine(QWEN2_PATTERN, ranks, nfc=False).count("abc") == 1


def test_unreachable_token_keeps_the_reference() -> None:
    """'abcd' exists (ab + cd) but "abcd" as a word stops at [a, bc, d] by merges."""
    merges = [("b", "c"), ("a", "b"), ("c", "d"), ("ab", "cd")]
    tokenizer = byte_level_bpe(merges)
    assert reference_count(tokenizer, "abcd") == 3
    choice = choice_for(tokenizer)
    assert choice.engine.name == "reference"
    assert "merges alone" in choice.reason


def test_non_contiguous_merges_keep_the_reference() -> None:
    merges = [("a", "b"), ("c", "d"), ("ab", "c"), ("x", "y"), ("a", "bc")]
    choice = choice_for(byte_level_bpe([("b", "c"), *merges]))
    assert choice.engine.name == "reference"


@pytest.mark.parametrize(
    ("normalizer", "expected"),
    [
        (None, "compiled-bpe"),
        (normalizers.NFC(), "compiled-bpe"),
        (normalizers.NFKC(), "reference"),
        (normalizers.Lowercase(), "reference"),
    ],
)
def test_normalizers(normalizer: Any, expected: str) -> None:
    tokenizer = byte_level_bpe([("a", "b")], normalizer=normalizer)
    choice = choice_for(tokenizer)
    assert choice.engine.name == expected, choice.reason
    for text in ["ab\ufb01 \u212b ABab", "e\u0301ab"]:
        assert choice.engine.count(text) == reference_count(tokenizer, text)


def test_gpt2_style_byte_level_regex() -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    choice = choice_for(tokenizer)
    assert choice.engine.name == "compiled-bpe", choice.reason
    assert choice.engine.count("the the  he's 123") == reference_count(
        tokenizer, "the the  he's 123"
    )
    assert GPT2_PATTERN.startswith("'s|'t")


def test_not_byte_level_keeps_the_reference() -> None:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert choice_for(tokenizer).engine.name == "reference"


def test_configured_reference(model_dir: Path) -> None:
    counter = PromptCounter.from_model_dir(model_dir, counting_engine="reference")
    assert counter.engine == "reference"
    assert counter.engine_reason == "configured"


# -- added tokens: where plain splitting reproduces the tokenizer and where it does not ------


def test_added_tokens_split_leftmost_longest() -> None:
    splitter = AddedTokenSplitter(["<a>", "<a><b>", "<b>"])
    assert splitter.split("x<a><b>y<b><a>") == (3, ["x", "y"])
    assert splitter.split("") == (0, [])
    assert AddedTokenSplitter([]).split("plain") == (0, ["plain"])


def test_stripping_added_tokens_count_whole_texts() -> None:
    tokenizer = byte_level_bpe([("a", "b")])
    tokenizer.add_special_tokens([AddedToken("<s>", lstrip=True, rstrip=True)])
    counter = PromptCounter(tokenizer, {}, None)
    assert counter.engine == "reference"
    for text in ["ab <s> ab", "x<s>  <s>ab"]:
        assert counter.count_text(text) == reference_count(tokenizer, text)


def test_normalized_added_tokens_without_normalizer() -> None:
    tokenizer = byte_level_bpe([("a", "b")])
    tokenizer.add_tokens([AddedToken("ab c", normalized=True)])
    tokenizer.add_special_tokens([AddedToken("<x>", normalized=False)])
    counter = PromptCounter(tokenizer, {}, None)
    assert counter.engine == "compiled-bpe", counter.engine_reason
    for text in ["ab c<x>ab cab c", "<x>ab c<x>", "zab c"]:
        assert counter.count_text(text) == reference_count(tokenizer, text)


# -- long segments are counted in parts, cut where a pre-token always ends --------------------


def test_cuts_fall_between_ascii_words() -> None:
    text = "alpha beta, gamma\u00a0delta 12 34 epsilon zeta" * 50
    parts = cut_between_words(text, 4)
    assert "".join(parts) == text
    assert len(parts) == 4
    for part in parts[1:]:
        assert part[0] == " " and part[1].isascii() and part[1].isalpha()
    # No letter-space-letter spot: one piece, never a wrong cut.
    assert cut_between_words("日本語" * 1000 + "1 2 3 ,  ." * 100, 4) == [
        "日本語" * 1000 + "1 2 3 ,  ." * 100
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parallel_count_of_long_segments(
    counter: PromptCounter, demo_tokenizer: Tokenizer, seed: int
) -> None:
    rng = random.Random(seed)
    pieces = [random_text(rng) for _ in range(10)]
    vocabulary = ["the", "kv", "cache", "x", "naïve", "e\u0301", "日本", "  ", "\n"]
    words = rng.choices(vocabulary, k=80_000)
    text = " ".join(words) + "".join(pieces)
    assert len(text) >= PARALLEL_MIN_CHARS * 2
    assert len(cut_between_words(text, 2)) == 2
    assert counter.count_text(text) == reference_count(demo_tokenizer, text)
