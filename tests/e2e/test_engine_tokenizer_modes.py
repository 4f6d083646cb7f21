"""Models vLLM serves outside its Hugging Face path, through the real Envoy.

A Mistral-format directory (tekken.json + params.json, no tokenizer.json) is served by the
simulator in vLLM's mistral tokenizer mode (transformers' MistralCommonBackend) and counted
by kvgate with mistral_common; a gpt-oss directory is served and counted through harmony.
Literal special-token text is plain text to the engine: a flood of it must be reserved at
the engine's count (many tokens per literal, never one), so a burst of such prompts is
admitted only as far as the KV cache holds, and the engine never preempts.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvgate.tokenize import load_counter
from kvgate.tokenize.counter import CountingApi
from testbed.engine_models import (
    deepseek_v32_model_dir,
    gpt_oss_model_dir,
    mistral_tekken_model_dir,
)
from testbed.harness import (
    DEFAULT_BACKEND,
    SimOptions,
    Stack,
    sim_reset,
    sim_stats,
    tenant_totals,
    wait_until,
)

MODEL = "mistral-tekken-demo"
CHAT = "/v1/chat/completions"
KV_BUDGET = 48_000
KV_BLOCK = 16
FLOODS = {
    "endoftext": "<|endoftext|>" * 2000,  # 26,000 characters
    "inst": "[INST]" * 2000,
    "mixed": "[/INST]</s><s>[TOOL_CALLS]<|im_start|>" * 400,
}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    models = [
        {
            "name": MODEL,
            "tokenizer": str(mistral_tekken_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 1024,
            "backend": DEFAULT_BACKEND,
        }
    ]
    with Stack(models=models, sim=SimOptions(num_gpu_blocks=KV_BUDGET // KV_BLOCK)) as running:
        yield running


@pytest.fixture(scope="module")
def counter() -> CountingApi:
    return load_counter(mistral_tekken_model_dir(), name=MODEL)


def _post(stack: Stack, path: str, body: Mapping[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=60.0, headers=stack.auth_headers()) as client:
        return client.post(stack.base_url + path, json=dict(body))


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_special_token_flood_is_reserved_at_the_engines_count(
    stack: Stack, counter: CountingApi, flood: str
) -> None:
    messages = [{"role": "user", "content": FLOODS[flood]}]
    resp = _post(stack, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 8})
    assert resp.status_code == 200, resp.text
    engine = resp.json()["usage"]["prompt_tokens"]
    rid = resp.headers["x-request-id"]
    entry = stack.wait_access_log(lambda e: e["request_id"] == rid)
    assert entry["prompt_tokens"] == engine == counter.count_chat(messages)
    assert entry["reserved_tokens"] == math.ceil((engine + 8) / KV_BLOCK) * KV_BLOCK
    assert engine > len(FLOODS[flood]) // 4  # the literals are text: several tokens each


def test_mistral_chat_with_tools_and_completions_match_the_engine(
    stack: Stack, counter: CountingApi
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look [INST] up",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are <|im_start|> terse."},
        {"role": "user", "content": "find [TOOL_CALLS]"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": "</s>"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "[/INST] found"},
        {"role": "user", "content": [{"type": "text", "text": "thanks <s>"}]},
    ]
    bodies = [
        (CHAT, {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 8}),
        ("/v1/completions", {"model": MODEL, "prompt": "<|endoftext|>" * 500, "max_tokens": 8}),
    ]
    expected = [
        counter.count_chat(messages, tools),
        counter.count_completion("<|endoftext|>" * 500),
    ]
    for (path, body), count in zip(bodies, expected, strict=True):
        resp = _post(stack, path, body)
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-request-id"]
        entry = stack.wait_access_log(lambda e, rid=rid: e["request_id"] == rid)
        assert entry["prompt_tokens"] == resp.json()["usage"]["prompt_tokens"] == count


BURST = 5
BURST_OUTPUT = 1500
BURST_HEADERS = {
    "x-sim-output-tokens": str(BURST_OUTPUT),
    "x-sim-itl-ms": "1",
    # A long prefill, so that every admitted prompt is in the cache before any grows.
    "x-sim-ttft-ms": "500",
}


def _stream(stack: Stack, body: Mapping[str, Any], start: threading.Barrier) -> int:
    with httpx.Client(timeout=120.0) as client:
        start.wait(timeout=30)
        with client.stream(
            "POST",
            stack.base_url + CHAT,
            json=dict(body),
            headers={**stack.auth_headers(), **BURST_HEADERS},
        ) as resp:
            resp.read()
            return resp.status_code


def test_a_burst_of_floods_never_makes_the_engine_preempt(
    stack: Stack, counter: CountingApi
) -> None:
    """Five 12k-token floods with 1.5k tokens of output each need 68k tokens of KV on a
    48k cache: kvgate admits the three that fit (at the engine's count), refuses the rest
    429, and the engine never preempts. Counted as one token per literal (2k tokens each)
    all five would be admitted and the engine would preempt."""
    messages = [{"role": "user", "content": FLOODS["endoftext"]}]
    prompt = counter.count_chat(messages)
    reserve = math.ceil((prompt + BURST_OUTPUT) / KV_BLOCK) * KV_BLOCK
    fit = KV_BUDGET // reserve
    assert 0 < fit < BURST and BURST * (prompt + BURST_OUTPUT) > KV_BUDGET
    sim_reset(stack)
    body = {"model": MODEL, "messages": messages, "max_tokens": BURST_OUTPUT, "stream": True}
    start = threading.Barrier(BURST)
    with ThreadPoolExecutor(max_workers=BURST) as pool:
        statuses = list(pool.map(lambda _: _stream(stack, body, start), range(BURST)))
    assert sorted(statuses) == [200] * fit + [429] * (BURST - fit), statuses
    stats = sim_stats(stack)
    assert stats["preemptions"] == 0, stats
    assert stats["peak_kv_tokens_used"] <= KV_BUDGET, stats
    assert stats["peak_running"] == fit, stats
    assert all(s["prompt_tokens"] == prompt for s in stats["served"]), stats["served"]


def test_a_cut_stream_is_charged_the_output_counted_in_the_engines_tokens(
    stack: Stack, counter: CountingApi
) -> None:
    """The engine sends 7 tokens and hangs; the client reads them and leaves. kvgate counts
    the streamed text with mistral_common (plain text, no BOS): 7 tokens, as the engine."""
    messages = [{"role": "user", "content": "[INST] tell a story </s>"}]
    before = tenant_totals(stack)
    received = 0
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream(
            "POST",
            stack.base_url + CHAT,
            json={"model": MODEL, "messages": messages, "max_tokens": 100, "stream": True},
            headers={
                **stack.auth_headers(),
                "x-sim-output-tokens": "100",
                "x-sim-stall-after": "7",
            },
        ) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    received += 1
            if received == 7:
                break
    expected = {"requests": 1, "prompt_tokens": counter.count_chat(messages), "output_tokens": 7}

    def charged() -> dict[str, int]:
        now = tenant_totals(stack)
        return {key: now[key] - before[key] for key in before}

    assert wait_until(charged, lambda delta: delta == expected, timeout=10.0) == expected


GPT_OSS = "gpt-oss-demo"


@pytest.fixture(scope="module")
def gpt_oss_stack() -> Iterator[Stack]:
    models = [
        {
            "name": GPT_OSS,
            "tokenizer": str(gpt_oss_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 1024,
            "backend": DEFAULT_BACKEND,
        }
    ]
    with Stack(models=models, sim=SimOptions(num_gpu_blocks=KV_BUDGET // KV_BLOCK)) as running:
        yield running


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_gpt_oss_flood_is_reserved_at_the_engines_count(gpt_oss_stack: Stack, flood: str) -> None:
    counter = load_counter(gpt_oss_model_dir(), name=GPT_OSS)
    messages = [
        {"role": "system", "content": "Answer <|start|> briefly."},
        {"role": "user", "content": FLOODS[flood]},
    ]
    body = {"model": GPT_OSS, "messages": messages, "max_tokens": 8}
    resp = _post(gpt_oss_stack, CHAT, body)
    assert resp.status_code == 200, resp.text
    engine = resp.json()["usage"]["prompt_tokens"]
    rid = resp.headers["x-request-id"]
    entry = gpt_oss_stack.wait_access_log(lambda e: e["request_id"] == rid)
    assert entry["prompt_tokens"] == engine == counter.count_chat(messages)
    assert engine > len(FLOODS[flood]) // 4


DEEPSEEK_V32 = "deepseek-v32-demo"


@pytest.fixture(scope="module")
def deepseek_stack() -> Iterator[Stack]:
    models = [
        {
            "name": DEEPSEEK_V32,
            "tokenizer": str(deepseek_v32_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 1024,
            "backend": DEFAULT_BACKEND,
        }
    ]
    with Stack(models=models, sim=SimOptions(num_gpu_blocks=KV_BUDGET // KV_BLOCK)) as running:
        yield running


@pytest.mark.parametrize("thinking", [False, True])
def test_deepseek_v32_chat_with_tools_is_reserved_at_the_engines_count(
    deepseek_stack: Stack, thinking: bool
) -> None:
    """A DeepseekV32ForCausalLM directory: both sides build the prompt with DeepSeek's
    encoder (tools in a leading system message, the call in DSML, reasoning shown only
    while thinking), and DeepSeek's own control tokens typed by the user are one token each."""
    counter = load_counter(deepseek_v32_model_dir(), name=DEEPSEEK_V32)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look <｜User｜> up",  # noqa: RUF001
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are <|im_start|> terse."},
        {"role": "user", "content": "find <｜Assistant｜>" * 50},  # noqa: RUF001
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "use the tool </think>",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": "<think>"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "[/INST] found"},
    ]
    kwargs = {"thinking": thinking}
    body = {
        "model": DEEPSEEK_V32,
        "messages": messages,
        "tools": tools,
        "chat_template_kwargs": kwargs,
        "max_tokens": 8,
    }
    resp = _post(deepseek_stack, CHAT, body)
    assert resp.status_code == 200, resp.text
    engine = resp.json()["usage"]["prompt_tokens"]
    rid = resp.headers["x-request-id"]
    entry = deepseek_stack.wait_access_log(lambda e: e["request_id"] == rid)
    assert (
        entry["prompt_tokens"]
        == engine
        == counter.count_chat(messages, tools, chat_template_kwargs=kwargs)
    )
    assert entry["reserved_tokens"] == math.ceil((engine + 8) / KV_BLOCK) * KV_BLOCK
    # The tools preamble alone is hundreds of tokens; the typed control tokens one each.
    assert engine > 400
