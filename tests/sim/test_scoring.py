"""Rerank and score: vLLM 0.34's wire format for a cross-encoder with a score template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from tokenizers import Tokenizer

from testbed.demo_model import demo_model_dir
from testbed.reranker_model import TEMPLATE
from tests.sim.conftest import MakeClient
from vllm_sim.scoring import RERANK_PATHS, SCORE_PATHS

NAME = "qwen3-reranker-demo"
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France is in Europe."]


@pytest.fixture
async def sclient(make_client: MakeClient) -> TestClient:
    return await make_client(score_template=TEMPLATE, max_model_len=512)


async def post(client: TestClient, path: str, body: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    return resp.status, json.loads(await resp.read())


def rendered_tokens(query: str, document: str, instruction: str | None = None) -> int:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    kwargs = {} if instruction is None else {"instruction": instruction}
    text = _compile_jinja_template(TEMPLATE).render(messages=messages, **kwargs)
    tokenizer = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=True).ids)


@pytest.mark.parametrize("path", RERANK_PATHS)
async def test_rerank(sclient: TestClient, path: str) -> None:
    status, answer = await post(sclient, path, {"model": NAME, "query": QUERY, "documents": DOCS})
    assert status == 200
    assert list(answer) == ["id", "model", "usage", "results"]
    assert answer["id"].startswith("score-")
    scores = [r["relevance_score"] for r in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    assert answer["results"][0]["document"] == {"text": DOCS[0], "multi_modal": None}
    tokens = sum(rendered_tokens(QUERY, doc) for doc in DOCS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    _, top = await post(sclient, path, {"query": QUERY, "documents": DOCS, "top_n": 1})
    assert len(top["results"]) == 1 and top["usage"] == answer["usage"]


@pytest.mark.parametrize("path", SCORE_PATHS)
async def test_score_pairs_n_to_n(sclient: TestClient, path: str) -> None:
    body = {"text_1": ["a question", "another"], "text_2": ["an answer", "more"]}
    status, answer = await post(sclient, path, body)
    assert status == 200
    assert [item["object"] for item in answer["data"]] == ["score", "score"]
    tokens = rendered_tokens("a question", "an answer") + rendered_tokens("another", "more")
    assert answer["usage"]["prompt_tokens"] == tokens
    assert answer["usage"]["completion_tokens"] == 0


async def test_instruction_and_truncation(sclient: TestClient) -> None:
    body = {"queries": QUERY, "documents": DOCS[:1], "instruction": "Find capitals"}
    _, answer = await post(sclient, "/score", body)
    assert answer["usage"]["prompt_tokens"] == rendered_tokens(QUERY, DOCS[0], "Find capitals")
    _, cut = await post(sclient, "/score", {**body, "truncate_prompt_tokens": 10})
    assert cut["usage"]["prompt_tokens"] == 10


async def test_refusals(sclient: TestClient) -> None:
    status, answer = await post(sclient, "/score", {"text_1": ["a", "b"], "text_2": ["x"] * 3})
    assert status == 400 and "1:1, 1:N or N:N" in answer["error"]["message"]
    status, answer = await post(sclient, "/rerank", {"query": QUERY, "documents": ["x" * 5000]})
    assert status == 400 and "maximum context length is 512" in answer["error"]["message"]
    status, _ = await post(sclient, "/rerank", {"model": "other", "query": "q", "documents": "d"})
    assert status == 404


async def test_without_a_score_template(make_client: MakeClient) -> None:
    client = await make_client()
    status, answer = await post(client, "/rerank", {"query": "q", "documents": ["d"]})
    assert status == 400
    assert answer["error"]["message"] == "The model does not support Rerank (Score) API"
