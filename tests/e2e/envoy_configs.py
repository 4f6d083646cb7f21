"""Every Envoy bootstrap in the repo (envoy/ and deploy/): the files that hold one whole
Envoy config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from testbed.harness import REPO_ROOT

CONFIG_DIRS = [REPO_ROOT / "envoy", REPO_ROOT / "deploy"]


def _yaml_documents(path: Path) -> list[Any]:
    try:
        return list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except yaml.YAMLError:
        return []


def _is_envoy_bootstrap(path: Path) -> bool:
    docs = _yaml_documents(path)
    return (
        len(docs) == 1
        and isinstance(docs[0], dict)
        and ("static_resources" in docs[0] or "admin" in docs[0])
    )


def envoy_bootstraps() -> list[Path]:
    found: list[Path] = []
    for base in CONFIG_DIRS:
        if base.is_dir():
            found += [
                p
                for p in sorted(base.rglob("*.y*ml"))
                if p.suffix in (".yaml", ".yml") and _is_envoy_bootstrap(p)
            ]
    return found
