"""Which prompt path a model directory takes (vLLM's rule) and what loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgate.config.model import ModelConfig
from kvgate.tokenize import (
    PromptCounter,
    TokenizerLoadError,
    detect_tokenizer_mode,
    load_counter,
    resolve_tokenizer_dir,
)
from kvgate.tokenize.loader import MISTRAL_WEIGHTS_RECORD
from kvgate.tokenize.mistral import MistralPromptCounter
from testbed.demo_model import demo_model_dir
from testbed.engine_models import mistral_tekken_model_dir


def _copy(source: Path, target: Path, names: list[str]) -> Path:
    target.mkdir()
    for name in names:
        shutil.copyfile(source / name, target / name)
    return target


def test_a_mistral_format_dir_resolves_and_loads(tmp_path: Path) -> None:
    model_dir = mistral_tekken_model_dir()
    assert resolve_tokenizer_dir(str(model_dir), tmp_path) == model_dir.resolve()
    assert isinstance(load_counter(model_dir), MistralPromptCounter)


def test_dual_format_dir_follows_vllms_rule(tmp_path: Path) -> None:
    """tekken.json beside tokenizer.json: mistral only with consolidated weights."""
    dual = _copy(demo_model_dir(), tmp_path / "dual", ["tokenizer.json", "tokenizer_config.json"])
    shutil.copyfile(mistral_tekken_model_dir() / "tekken.json", dual / "tekken.json")
    assert detect_tokenizer_mode(dual) == "hf"
    assert isinstance(load_counter(dual), PromptCounter)
    # A hub snapshot (no weights fetched) says so through the loader's record.
    record = dual / MISTRAL_WEIGHTS_RECORD
    record.write_text(json.dumps({"consolidated_weights": []}))
    assert detect_tokenizer_mode(dual) == "hf"
    record.write_text(json.dumps({"consolidated_weights": ["consolidated.safetensors"]}))
    assert detect_tokenizer_mode(dual) == "mistral"
    record.unlink()
    (dual / "consolidated.safetensors").write_bytes(b"")
    assert detect_tokenizer_mode(dual) == "mistral"
    # An explicit mode wins, like vLLM's --tokenizer-mode.
    assert isinstance(load_counter(dual, tokenizer_mode="hf"), PromptCounter)


def test_a_dir_with_neither_layout_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerLoadError, match="no Mistral tokenizer file"):
        resolve_tokenizer_dir(str(empty), tmp_path)
    with pytest.raises(TokenizerLoadError):
        load_counter(empty, tokenizer_mode="mistral")


def test_the_config_takes_vllms_mode_names() -> None:
    base = {"name": "m", "tokenizer": "/x", "max_context": 8, "default_max_new_tokens": 1}
    assert ModelConfig(**base, backend="b").tokenizer_mode == "auto"
    for mode in ("hf", "mistral", "harmony"):
        assert ModelConfig(**base, backend="b", tokenizer_mode=mode).tokenizer_mode == mode
    with pytest.raises(ValueError):
        ModelConfig(**base, backend="b", tokenizer_mode="slow")
