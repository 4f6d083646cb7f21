"""POST /pooling: vLLM 0.34's wire format on the embedding model (WordLlama)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient

NAME = "wordllama-l2-supercat"
QUESTION = "What is the capital of France?"


@pytest.fixture
async def pclient(make_client: MakeClient) -> TestClient:
    return await make_client(embedding_model="wordllama")


async def post(client: TestClient, path: str, body: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    assert resp.headers["Content-Type"] == "application/json"
    return resp.status, json.loads(await resp.read())


async def test_answer_shape_and_usage_match_the_embeddings(pclient: TestClient) -> None:
    texts = [QUESTION, "ok"]
    status, pooled = await post(pclient, "/pooling", {"model": NAME, "input": texts})
    assert status == 200
    assert list(pooled) == ["id", "object", "created", "model", "data", "usage"]
    assert pooled["id"].startswith("pooling-") and pooled["object"] == "list"
    assert [list(item) for item in pooled["data"]] == [["index", "object", "data"]] * 2
    assert {item["object"] for item in pooled["data"]} == {"pooling"}
    _, embedded = await post(pclient, "/v1/embeddings", {"model": NAME, "input": texts})
    assert pooled["usage"] == embedded["usage"]
    assert pooled["usage"]["prompt_tokens"] == 8 + 2  # each with its <s>
    np.testing.assert_array_equal(
        np.asarray([item["data"] for item in pooled["data"]]),
        np.asarray([item["embedding"] for item in embedded["data"]]),
    )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions", "dimensions is currently not supported"),
        ({"input": "x", "task": "classify"}, "task", "Unsupported task: 'classify'"),
        ({"input": "x", "task": "token_embed"}, "task", "--pooler-config.task token_embed"),
        ({"data": {"x": 1}}, "task", "No IOProcessor plugin installed"),
    ],
)
async def test_refusals(pclient: TestClient, body: Any, param: str, message: str) -> None:
    status, answer = await post(pclient, "/pooling", {"model": NAME, **body})
    assert status == 400
    assert answer["error"]["param"] == param and message in answer["error"]["message"]


async def test_without_an_embedding_model(make_client: MakeClient) -> None:
    client = await make_client()
    status, answer = await post(client, "/pooling", {"input": "x"})
    assert status == 400
    assert answer["error"]["message"] == "The model does not support Pooling API"
