"""End-to-end fixtures: a real Envoy, kvgate and the vLLM simulator on free loopback ports.

Nothing here skips: a missing binary or a process that does not come up fails the test
with the tail of the process logs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.harness import Stack


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e with `e2e` (select with -m e2e / -m 'not e2e')."""
    del config
    for item in items:
        if "tests/e2e/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The default stack (tenant demo / key sk-kvgate-demo, model qwen2.5-demo on
    backend vllm-local), one per test module."""
    with Stack() as running:
        yield running
