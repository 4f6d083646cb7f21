"""`wordllama` itself, loaded offline: the reference the embedders' vectors are checked
against (kvgate and the simulator read WordLlama's weights themselves, never through it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest


def import_wordllama() -> Any:
    """The `wordllama` package (the test is skipped without it). Importing it calls
    `logging.basicConfig(level=INFO)`: the root logger is put back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return pytest.importorskip("wordllama")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def load_reference() -> Any:
    """wordllama's own model, its loader pointed at the package: it would download the
    tokenizer from Hugging Face otherwise (the wheel ships it under another directory)."""
    package = import_wordllama()
    return package.WordLlama.load(cache_dir=Path(package.__file__).parent, disable_download=True)
