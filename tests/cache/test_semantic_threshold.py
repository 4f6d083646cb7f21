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


def test_tool_measures_the_production_guard(tool: ModuleType) -> None:
    """The tool's guard is kvgate.cache.semantic_guard, not a copy of its own."""
    pairs = [
        {"a": "Convert 5 km to miles.", "b": "Convert 5 miles to km.", "same": False},
        {"a": "What is the capital of France?", "b": "what is the capital of france",
         "same": True},
    ]  # fmt: skip
    assert not hasattr(tool, "lexical_guard")
    assert tool.guard_decisions(pairs, "numbers").tolist() == [False, True]
    assert tool.guard_decisions(pairs, "strict").tolist() == [False, True]


def test_choose_prefers_recall_then_the_higher_threshold(tool: ModuleType) -> None:
    def r(t: float, recall: float, fhr: float) -> dict:
        return {"threshold": t, "recall": recall, "false_hit_rate": fhr}

    rows = [r(0.5, 0.4, 0.05), r(0.6, 0.2, 0.01), r(0.7, 0.2, 0.0), r(0.8, 0.1, 0.0)]
    assert tool.choose(rows)["threshold"] == 0.7
    assert tool.choose([r(0.9, 0.5, 0.02)]) is None


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
    levels = evaluation["levels"]
    assert set(levels) == {"strict", "numbers", "off"}
    assert [r["threshold"] for r in levels["off"]["thresholds"]] == list(tool.THRESHOLDS)
    for level in ("strict", "numbers"):
        sweep = [r["threshold"] for r in levels[level]["thresholds"]]
        assert sweep[0] == 0.50 and sweep[-1] == 0.99 and len(sweep) == 50
        assert levels[level]["default"] == tool.choose(levels[level]["thresholds"])
    # What the doc states in prose.
    assert levels["off"]["default"] is None
    assert evaluation["identical_similarity_false"] == 28
    strict, numbers = levels["strict"]["default"], levels["numbers"]["default"]
    assert (strict["threshold"], strict["hits_true"], strict["hits_false"]) == (0.71, 7, 0)
    assert (numbers["threshold"], numbers["hits_true"], numbers["hits_false"]) == (0.97, 9, 0)
    # strict lets no non-paraphrase through at all, whatever the similarity.
    assert levels["strict"]["rejects_false"] == result["corpus"]["negatives"]
