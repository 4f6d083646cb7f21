"""resolve_tokenizer_dir: local model dirs, and hub ids (never downloaded in tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.tokenize import PromptCounter, TokenizerLoadError, resolve_tokenizer_dir


def test_local_model_dir(model_dir: Path, tmp_path: Path) -> None:
    resolved = resolve_tokenizer_dir(str(model_dir), tmp_path / "cache")
    assert resolved == model_dir.resolve()
    assert not (tmp_path / "cache").exists()  # nothing fetched
    assert PromptCounter.from_model_dir(resolved).count_text("hello") == 1


def test_local_dir_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError) as info:
        resolve_tokenizer_dir(str(tmp_path), tmp_path / "cache")
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json" in str(info.value)


def test_missing_local_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="no such model directory"):
        resolve_tokenizer_dir(str(tmp_path / "nope"), tmp_path / "cache")


def test_hub_id_offline_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = "kvgate-tests/definitely-not-a-real-model"
    with pytest.raises(TokenizerLoadError) as info:
        resolve_tokenizer_dir(source, tmp_path / "cache")
    assert info.value.source == source
    assert source in str(info.value)
    assert "HF_HUB_OFFLINE" in str(info.value)


def test_invalid_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerLoadError, match="not a repo"):
        resolve_tokenizer_dir("not a repo!!", tmp_path / "cache")
    with pytest.raises(TokenizerLoadError):
        resolve_tokenizer_dir("", tmp_path / "cache")


def test_unreadable_model_dir(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError):
        PromptCounter.from_model_dir(tmp_path)
