"""The labelled corpus, and the committed threshold curve matching a fresh computation."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPUS = REPO_ROOT / "tests" / "corpus" / "paraphrase_pairs.jsonl"
TRUE_KINDS = {"synonym", "reorder", "formality", "surface", "filler"}
FALSE_KINDS = {
    "entity", "number", "date", "unit", "unit_direction", "role_swap", "negation", "antonym",
    "code_language", "user_fact", "attribute", "topic", "other_language",
}  # fmt: skip


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "semantic_threshold", REPO_ROOT / "tools" / "semantic_threshold.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_is_labelled_and_balanced() -> None:
    pairs = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    assert len(pairs) >= 400
    for p in pairs:
        assert set(p) == {"a", "b", "same", "lang", "kind"}, p
        assert isinstance(p["same"], bool) and p["a"].strip() and p["b"].strip()
        assert p["a"] != p["b"]
        assert p["kind"] in (TRUE_KINDS if p["same"] else FALSE_KINDS), p
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)
    same = Counter(p["same"] for p in pairs)
    assert 0.4 <= same[True] / len(pairs) <= 0.6
    langs = Counter(p["lang"] for p in pairs)
    for lang in ("en", "de", "fr", "es"):
        assert langs[lang] >= 60
        by_lang = Counter(p["same"] for p in pairs if p["lang"] == lang)
        assert by_lang[True] and by_lang[False]
    assert {"it", "pt", "nl", "mixed"} <= set(langs)
    # The hard negatives the cache must not conflate are all there.
    kinds = Counter(p["kind"] for p in pairs if not p["same"])
    for kind in ("entity", "number", "date", "unit_direction", "negation", "code_language",
                 "user_fact"):  # fmt: skip
        assert kinds[kind] >= 5, kind


def test_lexical_guard(tool: ModuleType) -> None:
    guard = tool.lexical_guard
    assert not guard("Convert 5 km to miles.", "Convert 5 miles to km.")
    assert not guard("Is Berlin bigger than Munich?", "Is Munich bigger than Berlin?")
    assert not guard("My order #48213?", "My order #48231?")
    assert not guard("What is 15% of 80?", "What is 15% of 90?")
    assert guard("What is the capital of France?", "Which city is the capital of France?")
    assert guard("Who won in 2018?", "Who was the winner in 2018?")


def test_committed_curve_is_current(tool: ModuleType) -> None:
    """docs/semantic-cache.md's block and the JSON are what the tool computes now."""
    result = asyncio.run(tool.compute(tool.load_corpus()))
    committed_json = tool.JSON_OUT.read_text(encoding="utf-8")
    assert committed_json == tool._dump(result), "rerun tools/semantic_threshold.py"
    doc = tool.DOC.read_text(encoding="utf-8")
    assert tool.committed_block(doc) == tool.render_block(result)
    evaluation = result["evaluation"]
    # Counts cannot flip on rounding noise: every similarity is far from every threshold.
    assert evaluation["min_margin_to_a_threshold"] > 1e-6
    # What the doc states in prose.
    assert evaluation["default"] is None
    assert evaluation["identical_similarity_false"] == 28
    assert evaluation["guard"]["default"]["threshold"] == 0.99
