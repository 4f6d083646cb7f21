"""What kvgate's runtime distribution (the wheel, hence the image) carries: kvgate only;
what may import what outside it (tests/, testbed/, bench/).

The vLLM simulator is a test double with its own distribution (`sim/`, `vllm-sim`), installed
next to kvgate for development by the Makefile; it must not come back into the runtime wheel.
"""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_testbed_and_bench_do_not_import_tests() -> None:
    """The process test bed (testbed/) is shared by tests/ and bench/; neither it nor the
    benchmarks reach into tests/, and the store tests do not borrow the e2e harness."""
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for folder in ("testbed", "bench", "deploy", "tools")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for name in _imports(path)
        if name == "tests" or name.startswith("tests.")
    ]
    offenders += [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in sorted((REPO_ROOT / "tests" / "store").rglob("*.py"))
        for name in _imports(path)
        if name.startswith("tests.e2e")
    ]
    assert offenders == []


def test_package_data_globs_match_files() -> None:
    """Every package-data pattern ships something (a pattern matching nothing is a stale
    claim about what the wheel holds)."""
    project = _toml(REPO_ROOT / "pyproject.toml")
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        root = REPO_ROOT / "src" / package.replace(".", "/")
        for pattern in patterns:
            assert list(root.glob(pattern)), f"{package}: {pattern} matches nothing"
