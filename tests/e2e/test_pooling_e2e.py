"""Embeddings, pooling, rerank and score through the real Envoy -> kvgate -> simulator
stack, with the official `openai` SDK (`client.embeddings.create`) and plain HTTP for vLLM's
/pooling, rerank and score paths.

The simulator serves /v1/embeddings with a real embedding model (WordLlama, its Llama-2
vocabulary); kvgate counts each input with the same tokenizer file
(testbed/pooling_models.py). On every request the prompt kvgate counted and reserved
equals the engine's usage.prompt_tokens, the ledger books exactly that (no output
tokens), a tenant over its TPM gets OpenAI's 429 with x-ratelimit-* headers, hostile
bodies get a 400 naming the field, and nothing stays in flight. The simulator also serves a
reranker (the demo Qwen2 tokenizer with a Qwen3-Reranker-style score template,
testbed/reranker_model.py), which kvgate counts with the same template
(`engine_flags.chat_template`): each query-document pair one prompt.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from testbed.harness import (
    DEFAULT_BACKEND,
    DEMO_TENANT,
    REPO_ROOT,
    Stack,
    _demo_model_dir,
    default_models,
    kvgate_metrics,
    kvgate_usage,
    tenant_totals,
    wait_until,
)
from testbed.pooling_models import (
    WORDLLAMA_MAX_MODEL_LEN,
    WORDLLAMA_MODEL_NAME,
    wordllama_model_dir,
)
from testbed.reranker_model import RERANKER_MODEL_NAME, reranker_template

MODEL = WORDLLAMA_MODEL_NAME
# The simulator's context (its default max_model_len), which its reranker shares.
RERANKER_MAX_CONTEXT = 32768
TPM_LIMITED = "small-tpm"
TPM = 400
TIMEOUT_S = 10.0
# One dollar per million input tokens: a token costs 1e6 pico-dollars.
PICO_PER_TOKEN = 1_000_000


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    embedding_model = {
        "name": MODEL,
        "tokenizer": str(wordllama_model_dir()),
        "max_context": WORDLLAMA_MAX_MODEL_LEN,
        "default_max_new_tokens": 16,
        "backend": DEFAULT_BACKEND,
        # Only an input price: pooling generates nothing.
        "pricing": {"input_per_million": "1"},
    }
    template = str(reranker_template())
    reranker = {
        "name": RERANKER_MODEL_NAME,
        "tokenizer": str(_demo_model_dir()),
        "max_context": RERANKER_MAX_CONTEXT,
        "default_max_new_tokens": 16,
        "backend": DEFAULT_BACKEND,
        "pricing": {"input_per_million": "1"},
        # The reranker's vLLM runs with --chat-template <the score template>.
        "engine_flags": {"chat_template": template},
    }
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"},
            {"name": TPM_LIMITED, "api_key": "sk-small-tpm", "limits": {"tpm": TPM}},
        ],
        models=[*default_models(_demo_model_dir()), embedding_model, reranker],
        sim={"extra_args": ["--embedding-model", "wordllama", "--score-template", template]},
    ) as running:
        yield running


def sdk(stack: Stack, tenant: str = DEMO_TENANT) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=stack.api_key(tenant),
        max_retries=0,
        timeout=30.0,
    )


def post(stack: Stack, path: str, body: Any, tenant: str = DEMO_TENANT) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {stack.api_key(tenant)}"},
        timeout=30.0,
    )


def in_flight(stack: Stack) -> tuple[float, float]:
    metrics = kvgate_metrics(stack)
    return (
        metrics.value("kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND),
        metrics.value("kvgate_requests_in_flight", backend=DEFAULT_BACKEND),
    )


def nothing_in_flight(stack: Stack) -> None:
    assert wait_until(lambda: in_flight(stack), lambda v: v == (0, 0), timeout=TIMEOUT_S) == (0, 0)


def settled(stack: Stack, before: dict[str, int], requests: int) -> dict[str, int]:
    totals = wait_until(
        lambda: tenant_totals(stack),
        lambda t: t["requests"] == before["requests"] + requests,
        timeout=TIMEOUT_S,
    )
    return {key: totals[key] - before[key] for key in totals}


def kvgate_count(stack: Stack, request_id: str) -> int:
    entry = stack.wait_access_log(lambda e: e["request_id"] == request_id)
    return int(entry["prompt_tokens"])


def spent_pico(stack: Stack, tenant: str = DEMO_TENANT) -> int:
    """The tenant's cost this month, in pico-dollars (the report gives exact decimals)."""
    for entry in kvgate_usage(stack).get("tenants", []):
        if entry.get("tenant") == tenant:
            return int(Decimal(entry["this_month"]["cost_usd"]) * 10**12)
    return 0


INPUTS: dict[str, Any] = {
    "a string": "The quick brown fox jumps over the lazy dog.",
    "a batch": ["first document", "a second, longer document about embeddings", "3"],
    "token ids": [1, 450, 4996, 17354],
    "token-id lists": [[1, 450], [1, 4996, 17354, 1701]],
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_counted_equals_served_and_the_ledger_is_exact(stack: Stack, name: str) -> None:
    before = tenant_totals(stack)
    spent = spent_pico(stack)
    with sdk(stack) as client:
        raw = client.embeddings.with_raw_response.create(model=MODEL, input=INPUTS[name])
    answer = raw.parse()
    inputs = INPUTS[name]
    expected_items = (
        len(inputs) if isinstance(inputs, list) and not isinstance(inputs[0], int) else 1
    )
    assert len(answer.data) == expected_items
    assert [item.index for item in answer.data] == list(range(expected_items))
    assert all(len(item.embedding) == 256 for item in answer.data)
    served = answer.usage.prompt_tokens
    assert served > 0 and answer.usage.total_tokens == served
    assert kvgate_count(stack, raw.headers["x-request-id"]) == served
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (served, 0)
    assert wait_until(lambda: spent_pico(stack), lambda v: v > spent, timeout=TIMEOUT_S) == (
        spent + served * PICO_PER_TOKEN
    )
    nothing_in_flight(stack)


def test_dimensions_and_base64_pass_through_untouched(stack: Stack) -> None:
    with sdk(stack) as client:
        floats = client.embeddings.create(model=MODEL, input=["alpha", "beta"], dimensions=64)
        assert [len(item.embedding) for item in floats.data] == [64, 64]
        raw = client.embeddings.with_raw_response.create(
            model=MODEL, input=["alpha", "beta"], dimensions=64, encoding_format="base64"
        )
        answer = raw.parse()
        # Little-endian float32 in base64, as vLLM encodes it: the same vectors.
        for item, plain in zip(answer.data, floats.data, strict=True):
            assert isinstance(item.embedding, str)
            decoded = struct.unpack("<64f", base64.b64decode(item.embedding))
            assert max(abs(a - b) for a, b in zip(decoded, plain.embedding, strict=True)) < 1e-6
        assert kvgate_count(stack, raw.headers["x-request-id"]) == answer.usage.prompt_tokens
        # A dimension the model refuses is the engine's 400, charged nothing.
        before = tenant_totals(stack)
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model=MODEL, input="x", dimensions=100)
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (0, 0)
    nothing_in_flight(stack)


def test_truncation_is_counted_as_the_engine_truncates(stack: Stack) -> None:
    body = {"model": MODEL, "input": ["word " * 100, "hi"], "truncate_prompt_tokens": 10}
    response = post(stack, "/v1/embeddings", body)
    assert response.status_code == 200, response.text
    served = response.json()["usage"]["prompt_tokens"]
    assert served <= 20
    assert kvgate_count(stack, response.headers["x-request-id"]) == served
    nothing_in_flight(stack)


def test_an_input_over_the_context_is_refused_naming_input(stack: Stack) -> None:
    with sdk(stack) as client, pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[[1, 2], [5] * (WORDLLAMA_MAX_MODEL_LEN + 1)])
    assert caught.value.param == "input"
    assert caught.value.code == "context_length_exceeded"
    with sdk(stack) as client, pytest.raises(openai.BadRequestError) as text:
        client.embeddings.create(model=MODEL, input="word " * 40_000)
    assert text.value.param == "input"
    nothing_in_flight(stack)


HOSTILE: dict[str, tuple[Any, str]] = {
    "a 10k-item batch": (["x"] * 10_000, "input"),
    "an empty list": ([], "input"),
    "a number": (5, "input"),
    "nested junk": ([[1, [2]]], "input[0][1]"),
    "mixed kinds": (["a", 1], "input[1]"),
    "a negative token id": ([1, -3], "input[1]"),
    "an empty token list": ([[1], []], "input[1]"),
    "an object": ({"text": "x"}, "input"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_are_refused_naming_the_field(stack: Stack, name: str) -> None:
    value, param = HOSTILE[name]
    before = tenant_totals(stack)
    response = post(stack, "/v1/embeddings", {"model": MODEL, "input": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert tenant_totals(stack) == before
    nothing_in_flight(stack)


def test_an_out_of_vocabulary_token_is_the_engines_400_and_free(stack: Stack) -> None:
    before = tenant_totals(stack)
    response = post(stack, "/v1/embeddings", {"model": MODEL, "input": [1, 99_999_999]})
    assert response.status_code == 400
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (0, 0)
    nothing_in_flight(stack)


def test_raw_byte_answers_are_refused(stack: Stack) -> None:
    response = post(
        stack, "/v1/embeddings", {"model": MODEL, "input": "x", "encoding_format": "bytes"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "encoding_format"


def test_a_tenant_over_its_tpm_gets_openais_429_with_rate_limit_headers(stack: Stack) -> None:
    text = "tokens " * 300  # about 300 tokens of the 400 a minute
    with sdk(stack, TPM_LIMITED) as client:
        first = client.embeddings.with_raw_response.create(model=MODEL, input=text)
        assert first.parse().usage.prompt_tokens > TPM // 2
        assert "x-ratelimit-remaining-tokens" in first.headers
        with pytest.raises(openai.RateLimitError) as caught:
            client.embeddings.create(model=MODEL, input=text)
    error = caught.value
    assert error.status_code == 429
    assert error.code == "tpm_exceeded"
    headers = error.response.headers
    assert int(headers["x-ratelimit-limit-tokens"]) == TPM
    assert int(headers["retry-after"]) >= 1
    nothing_in_flight(stack)


def test_pooling_path_is_counted_and_metered_like_embeddings(stack: Stack) -> None:
    """vLLM's /pooling takes the embeddings request grammar: counted and metered the same
    way, its answer's usage settling the ledger."""
    before = tenant_totals(stack)
    response = post(stack, "/pooling", {"model": MODEL, "input": ["hello", "pooling world"]})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [item["object"] for item in answer["data"]] == ["pooling", "pooling"]
    served = answer["usage"]["prompt_tokens"]
    assert kvgate_count(stack, response.headers["x-request-id"]) == served
    refused = post(stack, "/pooling", {"model": MODEL, "input": []})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (served, 0)
    nothing_in_flight(stack)


# --------------------------------------------------------------------------- rerank, score

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "France is in Europe."]
SCORING_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "rerank": ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    "v1 rerank": ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    "v2 rerank with an instruction": (
        "/v2/rerank",
        {"query": QUERY, "documents": DOCUMENTS[:2], "instruction": "Find the capital"},
    ),
    "score 1:N": ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    "v1 score N:N": ("/v1/score", {"queries": ["a", "b"], "documents": ["c", "d"]}),
    "score truncated": (
        "/score",
        {"data_1": QUERY, "data_2": ["word " * 300], "truncate_prompt_tokens": 50},
    ),
}


@pytest.mark.parametrize("name", list(SCORING_BODIES))
def test_scoring_is_counted_as_served_and_billed(stack: Stack, name: str) -> None:
    path, fields = SCORING_BODIES[name]
    before = tenant_totals(stack)
    response = post(stack, path, {"model": RERANKER_MODEL_NAME, **fields})
    assert response.status_code == 200, response.text
    answer = response.json()
    served = answer["usage"]["prompt_tokens"]
    assert served > 0
    assert kvgate_count(stack, response.headers["x-request-id"]) == served
    billed = settled(stack, before, 1)
    assert (billed["prompt_tokens"], billed["output_tokens"]) == (served, 0)
    if "rerank" in path:
        top_n = fields.get("top_n") or len(fields["documents"])
        assert len(answer["results"]) == top_n
    nothing_in_flight(stack)


SCORING_HOSTILE: dict[str, tuple[str, dict[str, Any], str]] = {
    "lengths neither 1:N nor N:N": (
        "/score",
        {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]},
        "text_1",
    ),
    "10k documents": ("/rerank", {"query": "q", "documents": ["d"] * 10_000}, "documents"),
    "no documents": ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    "a multimodal document": (
        "/rerank",
        {"query": "q", "documents": [{"content": [{"type": "text", "text": "d"}]}]},
        "documents[0]",
    ),
    "nested junk": ("/score", {"text_1": "q", "text_2": ["d", ["x"]]}, "text_2[1]"),
    "a document over the context": (
        "/rerank",
        {"query": "q", "documents": ["ok", "word " * (RERANKER_MAX_CONTEXT + 10)]},
        "documents",
    ),
}


@pytest.mark.parametrize("name", list(SCORING_HOSTILE))
def test_hostile_scoring_is_refused_naming_the_field(stack: Stack, name: str) -> None:
    path, fields, param = SCORING_HOSTILE[name]
    before = tenant_totals(stack)
    response = post(stack, path, {"model": RERANKER_MODEL_NAME, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert tenant_totals(stack) == before
    nothing_in_flight(stack)


def test_scoring_a_model_without_a_score_template_is_refused(stack: Stack) -> None:
    """A model vLLM would score by its pair encoding: kvgate cannot count it, so it is
    refused rather than counted low."""
    response = post(stack, "/rerank", {"model": MODEL, "query": "q", "documents": ["d"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    nothing_in_flight(stack)


def test_an_idempotency_key_replays_an_embedding_without_a_second_charge(stack: Stack) -> None:
    before = tenant_totals(stack)
    body = {"model": MODEL, "input": ["replayed once", "and only once"]}
    headers = {"Authorization": f"Bearer {stack.api_key(DEMO_TENANT)}", "idempotency-key": "e-1"}
    first = httpx.post(f"{stack.base_url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    again = httpx.post(f"{stack.base_url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == first.json()
    billed = settled(stack, before, 1)
    assert billed["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
    # Another body under the same key is refused, naming the header.
    other = httpx.post(
        f"{stack.base_url}/v1/embeddings", json={**body, "input": "x"}, headers=headers, timeout=30
    )
    assert other.status_code == 422
    assert other.json()["error"]["param"] == "Idempotency-Key"
    nothing_in_flight(stack)


def test_the_exact_cache_answers_a_repeated_embedding_without_the_backend() -> None:
    """Embeddings have no temperature: their answer is no sampling's, so the exact cache
    keeps and serves them (a chat request needs temperature 0 for that)."""
    embedding_model = {
        "name": MODEL,
        "tokenizer": str(wordllama_model_dir()),
        "max_context": WORDLLAMA_MAX_MODEL_LEN,
        "default_max_new_tokens": 16,
        "backend": DEFAULT_BACKEND,
    }
    with Stack(
        models=[*default_models(_demo_model_dir()), embedding_model],
        sim={"extra_args": ["--embedding-model", "wordllama"]},
        kvgate_overrides={"response_cache": {"enabled": True}},
    ) as cached:

        def arrived() -> int:
            records = httpx.get(f"{cached.sim_url}/sim/requests?limit=1000", timeout=5).json()
            return sum(1 for r in records["requests"] if r["path"] == "/v1/embeddings")

        body = {"model": MODEL, "input": ["a chunk embedded twice", "and its neighbour"]}
        first = post(cached, "/v1/embeddings", body)
        assert first.status_code == 200 and first.headers["x-kvgate-cache"] == "miss"
        count = arrived()
        hit = wait_until(
            lambda: post(cached, "/v1/embeddings", body),
            lambda r: r.headers.get("x-kvgate-cache") == "hit",
            timeout=5,
            interval=0.1,
        )
        assert hit.json() == first.json()
        assert arrived() == count
        # The same bytes on /pooling never meet the embeddings entry.
        other = post(cached, "/pooling", body)
        assert other.status_code == 200 and other.headers["x-kvgate-cache"] == "miss"
        nothing_in_flight(cached)


def test_the_split_layout_meters_an_embedding_from_the_observed_answer() -> None:
    """envoy-observability.yaml: admitted on the request path, the answer metered by the
    observing stream, which reads the embeddings' usage as the inline layout does."""
    embedding_model = {
        "name": MODEL,
        "tokenizer": str(wordllama_model_dir()),
        "max_context": WORDLLAMA_MAX_MODEL_LEN,
        "default_max_new_tokens": 16,
        "backend": DEFAULT_BACKEND,
    }
    with Stack(
        models=[*default_models(_demo_model_dir()), embedding_model],
        sim={"extra_args": ["--embedding-model", "wordllama"]},
        envoy_config=REPO_ROOT / "envoy" / "envoy-observability.yaml",
    ) as split:
        before = tenant_totals(split)
        with sdk(split) as client:
            raw = client.embeddings.with_raw_response.create(
                model=MODEL, input=["observed", "and metered"]
            )
        served = raw.parse().usage.prompt_tokens
        assert kvgate_count(split, raw.headers["x-request-id"]) == served
        billed = settled(split, before, 1)
        assert (billed["prompt_tokens"], billed["output_tokens"]) == (served, 0)
        nothing_in_flight(split)


def test_a_pool_places_embeddings_and_reranks_on_its_endpoints() -> None:
    """A backend that is a pool of two replicas: each pooling request is reserved on the
    endpoint it is placed on (the prompt's KV only) and released there."""
    pool = "pool"
    template = str(reranker_template())
    # The first model of the pool is the one each replica serves as its own (the demo
    # tokenizer); the embedding model is the replicas' --embedding-model.
    models = [
        {
            "name": RERANKER_MODEL_NAME,
            "tokenizer": str(_demo_model_dir()),
            "max_context": RERANKER_MAX_CONTEXT,
            "default_max_new_tokens": 16,
            "backend": pool,
            "engine_flags": {"chat_template": template},
        },
        {
            "name": MODEL,
            "tokenizer": str(wordllama_model_dir()),
            "max_context": WORDLLAMA_MAX_MODEL_LEN,
            "default_max_new_tokens": 16,
            "backend": pool,
        },
    ]
    backends = [
        {
            "name": pool,
            "kv_budget_tokens": 48_000,
            "kv_block_size": 16,
            "max_concurrent_requests": 64,
            "discovery": {"metrics_url": "http://{endpoint}/metrics", "interval_s": 0.5},
        }
    ]
    extra = ["--embedding-model", "wordllama", "--score-template", template]
    with Stack(
        models=models, backends=backends, pool_replicas={pool: 2}, sim={"extra_args": extra}
    ) as pooled:
        before = tenant_totals(pooled)
        served = 0
        for i in range(4):
            embedded = post(pooled, "/v1/embeddings", {"model": MODEL, "input": f"chunk {i}"})
            assert embedded.status_code == 200, embedded.text
            reranked = post(
                pooled,
                "/v1/rerank",
                {"model": RERANKER_MODEL_NAME, "query": "q", "documents": [f"d{i}", "e"]},
            )
            assert reranked.status_code == 200, reranked.text
            for answer in (embedded, reranked):
                tokens = answer.json()["usage"]["prompt_tokens"]
                assert kvgate_count(pooled, answer.headers["x-request-id"]) == tokens
                served += tokens
        billed = settled(pooled, before, 8)
        assert (billed["prompt_tokens"], billed["output_tokens"]) == (served, 0)
        metrics = kvgate_metrics(pooled)
        assert (
            wait_until(
                lambda: kvgate_metrics(pooled).total("kvgate_requests_in_flight"),
                lambda v: v == 0,
                timeout=TIMEOUT_S,
            )
            == 0
        )
        del metrics
