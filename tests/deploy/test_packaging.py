"""What kvgate's runtime distribution (the wheel, hence the image) carries: kvgate only.

The vLLM simulator is a test double with its own distribution (`sim/`, `vllm-sim`), installed
next to kvgate for development by the Makefile; it must not come back into the runtime wheel.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_runtime_wheel_holds_kvgate_only() -> None:
    project = _toml(REPO_ROOT / "pyproject.toml")
    find = project["tool"]["setuptools"]["packages"]["find"]
    assert find["where"] == ["src"]
    assert find["include"] == ["kvgate", "kvgate.*"]
    # Nothing else sits in src/ either (the Dockerfile copies src/ whole; kvgate itself is a
    # namespace package, without __init__.py, so look at directories).
    top_level = {
        p.name
        for p in (REPO_ROOT / "src").iterdir()
        if p.is_dir() and not p.name.endswith(".egg-info") and p.name != "__pycache__"
    }
    assert top_level == {"kvgate"}
    assert set(project["project"]["scripts"]) == {"kvgate"}
    extras = project["project"]["optional-dependencies"]
    assert "sim" not in extras
    assert not any("vllm" in req for reqs in extras.values() for req in reqs)


def test_simulator_is_its_own_distribution() -> None:
    sim = _toml(REPO_ROOT / "sim" / "pyproject.toml")["project"]
    assert sim["name"] == "vllm-sim"
    assert sim["scripts"] == {"vllm-sim": "vllm_sim.cli:main"}
    assert (REPO_ROOT / "sim" / "src" / "vllm_sim" / "__init__.py").is_file()
    # The development install brings it (the e2e harness and `make up` run `vllm-sim`).
    assert "-e ./sim" in (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
