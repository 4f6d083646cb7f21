"""Counting by the engine's own /tokenize (``counting: engine``).

The engine is the simulator, in process (the engine's stand-in, vLLM 0.34's /tokenize);
a hung engine is a listening socket that never answers, a down one a port nobody listens
on. Checked: the simulator's /tokenize answers as vLLM does; the counts are the engine's
own (its generation routes' usage); every call ends by its deadline with the model's
documented answer; tenants share an engine's slots fairly under the per-tenant bound; the
cache gives back only counts of the same request; and the config refuses a model nothing
can count.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvgate.config import ConfigError
from kvgate.config.model import parse_config
from kvgate.tokenize import PromptCounter, TokenizerBusy, TokenizerService
from kvgate.tokenize.engine_counting import (
    CACHE_ENTRY_BYTES,
    EngineCountCache,
    EngineCounter,
    EngineCountUnavailable,
    EngineEndpoint,
    load_model_counter,
)
from kvgate.tokenize.errors import PromptRenderError
from kvgate.tokenize.service import _EngineLane, _no_work
from testbed.demo_model import DEMO_MODEL_NAME
from vllm_sim import SimConfig, create_app
from vllm_sim.tokenization import SimTokenizer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, light rain"},
]


@pytest.fixture(scope="module")
def sim_tokenizer(model_dir: Path) -> SimTokenizer:
    return SimTokenizer(model_dir)


@pytest.fixture
async def engine(model_dir: Path, sim_tokenizer: SimTokenizer) -> AsyncIterator[TestClient]:
    config = SimConfig(model_dir=model_dir, served_model_name=DEMO_MODEL_NAME)
    client = TestClient(TestServer(create_app(config, tokenizer=sim_tokenizer)))
    await client.start_server()
    yield client
    await client.close()


@pytest.fixture
def hung_url() -> Iterator[str]:
    """An engine that takes connections and never answers (the kernel's backlog accepts)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/tokenize"


@pytest.fixture
def down_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/tokenize"


def _counter(url: str, **options: Any) -> EngineCounter:
    settings: dict[str, Any] = {
        "name": DEMO_MODEL_NAME,
        # Generous: a live engine on a loaded CI machine may take seconds; the deadline
        # tests set their own.
        "timeout_s": 10.0,
        "max_concurrency": 4,
        "reserve_upper_bound": False,
        "cache_max_bytes": 64 * 1024,
    }
    settings.update(options)
    return EngineCounter(EngineEndpoint(url), **settings)


@pytest.fixture
async def service() -> AsyncIterator[TokenizerService]:
    tokenizers = TokenizerService(max_workers=1, max_jobs_per_tenant=3)
    yield tokenizers
    tokenizers.close()
    await tokenizers.close_engines()


def _url(client: TestClient) -> str:
    return str(client.make_url("/tokenize"))


# -- the simulator's /tokenize is vLLM's ---------------------------------------------------


async def test_tokenize_answers_with_vllms_fields_in_its_order(engine: TestClient) -> None:
    resp = await engine.post("/tokenize", json={"prompt": "Hello world", "model": DEMO_MODEL_NAME})
    assert resp.status == 200
    raw = await resp.read()
    answer = json.loads(raw)
    assert list(answer) == ["count", "max_model_len", "tokens", "token_strs"]
    assert answer["count"] == len(answer["tokens"]) > 0
    assert answer["token_strs"] is None
    # Starlette's JSONResponse: no spaces, non-ASCII as is.
    expected = json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()
    assert raw == expected


async def test_tokenize_chat_is_the_chat_routes_prompt(
    engine: TestClient, sim_tokenizer: SimTokenizer
) -> None:
    body = {"model": DEMO_MODEL_NAME, "messages": CHAT, "tools": TOOLS}
    counted = await (await engine.post("/tokenize", json=body)).json()
    served = await engine.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    usage = (await served.json())["usage"]
    assert counted["count"] == usage["prompt_tokens"]
    assert counted["tokens"] == sim_tokenizer.encode_chat(CHAT, tools=TOOLS)


async def test_tokenize_token_strs_and_special_tokens(
    engine: TestClient, sim_tokenizer: SimTokenizer
) -> None:
    plain = await (
        await engine.post(
            "/tokenize",
            json={"prompt": "Hi there", "add_special_tokens": False, "return_token_strs": True},
        )
    ).json()
    assert plain["tokens"] == sim_tokenizer.encode("Hi there", add_special_tokens=False)
    assert len(plain["token_strs"]) == plain["count"]
    assert all(isinstance(s, str) for s in plain["token_strs"])


async def test_tokenize_refuses_what_vllm_refuses(engine: TestClient) -> None:
    neither = await engine.post("/tokenize", json={"model": DEMO_MODEL_NAME})
    assert neither.status == 400
    message = (await neither.json())["error"]["message"]
    # Both union members' errors, each under its class name.
    assert "'TokenizeCompletionRequest', 'prompt'" in message
    assert "'TokenizeChatRequest', 'messages'" in message

    both = await engine.post(
        "/tokenize",
        json={"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
    )
    assert both.status == 400
    assert "Cannot set both" in (await both.json())["error"]["message"]

    unknown = await engine.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert unknown.status == 404
    assert (await unknown.json())["error"]["message"] == "The model `other` does not exist."


# -- counting with the engine --------------------------------------------------------------


async def test_engine_counts_are_the_engines_usage(
    engine: TestClient, service: TokenizerService, counter: PromptCounter
) -> None:
    service.register(DEMO_MODEL_NAME, _counter(_url(engine)))
    assert service.engines() == {DEMO_MODEL_NAME: "engine-tokenize"}  # the info metric's
    with pytest.raises(KeyError):
        service.counter(DEMO_MODEL_NAME)  # no vocabulary: no length bound before counting
    chat = await service.count_chat(DEMO_MODEL_NAME, CHAT, TOOLS, tenant="a")
    served = await engine.post(
        "/v1/chat/completions",
        json={"model": DEMO_MODEL_NAME, "messages": CHAT, "tools": TOOLS, "max_tokens": 2},
    )
    assert chat == (await served.json())["usage"]["prompt_tokens"]
    # The demo model is one kvgate reproduces: both ways agree.
    assert chat == counter.count_chat(CHAT, TOOLS)

    continued = await service.count_chat(
        DEMO_MODEL_NAME,
        [*CHAT[:2], {"role": "assistant", "content": "It is"}],
        add_generation_prompt=False,
        continue_final_message=True,
        tenant="a",
    )
    assert continued == counter.count_chat(
        [*CHAT[:2], {"role": "assistant", "content": "It is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )

    prompt = "Once upon a time, in a land far away"
    assert await service.count_completion(DEMO_MODEL_NAME, prompt) == counter.count_completion(
        prompt
    )
    batch: Any = [prompt, [1, 2, 3], "and more"]  # texts and token ids mixed
    assert await service.count_completion(DEMO_MODEL_NAME, batch) == counter.count_completion(batch)
    output = "It is 18 degrees and raining."
    assert await service.count_text(DEMO_MODEL_NAME, output) == counter.count_text(output)


async def test_the_clients_key_order_reaches_the_engine(
    engine: TestClient, service: TokenizerService
) -> None:
    """Templates dump tools with tojson in the client's order: a reordered body would
    render (and count) another prompt, so the body keeps it and the cache keys on it."""
    counter = _counter(_url(engine), cache_chats=True)
    service.register(DEMO_MODEL_NAME, counter)
    reordered = [
        {
            "function": {
                "parameters": {
                    "required": ["city"],
                    "properties": {"city": {"type": "string"}},
                    "type": "object",
                },
                "description": "Weather at a place",
                "name": "get_weather",
            },
            "type": "function",
        }
    ]
    for tools in (TOOLS, reordered):
        counted = await service.count_chat(DEMO_MODEL_NAME, CHAT, tools)
        served = await engine.post(
            "/v1/chat/completions",
            json={"model": DEMO_MODEL_NAME, "messages": CHAT, "tools": tools, "max_tokens": 1},
        )
        assert counted == (await served.json())["usage"]["prompt_tokens"]
    assert counter.cache.hits == 0 and len(counter.cache) == 2


class _KwargsWithEffort(dict[str, Any]):
    """How the request parser hands over a request's reasoning_effort: on the kwargs."""

    def __init__(self, client: dict[str, Any], effort: str) -> None:
        super().__init__(client)
        self.reasoning_effort = effort


def test_generation_only_fields_are_sent_as_the_chat_route_renders_them() -> None:
    counter = _counter("http://e/tokenize")

    def body(kwargs: dict[str, Any] | None, response_format: Any = None) -> dict[str, Any]:
        call = counter.chat_call(
            CHAT,
            None,
            add_generation_prompt=True,
            continue_final_message=False,
            chat_template_kwargs=kwargs,
            add_special_tokens=False,
            response_format=response_format,
        )
        decoded: dict[str, Any] = json.loads(call.body)
        return decoded

    assert "chat_template_kwargs" not in body(None)
    assert body({"x": 1})["chat_template_kwargs"] == {"x": 1}
    assert body(_KwargsWithEffort({}, "none"))["chat_template_kwargs"] == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    # The effort wins over the client's own; the client's thinking switch over the effort's.
    sent = body(_KwargsWithEffort({"reasoning_effort": "low", "enable_thinking": False}, "high"))
    assert sent["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": False}
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert body(None, schema)["response_format"] == schema


async def test_an_engine_refusal_is_an_unrenderable_prompt(
    engine: TestClient, service: TokenizerService
) -> None:
    service.register(DEMO_MODEL_NAME, _counter(_url(engine)))
    with pytest.raises(PromptRenderError):
        await service.count_chat(
            DEMO_MODEL_NAME,
            [{"role": "user", "content": "x"}],
            add_generation_prompt=True,
            continue_final_message=True,
        )


async def test_a_hung_engine_is_unavailable_at_the_deadline(
    hung_url: str, service: TokenizerService
) -> None:
    service.register("hung", _counter(hung_url, name="hung", timeout_s=0.3))
    started = time.perf_counter()
    with pytest.raises(EngineCountUnavailable) as caught:
        await service.count_chat("hung", CHAT, tenant="a")
    # Never before the deadline; the message names the deadline that ended it.
    assert time.perf_counter() - started >= 0.29
    assert "no count within 0.3 s (the engine did not answer)" in str(caught.value)
    assert not caught.value.reserve_upper_bound
    assert caught.value.retry_after_s >= 1
    # Settlement's output count has the same bound (the billing rule then falls back to
    # one token per content event).
    with pytest.raises(EngineCountUnavailable):
        await service.count_text("hung", "some output")


async def test_a_waiting_count_keeps_the_same_deadline(
    hung_url: str, service: TokenizerService
) -> None:
    """With the engine's one slot taken, a count's wait for it is inside its deadline."""
    service.register("slow", _counter(hung_url, name="slow", timeout_s=0.8, max_concurrency=1))
    service.register("quick", _counter(hung_url, name="quick", timeout_s=0.2, max_concurrency=1))
    holder = asyncio.ensure_future(service.count_text("slow", "first", tenant="a", bounded=True))
    await asyncio.sleep(0.05)
    # Ended by its own 0.2 s deadline while it waited, not by the holder's 0.8 s one.
    with pytest.raises(EngineCountUnavailable, match=r"no count within 0\.2 s \(waiting for"):
        await service.count_text("quick", "second", tenant="b", bounded=True)
    assert not holder.done()
    with pytest.raises(EngineCountUnavailable, match="the engine did not answer"):
        await holder


async def test_a_down_engine_is_unavailable_at_once_and_may_admit_at_the_bound(
    down_url: str, service: TokenizerService
) -> None:
    service.register("down", _counter(down_url, name="down", reserve_upper_bound=True))
    with pytest.raises(EngineCountUnavailable) as caught:
        await service.count_completion("down", "hello", tenant="a")
    # Refused by the connection, not ended by the deadline.
    assert "no count within" not in str(caught.value)
    assert caught.value.reserve_upper_bound


async def test_a_tenant_over_its_bound_is_busy_and_others_still_count(
    hung_url: str, engine: TestClient, service: TokenizerService
) -> None:
    service.register("hung", _counter(hung_url, name="hung", timeout_s=0.5, max_concurrency=1))
    pending = [
        asyncio.ensure_future(service.count_text("hung", f"t{i}", tenant="a", bounded=True))
        for i in range(3)
    ]
    await asyncio.sleep(0.05)
    with pytest.raises(TokenizerBusy):
        await service.count_text("hung", "one more", tenant="a", bounded=True)
    # Another tenant is not refused: it queues for its fair share.
    other = asyncio.ensure_future(service.count_text("hung", "b", tenant="b", bounded=True))
    await asyncio.sleep(0.05)
    assert service._lanes[hung_url].pending("b") == (1, 1)
    for task in [*pending, other]:
        task.cancel()
    await asyncio.gather(*pending, other, return_exceptions=True)
    await asyncio.sleep(0)
    assert service._lanes[hung_url].pending("a") == (0, 0)


async def test_slots_go_to_tenants_in_fair_order() -> None:
    """One slot: tenant a queued five counts before b's one; b's is second, not sixth."""
    lane = _EngineLane(
        1,
        max_jobs_per_tenant=64,
        max_cost_per_tenant=1 << 30,
        large_job_cost=1 << 20,
        reserved_workers=0,
    )
    order: list[str] = []

    async def count(tenant: str) -> None:
        job = lane.submit(tenant, _no_work, 100, bounded=True)
        await job.future
        order.append(tenant)
        await asyncio.sleep(0.01)
        lane.finish(job, 0.01)

    tasks = [asyncio.ensure_future(count("a")) for _ in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.ensure_future(count("b")))
    await asyncio.gather(*tasks)
    assert order[:2] == ["a", "b"], order
    lane.close(wait=False)


async def test_cancelled_counts_give_their_slot_back(hung_url: str) -> None:
    lane = _EngineLane(
        1,
        max_jobs_per_tenant=64,
        max_cost_per_tenant=1 << 30,
        large_job_cost=1 << 20,
        reserved_workers=0,
    )
    first = lane.submit("a", _no_work, 1, bounded=True)
    second = lane.submit("b", _no_work, 1, bounded=True)
    await asyncio.sleep(0)
    assert first.future.done() and not second.future.done()
    lane.finish(first, 0.0)  # done with its slot: the next tenant gets it
    await asyncio.sleep(0)
    assert second.future.done()
    lane.finish(second, 0.0)
    assert lane.pending("a") == lane.pending("b") == (0, 0)
    lane.close(wait=False)


# -- the cache: the same request, the same count -------------------------------------------


async def test_cached_counts_are_those_of_the_same_request(
    engine: TestClient, service: TokenizerService
) -> None:
    counter = _counter(_url(engine), cache_chats=True)
    service.register(DEMO_MODEL_NAME, counter)
    texts = ["alpha beta", "alpha beta ", "Alpha beta", "<|im_start|>alpha", "ünïcødé 🙂"]
    fresh = [await service.count_completion(DEMO_MODEL_NAME, t) for t in texts]
    outputs = [await service.count_text(DEMO_MODEL_NAME, t) for t in texts]
    assert counter.cache.hits == 0
    assert [await service.count_completion(DEMO_MODEL_NAME, t) for t in texts] == fresh
    assert [await service.count_text(DEMO_MODEL_NAME, t) for t in texts] == outputs
    assert counter.cache.hits == 2 * len(texts)
    # The special-tokens flag is part of the request: BOS-adding prompts differ from output.
    assert len(counter.cache) == 2 * len(texts)

    variants: list[tuple[list[dict[str, Any]] | None, dict[str, Any] | None, bool]] = [
        (None, None, True),
        (TOOLS, None, True),
        (None, {"enable_thinking": False}, True),
        (None, None, False),
    ]
    messages = CHAT[:2]
    counts = []
    for tools, kwargs, generation in variants:
        counts.append(
            await service.count_chat(
                DEMO_MODEL_NAME,
                messages,
                tools,
                chat_template_kwargs=kwargs,
                add_generation_prompt=generation,
            )
        )
    hits = counter.cache.hits
    for (tools, kwargs, generation), count in zip(variants, counts, strict=True):
        again = await service.count_chat(
            DEMO_MODEL_NAME,
            messages,
            tools,
            chat_template_kwargs=kwargs,
            add_generation_prompt=generation,
        )
        assert again == count
    assert counter.cache.hits == hits + len(variants)
    assert counts[1] > counts[0]  # the tools are in the prompt: no entry was shared


async def test_chats_are_not_cached_unless_asked(
    engine: TestClient, service: TokenizerService
) -> None:
    counter = _counter(_url(engine))
    service.register(DEMO_MODEL_NAME, counter)
    for _ in range(2):
        await service.count_chat(DEMO_MODEL_NAME, CHAT, TOOLS)
    assert counter.cache.hits == 0 and len(counter.cache) == 0


def test_cache_is_bounded_in_bytes_and_ages_out() -> None:
    cache = EngineCountCache(10 * CACHE_ENTRY_BYTES, ttl_s=0.05)
    for i in range(25):
        cache.put(bytes([i]), i)
    assert len(cache) == 10
    assert cache.get(bytes([0])) is None and cache.get(bytes([24])) == 24
    time.sleep(0.06)
    assert cache.get(bytes([24])) is None


def test_counts_are_scoped_to_the_engine_and_the_generation() -> None:
    a = _counter("http://a:8000/tokenize")
    b = _counter("http://b:8000/tokenize")
    c = _counter("http://a:8000/tokenize", cache_generation="rev2")
    keys = {x.text_call("same", add_special_tokens=True).cache_key for x in (a, b, c)}
    assert len(keys) == 3


# -- configuration -------------------------------------------------------------------------


def _config(model: dict[str, Any], backend: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "tenants": [{"name": "t", "api_key_sha256": "0" * 64}],
        "models": [
            {
                "name": "m",
                "max_context": 4096,
                "default_max_new_tokens": 256,
                "backend": "b",
                **model,
            }
        ],
        "backends": [{"name": "b", "kv_budget_tokens": 48000, **(backend or {})}],
    }


def test_a_model_nothing_can_count_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("counting: local needs the model's tokenizer")):
        parse_config(_config({}))
    with pytest.raises(
        ConfigError, match=re.escape("engine_counting.tokenize_url: counting: engine")
    ):
        parse_config(_config({"counting": "engine"}))
    with pytest.raises(ConfigError, match=re.escape("must be below server.decision_timeout_s")):
        parse_config(
            _config(
                {
                    "counting": "engine",
                    "engine_counting": {"tokenize_url": "http://e/tokenize", "timeout_s": 2},
                }
            )
        )


def test_the_engine_url_comes_from_the_backend(tmp_path: Path) -> None:
    config = parse_config(
        _config(
            {"counting": "engine", "tokenizer": str(tmp_path / "absent")},
            {"discovery": {"metrics_url": "http://vllm:8000/metrics"}, "api_key": "sk-up"},
        )
    )
    counter = load_model_counter(config.models[0], config.backends[0], tmp_path)
    assert isinstance(counter, EngineCounter)  # the absent tokenizer is never read
    assert counter.endpoint.url == "http://vllm:8000/tokenize"
    assert counter.endpoint.api_key == "sk-up"
    pool = parse_config(
        _config(
            {"counting": "engine"},
            {"endpoint_discovery": {"dns_name": "vllm.ns.svc", "port": 8000}},
        )
    )
    counter = load_model_counter(pool.models[0], pool.backends[0], tmp_path)
    assert isinstance(counter, EngineCounter)
    assert counter.endpoint.url == "http://vllm.ns.svc:8000/tokenize"


def test_check_config_names_the_missing_engine(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(_config({"counting": "engine"})), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "models.0" in done.stderr + done.stdout
    assert "tokenize_url" in done.stderr + done.stdout


# -- admission: what a model does while its engine cannot count ----------------------------


async def _admission_with_engine(url: str, *, upper_bound: bool) -> AsyncIterator[Any]:
    from tests.lifecycle.conftest import MODEL, make_lifecycle

    async for life in make_lifecycle():
        # max_context 4096, default_max_new_tokens 100 (tests/lifecycle/conftest.py)
        life.tokenizers.register(
            MODEL, _counter(url, name=MODEL, timeout_s=0.2, reserve_upper_bound=upper_bound)
        )
        yield life
        await life.tokenizers.close_engines()


_admissions = itertools.count()


async def _admit(life: Any, path: str, **body: Any) -> Any:
    from kvgate.openai import parse_request
    from tests.lifecycle.conftest import MODEL

    request = parse_request(path, json.dumps({"model": MODEL, **body}).encode())
    policy = life.snapshots.current.tenants["acme"]
    rid = f"r{next(_admissions)}"
    return await life.admission().admit(request, policy, rid, f"{rid}/x")


async def test_an_engine_that_cannot_count_refuses_and_reserves_nothing(down_url: str) -> None:
    from kvgate.lifecycle import Rejected
    from kvgate.policy import Reason

    async for life in _admission_with_engine(down_url, upper_bound=False):
        with pytest.raises(Rejected) as refused:
            await _admit(life, "/v1/chat/completions", messages=CHAT[:2], max_tokens=10)
        rejection = refused.value.rejection
        assert rejection.reason is Reason.COUNTING_UNAVAILABLE
        assert rejection.retry_after_s == 1.0
        assert await life.in_flight() == (0, 0)


async def test_an_upper_bound_admission_takes_the_whole_context(down_url: str) -> None:
    from kvgate.lifecycle import Rejected
    from kvgate.policy import Reason

    async for life in _admission_with_engine(down_url, upper_bound=True):
        ticket = await _admit(life, "/v1/chat/completions", messages=CHAT[:2], max_tokens=10)
        assert (ticket.prompt_tokens, ticket.max_new_tokens) == (4096 - 10, 10)
        assert await life.in_flight() == (4096, 1)
        await life.store.abandon(ticket.reservation.request)

        # No cap asked for: the model's default completion, the rest for the prompt.
        ticket = await _admit(life, "/v1/chat/completions", messages=CHAT[:2], n=2)
        assert (ticket.prompt_tokens, ticket.max_new_tokens) == (4096 - 100, 100)
        assert ticket.reservation.kv_tokens >= 4096 - 100 + 2 * 100
        await life.store.abandon(ticket.reservation.request)

        # A batch: each of its prompts with its completion fits the context (2 x 4096: the
        # backend's whole budget).
        ticket = await _admit(life, "/v1/completions", prompt=["a", "b"], max_tokens=96)
        assert ticket.prompt_tokens == 2 * (4096 - 96)
        await life.store.abandon(ticket.reservation.request)

        with pytest.raises(Rejected) as too_long:
            await _admit(life, "/v1/chat/completions", messages=CHAT[:2], max_tokens=4096)
        assert too_long.value.rejection.reason is Reason.CONTEXT_LENGTH_EXCEEDED
        with pytest.raises(Rejected) as min_tokens:
            await _admit(
                life, "/v1/chat/completions", messages=CHAT[:2], max_tokens=5, min_tokens=6
            )
        assert min_tokens.value.rejection.reason is Reason.MIN_TOKENS_OVER_CAP
