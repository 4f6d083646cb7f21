"""POST /v1/embeddings: vLLM 0.34's wire format, backed by WordLlama (a real model)."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from testbed.wordllama_reference import load_reference
from tests.sim.conftest import MakeClient
from tests.sim.helpers import MODEL
from vllm_sim.cli import build_parser, config_from_args
from vllm_sim.embeddings import load_embedding_model

EMBED = "/v1/embeddings"
NAME = "wordllama-l2-supercat"
QUESTION = "What is the capital of France?"


@pytest.fixture
async def eclient(make_client: MakeClient) -> TestClient:
    return await make_client(embedding_model="wordllama")


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_reference()


async def post(client: TestClient, body: Any, **headers: str) -> tuple[int, Any, bytes]:
    resp = await client.post(EMBED, json=body, headers=headers)
    raw = await resp.read()
    assert resp.headers["Content-Type"] == "application/json"
    return resp.status, json.loads(raw), raw


def vectors(answer: dict[str, Any]) -> np.ndarray:
    rows = []
    for item in answer["data"]:
        emb = item["embedding"]
        if isinstance(emb, str):
            rows.append(np.frombuffer(base64.b64decode(emb), dtype="<f4"))
        else:
            rows.append(np.asarray(emb, dtype=np.float32))
    return np.stack(rows)


def error_message(body: dict[str, Any]) -> str:
    return body["error"]["message"]


# --- the answer ----------------------------------------------------------------------


async def test_answer_shape_byte_for_byte(eclient: TestClient) -> None:
    status, body, raw = await post(eclient, {"model": NAME, "input": QUESTION})
    assert status == 200
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["id"].startswith("embd-") and len(body["id"]) == len("embd-") + 32
    assert body["object"] == "list" and body["model"] == NAME
    assert isinstance(body["created"], int)
    [item] = body["data"]
    assert list(item) == ["index", "object", "embedding"]
    assert item["index"] == 0 and item["object"] == "embedding"
    assert len(item["embedding"]) == 256
    # 7 tokens + the <s> vLLM's tokenizer call adds.
    assert body["usage"] == {
        "prompt_tokens": 8,
        "total_tokens": 8,
        "completion_tokens": 0,
        "completion_tokens_details": None,
    }
    # Starlette's JSONResponse: compact separators, raw UTF-8, float32 values as doubles.
    assert raw == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    assert b'"usage":{"prompt_tokens":8,"total_tokens":8,"completion_tokens":0,' in raw
    assert all(float(np.float32(v)) == v for v in item["embedding"])


async def test_vectors_are_wordllamas(eclient: TestClient, reference: Any) -> None:
    texts = [QUESTION, "Quelle est la capitale de la France ?", "Wie spät ist es in Tokio?", "ok"]
    status, body, _ = await post(eclient, {"input": texts})
    assert status == 200
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    got = vectors(body)
    want = reference.embed(texts, norm=True)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # Paraphrases are closer than unrelated texts: a real model, not noise.
    assert got[0] @ got[1] > got[0] @ got[2]


async def test_special_tokens_counted_not_pooled(eclient: TestClient) -> None:
    _, with_bos, _ = await post(eclient, {"input": QUESTION})
    _, without, _ = await post(eclient, {"input": QUESTION, "add_special_tokens": False})
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    np.testing.assert_array_equal(vectors(with_bos), vectors(without))


async def test_base64_is_little_endian_float32(eclient: TestClient) -> None:
    _, floats, _ = await post(eclient, {"input": [QUESTION, "x"]})
    _, b64, _ = await post(eclient, {"input": [QUESTION, "x"], "encoding_format": "base64"})
    assert all(isinstance(d["embedding"], str) for d in b64["data"])
    assert len(base64.b64decode(b64["data"][0]["embedding"])) == 256 * 4
    np.testing.assert_array_equal(vectors(floats), vectors(b64))


async def test_token_id_inputs(eclient: TestClient) -> None:
    model = load_embedding_model("wordllama")
    ids = model.encode(QUESTION, add_special_tokens=False)
    _, text, _ = await post(eclient, {"input": QUESTION, "add_special_tokens": False})
    _, one, _ = await post(eclient, {"input": ids})
    _, many, _ = await post(eclient, {"input": [ids, ids[:3]]})
    np.testing.assert_array_equal(vectors(one), vectors(text))
    assert one["usage"]["prompt_tokens"] == len(ids)
    assert len(many["data"]) == 2 and many["usage"]["prompt_tokens"] == len(ids) + 3
    np.testing.assert_array_equal(vectors(many)[0], vectors(one)[0])


async def test_dimensions_are_matryoshka_prefixes(eclient: TestClient) -> None:
    _, raw_mean, _ = await post(eclient, {"input": QUESTION, "use_activation": False})
    full = vectors(raw_mean)[0]
    assert abs(float(np.linalg.norm(full)) - 1.0) > 0.01  # the unnormalised mean
    for d in (64, 128, 256):
        _, body, _ = await post(eclient, {"input": QUESTION, "dimensions": d})
        got = vectors(body)[0]
        assert got.shape == (d,)
        np.testing.assert_allclose(got, full[:d] / np.linalg.norm(full[:d]), atol=1e-6)
    status, body, _ = await post(eclient, {"input": QUESTION, "dimensions": 100})
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert error_message(body) == (
        'Model "wordllama-l2-supercat" only supports [64, 128, 256] matryoshka dimensions, '
        "use other output dimensions will lead to poor results."
    )


async def test_request_ids(eclient: TestClient) -> None:
    _, body, _ = await post(eclient, {"input": "x", "request_id": "mine"})
    assert body["id"] == "embd-mine"
    _, body, _ = await post(eclient, {"input": "x", "request_id": "mine"}, **{"X-Request-Id": "h"})
    assert body["id"] == "embd-h"


async def test_truncation(make_client: MakeClient) -> None:
    client = await make_client(embedding_model="wordllama", embedding_max_model_len=16)
    model = load_embedding_model("wordllama")
    ids = model.encode(QUESTION, add_special_tokens=True)  # <s> + 7
    # Text and token ids keep their first N tokens (the tokenizer's truncation side), their
    # last N with truncation_side "left".
    _, text, _ = await post(client, {"input": QUESTION, "truncate_prompt_tokens": 3})
    assert text["usage"]["prompt_tokens"] == 3
    _, first, _ = await post(client, {"input": ids[:3]})
    np.testing.assert_array_equal(vectors(text), vectors(first))
    _, head, _ = await post(client, {"input": ids, "truncate_prompt_tokens": 2})
    _, first_two, _ = await post(client, {"input": ids[:2]})
    np.testing.assert_array_equal(vectors(head), vectors(first_two))
    left = {"input": ids, "truncate_prompt_tokens": 2, "truncation_side": "left"}
    _, tail, _ = await post(client, left)
    _, last, _ = await post(client, {"input": ids[-2:]})
    np.testing.assert_array_equal(vectors(tail), vectors(last))
    _, none, _ = await post(client, {"input": QUESTION, "truncate_prompt_tokens": 0})
    assert none["data"] == [] and none["usage"]["prompt_tokens"] == 0
    status, _, _ = await post(client, {"input": QUESTION, "truncate_prompt_tokens": -1})
    assert status == 200
    status, body, _ = await post(client, {"input": QUESTION, "truncate_prompt_tokens": 17})
    assert status == 400 and error_message(body) == (
        "truncate_prompt_tokens=17 cannot be greater than max_model_len = 16. "
        "Please request a smaller truncation size."
    )
    long = " ".join(["word"] * 20)
    status, body, _ = await post(client, {"input": long})
    # Tokenized to at most max_model_len + 1 tokens: "at least" 17.
    assert status == 400 and error_message(body) == (
        "This model's maximum context length is 16 tokens. However, your prompt contains "
        "at least 17 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    )
    status, body, _ = await post(client, {"input": [5] * 17})
    assert status == 400 and error_message(body) == (
        "This model's maximum context length is 16 tokens. However, your prompt contains "
        "17 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    )
    status, _, _ = await post(client, {"input": [5] * 16})
    assert status == 200  # a pooling prompt may fill the whole context
    status, body, _ = await post(client, {"input": QUESTION, "normalize": True})
    assert status == 400 and error_message(body) == (
        "Parameter `normalize` was removed; use `use_activation` instead."
    )


# --- refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "", "add_special_tokens": False}, 400, "The decoder prompt cannot be empty"),
        ({"input": []}, 400, "please provide at least one prompt"),
        ({"input": [[]]}, 400, "please provide at least one prompt"),
        ({"input": [[5], []]}, 400, "The decoder prompt cannot be empty"),
        ({"input": [32000]}, 400, "Token id 32000 is out of vocabulary"),
        ({"model": "other", "input": "x"}, 404, "The model `other` does not exist."),
        ({"model": MODEL, "input": "x"}, 404, f"The model `{MODEL}` does not exist."),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            400,
            "As of transformers v4.44, default chat template is no longer allowed, so you must "
            "provide a chat template if the tokenizer does not define one.",
        ),
    ],
)
async def test_refusals(eclient: TestClient, body: Any, status: int, message: str) -> None:
    got_status, got, _ = await post(eclient, body)
    assert (got_status, error_message(got)) == (status, message)
    assert got["error"]["code"] == status
    assert got["error"]["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"input": 5},
        {"input": ["a", 1]},
        {"input": "x", "encoding_format": "binary"},
        {"input": "x", "dimensions": "many"},
        {"input": "x", "truncate_prompt_tokens": -2},
        {"input": "x", "use_activation": "yes please"},
    ],
)
async def test_validation_errors(eclient: TestClient, body: Any) -> None:
    status, got, _ = await post(eclient, body)
    assert status == 400 and got["error"]["type"] == "Bad Request"
    assert "EmbeddingCompletionRequest" in error_message(got)


async def test_empty_text_with_bos_is_the_zero_vector(eclient: TestClient) -> None:
    status, body, _ = await post(eclient, {"input": ""})
    assert status == 200 and body["usage"]["prompt_tokens"] == 1
    assert not np.any(vectors(body))


async def test_generation_server_refuses_after_validation(client: TestClient) -> None:
    # Without an embedding model the sim is a generation vLLM: the body is validated
    # first (FastAPI), then the route has no handler.
    status, body, _ = await post(client, {"model": MODEL, "input": "x"})
    assert (status, body["error"]["type"]) == (400, "BadRequestError")
    assert error_message(body) == "The model does not support Embeddings API"
    status, body, _ = await post(client, {"input": 5})
    assert (status, body["error"]["type"]) == (400, "Bad Request")


async def test_steering_and_auth(make_client: MakeClient) -> None:
    client = await make_client(embedding_model="wordllama", api_keys=("k",))
    resp = await client.post(EMBED, json={"input": "x"})
    assert resp.status == 401
    auth = {"Authorization": "Bearer k"}
    status, body, _ = await post(client, {"input": "x"}, **auth, **{"x-sim-error": "503"})
    assert status == 503 and "Simulated error" in error_message(body)
    status, _, _ = await post(client, {"input": "x"}, **auth)
    assert status == 200


async def test_models_stats_and_requests(eclient: TestClient) -> None:
    resp = await eclient.get("/v1/models")
    cards = (await resp.json())["data"]
    assert [c["id"] for c in cards] == [MODEL, NAME]
    assert cards[1]["max_model_len"] == 8192 and cards[1]["root"] == NAME
    await post(eclient, {"input": [QUESTION, "x"]})
    snap = await (await eclient.get("/sim/stats")).json()
    assert snap["embeddings"] == {
        "served_model_name": NAME,
        "max_model_len": 8192,
        "requests_total": 1,
        "inputs_total": 2,
        "prompt_tokens_total": 8 + 2,
    }
    # Not a generation: the engine saw nothing, the request log did.
    assert snap["requests_total"] == 0
    log = await (await eclient.get("/sim/requests")).json()
    assert log["total"] == 2 and log["generation_requests_total"] == 0  # /v1/models too
    assert log["requests"][-1]["path"] == EMBED
    await eclient.post("/sim/reset")
    snap = await (await eclient.get("/sim/stats")).json()
    assert snap["embeddings"]["requests_total"] == 0


async def test_openai_sdk_reads_it(eclient: TestClient, reference: Any) -> None:
    openai = pytest.importorskip("openai")
    url = str(eclient.make_url("/v1"))
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as oai:
        # The SDK asks for base64 unless told otherwise and decodes it itself.
        done = await oai.embeddings.create(model=NAME, input=[QUESTION, "hello"])
        assert done.model == NAME and done.usage.prompt_tokens == 8 + 2
        got = np.asarray([d.embedding for d in done.data], dtype=np.float32)
        np.testing.assert_allclose(got, reference.embed([QUESTION, "hello"], norm=True), atol=2e-6)
        small = await oai.embeddings.create(model=NAME, input=QUESTION, dimensions=64)
        assert len(small.data[0].embedding) == 64
        with pytest.raises(openai.BadRequestError):
            await oai.embeddings.create(model=NAME, input=QUESTION, dimensions=65)


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["--model-dir", "m", "--embedding-model", "wordllama", "--embedding-max-model-len", "512"]
    )
    config = config_from_args(args)
    assert config.embedding_model == "wordllama"
    assert config.embedding_served_model_name == NAME
    assert config.embedding_max_model_len == 512
    assert config_from_args(build_parser().parse_args(["--model-dir", "m"])).embedding_model is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-dir", "m", "--embedding-model", "bert"])
