"""The semantic cache end to end: client -> real Envoy -> kvgate (WordLlama, or the
simulator's /v1/embeddings) -> simulator.

Each test asks in its own context (a system prompt with a fresh id): contexts never meet, so
tests do not see each other's entries. Whether the backend worked is read from the
simulator's own request record.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from testbed.harness import (
    Stack,
    assert_free_cache_hit_booked,
    kvgate_metrics,
    sdk_stream_text,
    tenant_totals,
    wait_until,
)
from testbed.redis_harness import RedisStack
from tests.e2e import semantic

pytest.importorskip("wordllama")


QUESTION = "What is the capital of France?"
PARAPHRASE = "Hello! What is the capital of France, please?"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with semantic.stack() as running:
        yield running


def test_a_similar_question_is_answered_without_the_backend(stack: Stack) -> None:
    context = uuid.uuid4().hex
    first = semantic.answered(stack, semantic.body(QUESTION, context))
    arrived, before = semantic.arrived(stack), tenant_totals(stack, cache=True)
    hit = semantic.hit(stack, semantic.body(PARAPHRASE, context))
    assert hit.status_code == 200 and hit.content == first.content
    similarity = float(hit.headers["x-kvgate-cache-similarity"])
    assert 0 < similarity < 1
    assert semantic.arrived(stack) == arrived
    # hit_charge: free: no request booked; the ledger records the hit and what it saved.
    made = assert_free_cache_hit_booked(stack, before, first.json())
    metrics = kvgate_metrics(stack)
    assert metrics.total("kvgate_semantic_cache_total", result="semantic-hit") >= 1
    saved = metrics.total("kvgate_semantic_cache_saved_tokens_total", tenant="demo")
    assert saved >= made


@pytest.mark.parametrize(
    "near_miss",
    [
        "What is the capital of Germany?",
        "What is not the capital of France?",
        "What was the capital of France in 1500?",
    ],
)
def test_a_near_miss_reaches_the_backend(stack: Stack, near_miss: str) -> None:
    context = uuid.uuid4().hex
    semantic.answered(stack, semantic.body(QUESTION, context))
    semantic.hit(stack, semantic.body(PARAPHRASE, context))  # the entry is in place
    arrived = semantic.arrived(stack)
    answer = semantic.post(stack, semantic.body(near_miss, context))
    assert answer.status_code == 200
    assert answer.headers["x-kvgate-cache"] == "miss"
    assert semantic.arrived(stack) == arrived + 1


def test_the_same_words_in_another_order_are_not_the_same_question(stack: Stack) -> None:
    """A bag-of-tokens embedding sees these as identical (similarity 1.0); the guard not."""
    context = uuid.uuid4().hex
    semantic.answered(stack, semantic.body("Convert 5 km to miles", context))
    semantic.hit(stack, semantic.body("convert 5 km to miles!", context))
    arrived = semantic.arrived(stack)
    swapped = semantic.post(stack, semantic.body("Convert 5 miles to km", context))
    assert swapped.headers["x-kvgate-cache"] == "miss"
    assert semantic.arrived(stack) == arrived + 1
    assert kvgate_metrics(stack).total("kvgate_semantic_cache_guard_refusals_total") >= 1


def test_other_tenants_and_opted_out_tenants_never_get_the_answer(stack: Stack) -> None:
    context = uuid.uuid4().hex
    semantic.answered(stack, semantic.body(QUESTION, context))
    semantic.hit(stack, semantic.body(PARAPHRASE, context))
    arrived = semantic.arrived(stack)
    theirs = semantic.post(stack, semantic.body(PARAPHRASE, context), semantic.OTHER_KEY)
    assert theirs.headers["x-kvgate-cache"] == "miss"
    opted_out = semantic.post(stack, semantic.body(PARAPHRASE, context), semantic.OPTED_OUT_KEY)
    assert opted_out.headers["x-kvgate-cache"] == "bypass"
    assert semantic.arrived(stack) == arrived + 2


def test_only_the_last_turn_may_differ_in_a_conversation(stack: Stack) -> None:
    context = uuid.uuid4().hex

    def conversation(history_answer: str, question: str) -> dict[str, Any]:
        body = semantic.body("Tell me about France.", context)
        body["messages"] += [
            {"role": "assistant", "content": history_answer},
            {"role": "user", "content": question},
        ]
        return body

    semantic.answered(stack, conversation("France is in Europe.", "What is its capital?"))
    semantic.hit(stack, conversation("France is in Europe.", "what is its capital"))
    arrived = semantic.arrived(stack)
    other_history = semantic.post(
        stack, conversation("France is a republic.", "what is its capital")
    )
    assert other_history.headers["x-kvgate-cache"] == "miss"
    assert semantic.arrived(stack) == arrived + 1


def test_requests_with_tools_are_never_served_from_the_cache(stack: Stack) -> None:
    context = uuid.uuid4().hex
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    arrived = semantic.arrived(stack)
    answers = [
        semantic.post(stack, semantic.body(QUESTION, context, tools=tools)) for _ in range(2)
    ]
    assert [a.headers["x-kvgate-cache"] for a in answers] == ["bypass", "bypass"]
    assert semantic.arrived(stack) == arrived + 2


def test_a_semantic_hit_stream_parses_with_the_openai_sdk(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=semantic.DEMO_KEY)
    context = uuid.uuid4().hex

    def run(question: str) -> tuple[str, Any, str]:
        response = client.chat.completions.with_raw_response.create(
            **semantic.body(question, context, stream=True, stream_options={"include_usage": True})
        )
        text, usage = sdk_stream_text(response.parse())
        return text, usage, response.headers["x-kvgate-cache"]

    text, usage, result = run(QUESTION)
    assert result == "miss" and text and usage is not None
    arrived = semantic.arrived(stack)
    replay = wait_until(lambda: run(PARAPHRASE), lambda r: r[2] == "semantic-hit", timeout=5)
    assert replay[0] == text and replay[1] == usage
    assert semantic.arrived(stack) == arrived


def test_the_embedder_can_be_an_openai_compatible_endpoint() -> None:
    """kvgate asks the simulator's /v1/embeddings (WordLlama behind vLLM's API) for vectors;
    with the endpoint gone, requests run uncached and nothing fails."""
    stack = semantic.stack(threshold=0.8)
    embedder = {"kind": "openai", "model": "wordllama-l2-supercat", "timeout_s": 2.0}
    stack.kvgate_overrides["semantic_cache"]["embedder"] = {
        **embedder,
        "base_url": f"{stack.sim_url}/v1",
    }
    with stack:
        context = uuid.uuid4().hex
        semantic.answered(stack, semantic.body(QUESTION, context))
        arrived = semantic.arrived(stack)
        semantic.hit(stack, semantic.body(PARAPHRASE, context))
        assert semantic.arrived(stack) == arrived
        embeddings = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
        assert any(r["path"] == "/v1/embeddings" for r in embeddings["requests"])

    dead = semantic.stack(threshold=0.8)
    dead.kvgate_overrides["semantic_cache"]["embedder"] = {
        **embedder,
        "base_url": "http://127.0.0.1:9/v1",
    }
    with dead:
        answers = [semantic.post(dead, semantic.body(QUESTION, "dead")) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.headers["x-kvgate-cache"] for a in answers] == ["bypass", "bypass"]
        assert kvgate_metrics(dead).total("kvgate_semantic_cache_total", result="unavailable") == 2


def test_two_replicas_share_entries_through_redis() -> None:
    """The entry written by one replica is found by the other: each mirrors the context's
    Redis stream before it searches."""
    with RedisStack(
        tenants=semantic.tenants(),
        models=semantic.models(),
        redis_config={"timeout_s": 2.0},
        kvgate_overrides={"semantic_cache": {"enabled": True}},
    ) as stack:
        context = uuid.uuid4().hex
        first = semantic.answered(stack, semantic.body(QUESTION, context))
        arrived = semantic.arrived(stack)
        hits = []
        for _ in range(8):
            answer = semantic.hit(stack, semantic.body(PARAPHRASE, context))
            assert answer.content == first.content
            hits.append(answer)
        assert semantic.arrived(stack) == arrived
        per_replica = [
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            for port in (stack.kvgate_http_port, stack.kvgate_http_port2)
        ]
        # Envoy spreads the eight over both replicas: each answered some from the cache.
        for text in per_replica:
            assert 'kvgate_semantic_cache_total{result="semantic-hit"}' in text


def test_a_charged_semantic_hit_is_booked_like_the_request_it_replays() -> None:
    """hit_charge: full: the hit takes the stored answer's tokens from the tenant's limits and
    is booked in the ledger as a request, besides counting as a hit."""
    with semantic.stack(hit_charge="full") as stack:
        context = uuid.uuid4().hex
        first = semantic.answered(stack, semantic.body(QUESTION, context))
        usage = first.json()["usage"]
        before = wait_until(
            lambda: tenant_totals(stack, cache=True), lambda t: t["requests"] == 1, timeout=5
        )
        hit = semantic.hit(stack, semantic.body(PARAPHRASE, context))
        assert hit.content == first.content
        after = wait_until(
            lambda: tenant_totals(stack, cache=True), lambda t: t["cache_hits"] == 1, timeout=5
        )
        assert after["requests"] == before["requests"] + 1
        assert after["prompt_tokens"] == before["prompt_tokens"] + usage["prompt_tokens"]
        assert after["output_tokens"] == before["output_tokens"] + usage["completion_tokens"]


def test_a_new_cache_generation_puts_every_cached_answer_out_of_reach() -> None:
    """New weights behind the same model name: the operator changes the model's
    `cache_generation` and reloads; no answer cached before is served again, exact or
    semantic."""
    stack = semantic.stack()
    stack.kvgate_overrides["response_cache"] = {"enabled": True}
    with stack:
        context = uuid.uuid4().hex
        semantic.answered(stack, semantic.body(QUESTION, context))
        exact = wait_until(
            lambda: semantic.post(stack, semantic.body(QUESTION, context)),
            lambda r: r.headers.get("x-kvgate-cache") == "hit",
            timeout=5,
            interval=0.1,
        )
        assert exact.headers["x-kvgate-cache"] == "hit"
        semantic.hit(stack, semantic.body(PARAPHRASE, context))

        config = yaml.safe_load(stack.kvgate_config_path.read_text())
        config["models"][0]["cache_generation"] = "weights-2"
        stack.kvgate_config_path.write_text(yaml.safe_dump(config))
        assert stack.kvgate is not None and stack.kvgate.pid is not None
        os.kill(stack.kvgate.pid, signal.SIGHUP)
        wait_until(
            lambda: kvgate_metrics(stack).total("kvgate_config_reloads_total", result="success"),
            lambda n: n >= 1,
            timeout=10,
        )
        # The very request both caches answered before (an exact hit, and a semantic one at
        # similarity 1.0) now runs: neither reaches the old entries.
        arrived = semantic.arrived(stack)
        again = semantic.post(stack, semantic.body(QUESTION, context))
        assert again.headers["x-kvgate-cache"] == "miss"
        assert again.content != exact.content
        assert semantic.arrived(stack) == arrived + 1


def test_a_shared_entry_needs_both_tenants_opted_in_and_reveals_no_similarity() -> None:
    loner_key = "sk-semantic-loner"
    tenants = [
        {
            "name": "demo",
            "api_key": semantic.DEMO_KEY,
            "semantic_cache": True,
            "cache_sharing": True,
        },
        {
            "name": "other",
            "api_key": semantic.OTHER_KEY,
            "semantic_cache": True,
            "cache_sharing": True,
        },
        {"name": "loner", "api_key": loner_key, "semantic_cache": True},
    ]
    with Stack(
        tenants=tenants,
        models=semantic.models(),
        sim={"extra_args": ["--embedding-model", "wordllama"]},
        kvgate_overrides={"semantic_cache": {"enabled": True, "scope": "model"}},
    ) as stack:
        context = uuid.uuid4().hex
        first = semantic.answered(stack, semantic.body(QUESTION, context))
        hit = semantic.hit(stack, semantic.body(PARAPHRASE, context), semantic.OTHER_KEY)
        assert hit.content == first.content
        # Across tenants a hit reveals nothing but the answer: not how close the question
        # another tenant asked was.
        assert "x-kvgate-cache-similarity" not in hit.headers
        # A tenant that did not opt in to sharing neither gets nor gives shared answers.
        loner = semantic.post(stack, semantic.body(PARAPHRASE, context), loner_key)
        assert loner.headers["x-kvgate-cache"] == "miss"
