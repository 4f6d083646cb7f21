"""The semantic cache's rules (which requests may reuse an answer, what a context is) and its
lookup over the real WordLlama embedder, the memory answer store and the memory index."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvgate.cache.answers import MemoryAnswerStore, RedisAnswerStore, StoredAnswer
from kvgate.cache.semantic import MemoryEntryLog, RedisEntryLog
from kvgate.cache.semantic_guard import GuardLevel
from kvgate.config.model import SemanticCacheConfig
from kvgate.lifecycle.semantic_cache import (
    DEFAULT_THRESHOLDS,
    SemanticCache,
    SemanticResult,
    build_semantic_cache,
    lookup,
    semantic_query,
)
from kvgate.openai import CHAT_PATH, COMPLETIONS_PATH, ParsedRequest, parse_request
from kvgate.openai.completeness import answer_defect
from kvgate.policy import ActualUsage, SettleCause

pytest.importorskip("wordllama")

RESULTS = Path(__file__).parents[2] / "bench" / "results" / "caches" / "semantic_threshold.json"
SETTINGS = SemanticCacheConfig(enabled=True)
# The requests here are chat/completions': their API's completeness rule.
JUDGE = answer_defect
# A whole chat completion: only complete answers are kept.
PARIS = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris"},
                "finish_reason": "stop",
            }
        ],
    }
).encode()


def chat(question: Any, *, system: str = "Be brief.", **extra: Any) -> ParsedRequest:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }
    return parse_request(CHAT_PATH, json.dumps(body).encode())


def test_the_defaults_are_the_measured_thresholds() -> None:
    measured = json.loads(RESULTS.read_text())["evaluation"]["levels"]
    for level, threshold in DEFAULT_THRESHOLDS.items():
        assert measured[level.value]["default"]["threshold"] == pytest.approx(threshold)
    # No guard: nothing was found safe; numbers: safe by a margin of 0.002 only. Neither has
    # a default to fall back on.
    assert set(DEFAULT_THRESHOLDS) == {GuardLevel.STRICT}
    for guard in ("off", "numbers"):
        with pytest.raises(ValueError, match="threshold is required"):
            SemanticCacheConfig(enabled=True, guard=guard)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold is required"):
        SemanticCacheConfig(
            enabled=True, embedder={"kind": "openai", "base_url": "http://e/v1", "model": "m"}
        )  # type: ignore[arg-type]


def test_only_the_last_user_turn_may_differ() -> None:
    base = semantic_query(chat("What is the capital of France?"), "t", SETTINGS)
    assert base is not None and base.question == "What is the capital of France?"
    similar = semantic_query(chat("Which city is France's capital?"), "t", SETTINGS)
    assert similar is not None and similar.context == base.context
    for other in (
        chat("What is the capital of France?", system="Answer in German."),
        chat("What is the capital of France?", max_tokens=17),
        chat("What is the capital of France?", stream=True),
    ):
        query = semantic_query(other, "t", SETTINGS)
        assert query is not None and query.context != base.context


def test_contexts_are_per_scope() -> None:
    request = chat("What is the capital of France?")
    a, b = "tenant\x00a", "tenant\x00b"
    assert semantic_query(request, a, SETTINGS) != semantic_query(request, b, SETTINGS)
    assert semantic_query(request, "shared", SETTINGS) == semantic_query(
        request, "shared", SETTINGS
    )


@pytest.mark.parametrize(
    "request_",
    [
        chat("Weather in Paris?", tools=[{"type": "function", "function": {"name": "w"}}]),
        chat("What does this show?", temperature=0.7),
        chat("Hi", echo=True),
        chat("x" * 2001),
        chat("   "),
    ],
    ids=["tools", "sampled", "echo", "too-long", "blank"],
)
def test_requests_that_could_reuse_a_wrong_answer_are_not_looked_up(
    request_: ParsedRequest,
) -> None:
    assert semantic_query(request_, "t", SETTINGS) is None


def test_tool_calls_in_the_history_and_a_last_turn_not_from_the_user_are_not_looked_up() -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    body = {"model": "m", "messages": history, "temperature": 0}
    request = parse_request(CHAT_PATH, json.dumps(body).encode())
    assert semantic_query(request, "t", SETTINGS) is None
    allowed = SemanticCacheConfig(enabled=True, allow_tools=True)
    assert semantic_query(request, "t", allowed) is not None
    body = {"model": "m", "messages": [{"role": "assistant", "content": "Hi"}], "temperature": 0}
    request = parse_request(CHAT_PATH, json.dumps(body).encode())
    assert semantic_query(request, "t", SETTINGS) is None


def test_sampled_requests_are_the_operators_choice() -> None:
    request = chat("What is the capital of France?", temperature=0.7)
    assert semantic_query(request, "t", SemanticCacheConfig(enabled=True, sampled=True))


def test_completions_use_a_string_prompt_only() -> None:
    def completion(prompt: Any) -> ParsedRequest:
        body = {"model": "m", "prompt": prompt, "temperature": 0, "max_tokens": 4}
        return parse_request(COMPLETIONS_PATH, json.dumps(body).encode())

    query = semantic_query(completion("Q: capital of France?\nA:"), "t", SETTINGS)
    assert query is not None and query.question == "Q: capital of France?\nA:"
    assert semantic_query(completion(["a", "b"]), "t", SETTINGS) is None
    assert semantic_query(completion([1, 2, 3]), "t", SETTINGS) is None


@pytest.fixture
async def cache() -> Any:
    built = build_semantic_cache(
        SETTINGS, MemoryAnswerStore(1 << 20), MemoryEntryLog(max_bytes=1 << 20)
    )
    yield built
    await built.close()


class Tasks:
    def __init__(self) -> None:
        self.pending: list[Coroutine[Any, Any, None]] = []

    def track(self, coro: Coroutine[Any, Any, None]) -> None:
        self.pending.append(coro)

    async def run(self) -> None:
        while self.pending:
            await self.pending.pop(0)


async def _answer(cache: SemanticCache, question: str, tasks: Tasks, body: bytes) -> None:
    query = semantic_query(chat(question), "t", SETTINGS)
    assert query is not None
    found = await lookup(
        cache, SETTINGS, query, owner="o1", lock_ttl_s=5, track=tasks.track, judge=JUDGE
    )
    assert found.result is SemanticResult.MISS and found.recorder is not None
    found.recorder.on_headers(200, "application/json")
    found.recorder.on_chunk(body)
    found.recorder.finish(SettleCause.COMPLETED, ActualUsage(20, 5))
    await tasks.run()


async def test_a_surface_paraphrase_hits_and_a_near_miss_does_not(cache: SemanticCache) -> None:
    tasks = Tasks()
    await _answer(cache, "What is the capital of France?", tasks, PARIS)

    async def ask(question: str) -> Any:
        query = semantic_query(chat(question), "t", SETTINGS)
        assert query is not None
        return await lookup(
            cache, SETTINGS, query, owner="o2", lock_ttl_s=5, track=tasks.track, judge=JUDGE
        )

    hit = await ask("Hello! What is the capital of France, please?")
    assert hit.result is SemanticResult.HIT
    assert hit.answer == StoredAnswer(200, "application/json", PARIS, 20, 5)
    assert DEFAULT_THRESHOLDS[GuardLevel.STRICT] <= hit.similarity < 1.0
    for near_miss in ("What is the capital of Germany?", "What is not the capital of France?"):
        missed = await ask(near_miss)
        assert missed.result is SemanticResult.MISS, near_miss
        assert missed.recorder is not None
        missed.recorder.abandon()
    await tasks.run()


async def test_a_cut_answer_is_neither_stored_nor_indexed(cache: SemanticCache) -> None:
    tasks = Tasks()
    query = semantic_query(chat("How tall is Mont Blanc?"), "t", SETTINGS)
    assert query is not None
    found = await lookup(
        cache, SETTINGS, query, owner="o", lock_ttl_s=5, track=tasks.track, judge=JUDGE
    )
    assert found.recorder is not None
    found.recorder.on_headers(200, "text/event-stream")
    found.recorder.on_chunk(b"data: {}\n\n")
    found.recorder.finish(SettleCause.DISCONNECTED)
    await tasks.run()
    again = await lookup(
        cache, SETTINGS, query, owner="o", lock_ttl_s=5, track=tasks.track, judge=JUDGE
    )
    assert again.result is SemanticResult.MISS
    assert cache.index.mirrored_entries == 0


async def test_an_entry_whose_answer_is_gone_is_a_miss_and_forgotten(cache: SemanticCache) -> None:
    tasks = Tasks()
    await _answer(cache, "How tall is Mont Blanc?", tasks, PARIS)
    await cache.answers.close()  # the memory store drops every answer (as eviction would)
    query = semantic_query(chat("How tall is Mont Blanc?"), "t", SETTINGS)
    assert query is not None
    found = await lookup(
        cache, SETTINGS, query, owner="o", lock_ttl_s=5, track=tasks.track, judge=JUDGE
    )
    assert found.result is SemanticResult.MISS
    assert cache.index.mirrored_entries == 0


async def test_a_store_that_is_down_means_the_request_runs_uncached() -> None:
    """Redis unreachable: the lookup says UNAVAILABLE (the request runs as usual), it never
    raises into the request."""
    client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    cache = build_semantic_cache(
        SETTINGS,
        RedisAnswerStore(client, "{down}", timeout_s=0.5),
        RedisEntryLog(client, "{down}", timeout_s=0.5),
    )
    try:
        query = semantic_query(chat("What is the capital of France?"), "t", SETTINGS)
        assert query is not None
        tasks = Tasks()
        found = await lookup(
            cache, SETTINGS, query, owner="o", lock_ttl_s=5, track=tasks.track, judge=JUDGE
        )
        assert found.result is SemanticResult.UNAVAILABLE and found.recorder is None
    finally:
        await cache.close()
        await client.aclose()


def test_a_new_cache_generation_is_a_new_context() -> None:
    request = chat("What is the capital of France?")
    first = semantic_query(request, "t", SETTINGS, "weights-1")
    second = semantic_query(request, "t", SETTINGS, "weights-2")
    assert first is not None and second is not None and first.context != second.context
