"""The semantic cache's embedders: WordLlama offline, and the OpenAI-compatible client
against the real simulator (a subprocess serving WordLlama on /v1/embeddings)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgate.cache.embeddings import (
    Embedder,
    EmbeddingBusy,
    EmbeddingDeadlineExceeded,
    EmbeddingError,
    EmbeddingInputError,
    EmbeddingUnavailable,
    OpenAIEmbeddingsClient,
    WordLlamaEmbedder,
    cosine,
    l2_normalise,
)
from kvgate.tokenize.service import THREAD_NAME_PREFIX
from testbed.harness import embedding_sim, free_port
from testbed.wordllama_reference import load_reference

REPO_ROOT = Path(__file__).resolve().parents[2]
SIM_MODEL = "wordllama-l2-supercat"
SIM_KEY = "sim-key"
TEXTS = [
    "What is the capital of France?",
    "Tell me the capital city of France.",
    "What is the capital of Germany?",
    "Wie spät ist es in Tokio?",
    "¿Cuál es la capital de Francia?",
]


@pytest.fixture(scope="module")
def wordllama() -> WordLlamaEmbedder:
    return WordLlamaEmbedder()


# --- WordLlama --------------------------------------------------------------------------


async def test_wordllama_matches_the_package(wordllama: WordLlamaEmbedder) -> None:
    reference = load_reference()
    got = await wordllama.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 256)
    np.testing.assert_allclose(got, reference.embed(TEXTS, norm=True), atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert isinstance(wordllama, Embedder)
    assert wordllama.dimensions == 256
    assert wordllama.name.startswith("wordllama:l2_supercat-256:")
    assert wordllama.version.startswith("0.4")


async def test_wordllama_is_a_real_model(wordllama: WordLlamaEmbedder) -> None:
    v = await wordllama.embed(TEXTS)
    paraphrase, other_entity, other_language = v[0] @ v[1], v[0] @ v[2], v[0] @ v[3]
    assert paraphrase > 0.8
    # Content words carry WordLlama's mass: one entity changed moves the vector a lot.
    assert other_entity < paraphrase - 0.2
    assert other_language < paraphrase - 0.2


async def test_wordllama_edges(wordllama: WordLlamaEmbedder) -> None:
    empty = await wordllama.embed([])
    assert empty.shape == (0, 256) and empty.dtype == np.float32
    # No meaningful token: the zero vector (similarity 0 with everything, never a hit).
    zero = await wordllama.embed(["", "<s></s>"])
    assert not np.any(zero)
    # Special tokens spelled out do not move the vector.
    a, b = await wordllama.embed(["hello world", "hello world</s>"])
    np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(TypeError):
        await wordllama.embed([b"bytes"])  # type: ignore[list-item]


async def test_wordllama_matryoshka_dimensions(wordllama: WordLlamaEmbedder) -> None:
    small = WordLlamaEmbedder(dimensions=64)
    assert small.dimensions == 64 and small.name.startswith("wordllama:l2_supercat-64:")
    full_mean = wordllama._table[  # the unnormalised direction, from the full table
        wordllama._tokenizer.encode(TEXTS[0], add_special_tokens=False).ids
    ].mean(axis=0)
    got = (await small.embed(TEXTS[:1]))[0]
    np.testing.assert_allclose(got, full_mean[:64] / np.linalg.norm(full_mean[:64]), atol=1e-6)
    with pytest.raises(ValueError):
        WordLlamaEmbedder(dimensions=100)


async def test_wordllama_refuses_long_texts() -> None:
    embedder = WordLlamaEmbedder(max_tokens=8)
    with pytest.raises(EmbeddingInputError, match="more than max_tokens=8"):
        await embedder.embed(["one two three four five six seven eight nine"])
    # Refused on its length alone, without tokenizing.
    with pytest.raises(EmbeddingInputError, match="characters"):
        await embedder.embed(["x" * (8 * 16 + 1)])
    assert issubclass(EmbeddingInputError, EmbeddingError)


async def test_wordllama_inline_or_on_its_thread() -> None:
    embedder = WordLlamaEmbedder(inline_max_chars=40)
    threads: list[str] = []
    original = embedder.embed_sync

    def spy(texts: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(texts)

    embedder.embed_sync = spy  # type: ignore[method-assign]
    short = await embedder.embed([TEXTS[0]])
    long = await embedder.embed(TEXTS)
    assert threads[0] == threading.current_thread().name
    # The tokenizer pool's fair scheduler runs it, on a thread of its own.
    assert threads[1].startswith(THREAD_NAME_PREFIX) and threads[1] != threads[0]
    np.testing.assert_array_equal(short[0], long[0])
    await embedder.close()


def test_wordllama_loads_offline_and_quietly() -> None:
    """No network (sockets refused), no ``wordllama``/``requests`` import, no root
    logging handler: the wheel's files are all it needs."""
    code = """
import logging, socket, sys

class NoNetwork(socket.socket):
    def connect(self, *a, **k):
        raise OSError("network blocked by the test")
    def connect_ex(self, *a, **k):
        raise OSError("network blocked by the test")
socket.socket = NoNetwork
socket.create_connection = lambda *a, **k: (_ for _ in ()).throw(OSError("blocked"))

import asyncio
from kvgate.cache.embeddings import WordLlamaEmbedder
e = WordLlamaEmbedder()
v = asyncio.run(e.embed(["offline please"]))
assert v.shape == (1, 256)
print(sorted(m for m in ("wordllama", "requests", "huggingface_hub") if m in sys.modules))
print(len(logging.getLogger().handlers))
"""
    env = {"HOME": "/nonexistent", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "0"]


def test_l2_normalise_and_cosine() -> None:
    rows = l2_normalise([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(rows, [[0.6, 0.8], [0.0, 0.0]])
    assert rows.dtype == np.float32
    assert cosine([1, 0], [1, 1]) == pytest.approx(2**-0.5)
    assert cosine([0, 0], [1, 1]) == 0.0


# --- the OpenAI-compatible client against the real simulator -------------------------------


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with embedding_sim(tmp_path_factory.mktemp("sim"), api_key=SIM_KEY) as url:
        yield url


@pytest.fixture
async def client(sim_url: str) -> AsyncIterator[OpenAIEmbeddingsClient]:
    c = OpenAIEmbeddingsClient(f"{sim_url}/v1", SIM_MODEL, dimensions=256, api_key=SIM_KEY)
    yield c
    await c.close()


async def _sim_stats(sim_url: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{sim_url}/sim/stats") as resp:
        return await resp.json()


@pytest.mark.parametrize("encoding_format", ["base64", "float"])
async def test_client_equals_local_wordllama(
    sim_url: str, wordllama: WordLlamaEmbedder, encoding_format: str
) -> None:
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1",
        SIM_MODEL,
        dimensions=256,
        api_key=SIM_KEY,
        encoding_format=encoding_format,
    )
    try:
        got = await client.embed(TEXTS)
    finally:
        await client.close()
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), 256)
    np.testing.assert_allclose(got, await wordllama.embed(TEXTS), atol=2e-6)
    assert isinstance(client, Embedder) and client.name == f"openai:{SIM_MODEL}:256"
    # usage.prompt_tokens: each text's tokens plus the <s> vLLM's tokenizer adds.
    assert client.prompt_tokens_total == sum(wordllama.count_tokens(t) + 1 for t in TEXTS)


async def test_client_asks_for_matryoshka_dimensions(sim_url: str) -> None:
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1", SIM_MODEL, dimensions=64, api_key=SIM_KEY, send_dimensions=True
    )
    try:
        got = await client.embed(TEXTS[:2])
    finally:
        await client.close()
    np.testing.assert_allclose(
        got, await WordLlamaEmbedder(dimensions=64).embed(TEXTS[:2]), atol=2e-6
    )


async def test_client_batches_in_order(sim_url: str) -> None:
    before = (await _sim_stats(sim_url))["embeddings"]["requests_total"]
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1", SIM_MODEL, dimensions=256, api_key=SIM_KEY, max_batch=2
    )
    try:
        got = await client.embed(TEXTS)
        assert (await client.embed([])).shape == (0, 256)  # no request at all
        whole = await client.embed(TEXTS[:2])
    finally:
        await client.close()
    assert (await _sim_stats(sim_url))["embeddings"]["requests_total"] == before + 3 + 1
    np.testing.assert_array_equal(got[:2], whole)


async def test_client_failures_are_embedding_errors(sim_url: str) -> None:
    cases: list[tuple[dict[str, Any], type[EmbeddingError], str]] = [
        ({"model": "nope"}, EmbeddingInputError, "HTTP 404: The model `nope` does not exist."),
        ({"api_key": "wrong"}, EmbeddingInputError, "HTTP 401: Unauthorized"),
        ({"dimensions": 128}, EmbeddingUnavailable, "128 dimensions|256 dimensions"),
        (
            {"dimensions": 100, "send_dimensions": True},
            EmbeddingInputError,
            "only supports \\[64, 128, 256\\] matryoshka dimensions",
        ),
        (
            {"extra_headers": {"x-sim-error": "503"}},
            EmbeddingUnavailable,
            "HTTP 503: Simulated error",
        ),
        (
            {"extra_headers": {"x-sim-error": "429"}},
            EmbeddingUnavailable,
            "HTTP 429",
        ),
    ]
    for overrides, error, pattern in cases:
        kwargs: dict[str, Any] = {"dimensions": 256, "api_key": SIM_KEY, **overrides}
        model = kwargs.pop("model", SIM_MODEL)
        client = OpenAIEmbeddingsClient(f"{sim_url}/v1", model, **kwargs)
        try:
            with pytest.raises(error, match=pattern):
                await client.embed(["hello"])
        finally:
            await client.close()


async def test_client_deadline(sim_url: str) -> None:
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1",
        SIM_MODEL,
        dimensions=256,
        api_key=SIM_KEY,
        timeout_s=0.2,
        extra_headers={"x-sim-ttft-ms": "2000"},
    )
    started = time.monotonic()
    try:
        with pytest.raises(EmbeddingUnavailable, match=r"no answer within 0\.2 s"):
            await client.embed(["slow"])
    finally:
        await client.close()
    assert time.monotonic() - started < 1.0


async def test_client_connection_refused() -> None:
    client = OpenAIEmbeddingsClient(f"http://127.0.0.1:{free_port()}/v1", "m", dimensions=4)
    try:
        with pytest.raises(EmbeddingUnavailable, match=r"ClientConnectorError|Connect"):
            await client.embed(["x"])
    finally:
        await client.close()


# --- malformed answers (a fake server) ------------------------------------------------------


def _b64(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


MALFORMED: list[tuple[str, Any]] = [
    ("not json", b"<html>"),
    ("no data", {"object": "list"}),
    ("too few rows", {"data": [{"index": 0, "embedding": _b64([1, 0, 0, 0])}]}),
    (
        "duplicate index",
        {"data": [{"index": 0, "embedding": _b64([1, 0, 0, 0])}] * 2},
    ),
    (
        "bad base64",
        {"data": [{"index": i, "embedding": "***"} for i in range(2)]},
    ),
    (
        "wrong width",
        {"data": [{"index": i, "embedding": _b64([1, 0, 0])} for i in range(2)]},
    ),
    (
        "non-finite",
        {"data": [{"index": i, "embedding": _b64([1, float("nan"), 0, 0])} for i in range(2)]},
    ),
    ("huge", b"[" + b"0," * 200_000 + b"0]"),
]


async def test_client_rejects_malformed_answers() -> None:
    answers: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.Response:
        body = answers["current"]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return web.Response(body=raw, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/embeddings", handler)
    async with TestServer(app) as server:
        client = OpenAIEmbeddingsClient(str(server.make_url("/v1")), "m", dimensions=4)
        try:
            for label, body in MALFORMED:
                answers["current"] = body
                with pytest.raises(EmbeddingUnavailable):
                    await client.embed(["a", "b"])
                    pytest.fail(label)
            # Rows come back in index order, renormalised, whatever the server sent.
            answers["current"] = {
                "data": [
                    {"index": 1, "embedding": [0, 2, 0, 0]},
                    {"index": 0, "embedding": _b64([3, 0, 4, 0])},
                ]
            }
            got = await client.embed(["a", "b"])
            np.testing.assert_allclose(got, [[0.6, 0, 0.8, 0], [0, 1, 0, 0]], atol=1e-7)
        finally:
            await client.close()


async def test_client_is_usable_concurrently(sim_url: str) -> None:
    client = OpenAIEmbeddingsClient(f"{sim_url}/v1", SIM_MODEL, dimensions=256, api_key=SIM_KEY)
    try:
        results = await asyncio.gather(*(client.embed([t]) for t in TEXTS))
    finally:
        await client.close()
    np.testing.assert_allclose(
        np.concatenate(results), await WordLlamaEmbedder().embed(TEXTS), atol=2e-6
    )


# --- fairness between tenants, and every embedding's deadline -----------------------------

_FLOOD_TEXT = " ".join(["the capital of France is Paris and the Seine flows through it"] * 130)


def _flood(texts: int = 64) -> list[str]:
    """A batch of long texts: about a tenth of a second of the worker's time."""
    return [f"{i} {_FLOOD_TEXT}" for i in range(texts)]


async def test_wordllama_serves_another_tenant_between_a_floods_batches() -> None:
    """Tenant A fills its queue with long batches; tenant B's question waits for at most the
    one batch already running (FIFO would put it behind all of them), and A's next batch is
    refused at once."""
    embedder = WordLlamaEmbedder(inline_max_chars=0, max_queued_per_tenant=4, deadline_s=60)
    question = "What is the capital of France? " * 10
    try:
        flood = [asyncio.create_task(embedder.embed(_flood(), tenant="a")) for _ in range(4)]
        await asyncio.sleep(0)  # every batch submitted
        with pytest.raises(EmbeddingBusy, match="tenant 'a' already has 4 embeddings"):
            await embedder.embed(_flood(), tenant="a")
        # Refused without waiting: none of the queued batches has finished yet.
        assert not any(task.done() for task in flood)
        assert embedder.refused == {"tenant_queue_full": 1}
        served = await embedder.embed([question], tenant="b")
        still_queued = sum(not task.done() for task in flood)
        assert still_queued >= 2, "B waited behind A's backlog"
        np.testing.assert_array_equal(served, embedder.embed_sync([question]))
        for vectors in await asyncio.gather(*flood):
            assert vectors.shape == (64, 256)
        # A's queue drained: A is served again.
        assert (await embedder.embed(_flood(2), tenant="a")).shape == (2, 256)
    finally:
        await embedder.close()


async def test_wordllama_deadline_gives_up_and_the_work_never_runs() -> None:
    embedder = WordLlamaEmbedder(inline_max_chars=0, max_queued_per_tenant=16, deadline_s=0.1)
    ran: list[int] = []
    original = embedder.embed_sync

    def counted(texts: Any) -> Any:
        ran.append(len(texts))
        if len(texts) > 1:
            time.sleep(0.25)  # a flood batch outlasts the deadline, however fast the host
        return original(texts)

    embedder.embed_sync = counted  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        results = await asyncio.gather(
            *(embedder.embed(_flood(), tenant="a") for _ in range(8)), return_exceptions=True
        )
        elapsed = time.monotonic() - started
        assert all(isinstance(r, EmbeddingDeadlineExceeded) for r in results), results
        assert all(isinstance(r, EmbeddingUnavailable) for r in results)  # "unavailable"
        # Eight batches are two seconds of work; the callers gave up after 0.1 s.
        assert elapsed < 1.5, elapsed
        assert embedder.refused == {"deadline": 8}
        await asyncio.sleep(0.6)  # whatever was running has finished by now
        assert len(ran) <= 2, "batches past their deadline still ran"
        # The worker is free again: a new question is served.
        assert (await embedder.embed(["What is the capital of France?"])).shape == (1, 256)
    finally:
        await embedder.close()


async def test_client_bounds_what_one_tenant_has_in_flight(sim_url: str) -> None:
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1",
        SIM_MODEL,
        dimensions=256,
        api_key=SIM_KEY,
        timeout_s=5,
        max_queued_per_tenant=2,
        extra_headers={"x-sim-ttft-ms": "300"},
    )
    try:
        flood = [asyncio.create_task(client.embed(["slow"], tenant="a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(EmbeddingBusy, match="tenant 'a' already has 2"):
            await client.embed(["one more"], tenant="a")
        assert not any(task.done() for task in flood)  # refused without waiting
        assert (await client.embed(["b's question"], tenant="b")).shape == (1, 256)
        assert all(v.shape == (1, 256) for v in await asyncio.gather(*flood))
        assert client.refused == {"tenant_queue_full": 1}
        assert (await client.embed(["a again"], tenant="a")).shape == (1, 256)
    finally:
        await client.close()


async def test_client_deadline_covers_every_batch_of_a_call(sim_url: str) -> None:
    """Four requests of one text, 250 ms each: each alone is within the 0.4 s deadline, the
    call is not."""
    client = OpenAIEmbeddingsClient(
        f"{sim_url}/v1",
        SIM_MODEL,
        dimensions=256,
        api_key=SIM_KEY,
        timeout_s=0.4,
        max_batch=1,
        extra_headers={"x-sim-ttft-ms": "250"},
    )
    started = time.monotonic()
    try:
        with pytest.raises(EmbeddingDeadlineExceeded, match=r"no answer within 0\.4 s"):
            await client.embed(TEXTS[:4])
        assert time.monotonic() - started < 0.8
        assert client.refused == {"deadline": 1}
    finally:
        await client.close()
