"""Fixtures for the tokenize suite: the demo model, its counter, and the reference."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvgate.tokenize import PromptCounter
from testbed.demo_model import DEMO_MODEL_NAME, REPO_ROOT, demo_model_dir

CORPUS_PATH = REPO_ROOT / "tests" / "corpus" / "chat_requests.json"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return demo_model_dir()


@pytest.fixture(scope="session")
def counter(model_dir: Path) -> PromptCounter:
    return PromptCounter.from_model_dir(model_dir, name=DEMO_MODEL_NAME)


@pytest.fixture(scope="session")
def chat_corpus() -> list[dict[str, Any]]:
    return json.loads(CORPUS_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    """transformers' AutoTokenizer on the demo dir: the independent reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def input_ids(out: Any) -> list[int]:
    """apply_chat_template(tokenize=True) returns ids (v4) or a BatchEncoding (v5)."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
