"""Fixtures for the vLLM simulator suite: the demo model and in-process servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir
from vllm_sim import SimConfig, create_app
from vllm_sim.tokenization import SimTokenizer

MakeClient = Callable[..., Awaitable[TestClient]]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return demo_model_dir()


@pytest.fixture(scope="session")
def sim_tokenizer(model_dir: Path) -> SimTokenizer:
    # Loaded once: every in-process server of the session shares it.
    return SimTokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer on the demo dir: the reference the tests count with."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
async def make_client(model_dir: Path, sim_tokenizer: SimTokenizer) -> AsyncIterator[MakeClient]:
    clients: list[TestClient] = []

    async def factory(**overrides: Any) -> TestClient:
        config = SimConfig(model_dir=model_dir, served_model_name=DEMO_MODEL_NAME, **overrides)
        client = TestClient(TestServer(create_app(config, tokenizer=sim_tokenizer)))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: MakeClient) -> TestClient:
    return await make_client()
