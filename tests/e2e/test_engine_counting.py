"""Counting by the engine (``counting: engine``) through the real Envoy.

The model's kvgate-side tokenizer directory does not exist: every count is the engine's
own (the simulator's /tokenize, found from the backend's discovery.metrics_url), and it
equals what the engine then reports as ``usage.prompt_tokens``, for chats with tools and
for completions. An engine that hangs or is down gets kvgate's documented refusal (503 +
Retry-After in OpenAI's shape, never Envoy's 504) with nothing reserved; after a reload
to ``on_unavailable: reserve_max_context`` the same outage admits at the model's whole
context. A cut stream's output is counted by the engine too, and by one token per content event
while it cannot count. The decision latency of this path is measured against local
counting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    Stack,
    kvgate_metrics,
    sim_stats,
    tenant_totals,
    wait_until,
)

MODEL = "qwen2.5-demo"  # the simulator's served name: counted by the engine
LOCAL = "qwen-local"  # the same tokenizer, counted by kvgate (latency comparison)
HUNG = "engine-hung"
DOWN = "engine-down"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT_S = 0.4
MAX_CONTEXT = 32768
DEFAULT_MAX_NEW = 1024
ERROR_KEYS = {"message", "type", "param", "code"}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["order"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def hung_port() -> Iterator[int]:
    """An engine that takes connections and never answers (the kernel's backlog accepts)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def down_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _model(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "max_context": MAX_CONTEXT,
        "default_max_new_tokens": DEFAULT_MAX_NEW,
        "backend": DEFAULT_BACKEND,
        **fields,
    }


@pytest.fixture(scope="module")
def stack(
    hung_port: int, down_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    absent = tmp_path_factory.mktemp("tokenizers") / "not-there"
    running = Stack(models=[_model(MODEL, tokenizer=str(demo_model_dir()))])
    sim_port = running.sim_ports[DEFAULT_BACKEND]
    bounded = {"timeout_s": TIMEOUT_S}
    running.kvgate_overrides = {
        "models": [
            # No tokenizer kvgate could load: only the engine can count it.
            _model(MODEL, tokenizer=str(absent), counting="engine", engine_counting=bounded),
            _model(LOCAL, tokenizer=str(demo_model_dir())),
            _model(
                HUNG,
                counting="engine",
                engine_counting={
                    **bounded,
                    "tokenize_url": f"http://127.0.0.1:{hung_port}/tokenize",
                    "retry_after_s": 3,
                },
            ),
            _model(
                DOWN,
                counting="engine",
                engine_counting={
                    **bounded,
                    "tokenize_url": f"http://127.0.0.1:{down_port}/tokenize",
                },
            ),
        ],
        "backends": [
            {
                "name": DEFAULT_BACKEND,
                "kv_budget_tokens": 48000,
                "kv_block_size": 16,
                "max_concurrent_requests": 256,
                # Where kvgate finds the engine's /tokenize (http://127.0.0.1:PORT/tokenize).
                "discovery": {"metrics_url": f"http://127.0.0.1:{sim_port}/metrics"},
            }
        ],
    }
    with running:
        yield running


def _post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=30.0, headers=stack.auth_headers()) as client:
        return client.post(stack.base_url + path, json=body)


def _kvgate_entry(stack: Stack, resp: httpx.Response) -> dict[str, Any]:
    rid = resp.headers["x-request-id"]
    return stack.wait_access_log(lambda e: e["request_id"] == rid)


def test_chats_with_tools_are_counted_exactly_by_the_engine(stack: Stack) -> None:
    chats = [
        [{"role": "user", "content": "Where is order 4417?"}],
        [
            {"role": "system", "content": "You are a support agent. Answer in one line."},
            {"role": "user", "content": "Where is order 4417?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "lookup_order", "arguments": '{"order": "4417"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": '{"status": "shipped"}'},
        ],
        [{"role": "user", "content": "Ünïcødé, emoji 🙂 and <|im_start|> as text"}],
    ]
    rows = []
    for messages in chats:
        for stream in (False, True):
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": 4,
                "stream": stream,
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
            resp = _post(stack, CHAT, body)
            assert resp.status_code == 200, resp.text
            engine = _usage(resp)["prompt_tokens"]
            entry = _kvgate_entry(stack, resp)
            rows.append((engine, entry["prompt_tokens"]))
    assert all(engine == int(kvgate) for engine, kvgate in rows), rows


def test_completions_are_counted_exactly_by_the_engine(stack: Stack) -> None:
    for prompt in ("Once upon a time", "x" * 3000, ["a batch", "of two prompts"]):
        resp = _post(stack, COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        assert (
            int(_kvgate_entry(stack, resp)["prompt_tokens"])
            == resp.json()["usage"]["prompt_tokens"]
        )


def _usage(resp: httpx.Response) -> dict[str, Any]:
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [
            json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")
        ]
        usage: dict[str, Any] = next(e["usage"] for e in reversed(events) if e.get("usage"))
        return usage
    answer: dict[str, Any] = resp.json()["usage"]
    return answer


@pytest.mark.parametrize("model", [HUNG, DOWN])
def test_an_engine_that_cannot_count_gets_kvgates_refusal(stack: Stack, model: str) -> None:
    before_sim = sim_stats(stack)["generation_requests_total"]
    before_ledger = tenant_totals(stack)
    started = time.perf_counter()
    resp = _post(
        stack,
        CHAT,
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
    )
    elapsed = time.perf_counter() - started
    assert resp.status_code == 503, resp.text  # kvgate's, not Envoy's 504
    assert int(resp.headers["retry-after"]) == (3 if model == HUNG else 1)
    error = resp.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert error["code"] == "service_unavailable" and error["type"] == "server_error"
    assert "did not answer in time" in error["message"]
    # Within the per-call deadline (a hung engine takes all of it, a down one none).
    assert elapsed < TIMEOUT_S + 0.5, elapsed
    entry = _kvgate_entry(stack, resp)
    assert entry["response_code_details"] == "kvgate_counting_unavailable", entry
    # Nothing reserved, nothing forwarded, nothing charged.
    in_flight = wait_until(
        lambda: kvgate_metrics(stack).total("kvgate_kv_tokens_in_flight"),
        lambda tokens: tokens == 0,
        timeout=2,
    )
    assert in_flight == 0
    assert sim_stats(stack)["generation_requests_total"] == before_sim
    after_ledger = tenant_totals(stack)
    assert after_ledger["prompt_tokens"] == before_ledger["prompt_tokens"]
    assert after_ledger["output_tokens"] == before_ledger["output_tokens"]


def test_a_hung_engine_under_load_is_refused_within_the_deadline(stack: Stack) -> None:
    """More callers than the engine's slots: every one answered by the deadline, none 504."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": HUNG, "messages": [{"role": "user", "content": "hello"}]}
    with ThreadPoolExecutor(max_workers=24) as pool:
        started = time.perf_counter()
        statuses = list(pool.map(lambda _: _post(stack, CHAT, body).status_code, range(24)))
        elapsed = time.perf_counter() - started
    assert statuses == [503] * 24, statuses
    assert elapsed < 3 * TIMEOUT_S + 1.0, elapsed


def _cut_stream_output_charge(stack: Stack) -> int:
    """Stream a chat the simulator cuts after 12 tokens sent 4 to an event, and return the
    output tokens kvgate charged for it (at most one event fewer may reach kvgate: the
    upstream reset can overtake the last chunk)."""
    before = tenant_totals(stack)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {
        **stack.auth_headers(),
        "x-sim-output-tokens": "40",
        "x-sim-chunk-tokens": "4",
        "x-sim-abort-after": "12",
        "x-sim-itl-ms": "20",
    }
    with (
        httpx.Client(timeout=httpx.Timeout(10.0, read=0.5)) as client,
        client.stream("POST", stack.base_url + CHAT, json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadTimeout)):
            for _ in resp.iter_raw():
                pass
    after = wait_until(
        lambda: tenant_totals(stack),
        lambda totals: totals["prompt_tokens"] > before["prompt_tokens"],
        timeout=10,
    )
    return after["output_tokens"] - before["output_tokens"]


def test_a_cut_streams_output_is_counted_by_the_engine(stack: Stack) -> None:
    # The engine's count of the text seen (4 tokens an event), not one per event.
    assert _cut_stream_output_charge(stack) in (8, 12)


def test_added_decision_latency_against_local_counting(stack: Stack) -> None:
    """Mean kvgate decision time (kvgate_decision_seconds) per path, distinct prompts."""
    text = " ".join(["the river runs past the old mill"] * 60)  # about 430 tokens

    def mean_decision(model: str, n: int) -> float:
        before = kvgate_metrics(stack)
        with httpx.Client(timeout=30.0, headers=stack.auth_headers()) as client:
            for i in range(n):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"{i} {model} {text}"}],
                    "tools": TOOLS,
                    "max_tokens": 1,
                }
                client.post(stack.base_url + CHAT, json=body)
        after = kvgate_metrics(stack)
        name = "kvgate_decision_seconds"
        total = after.value(f"{name}_sum", outcome="admitted") - before.value(
            f"{name}_sum", outcome="admitted"
        )
        count = after.value(f"{name}_count", outcome="admitted") - before.value(
            f"{name}_count", outcome="admitted"
        )
        assert count == n
        return total / count

    mean_decision(MODEL, 5)  # warm both paths' connections
    mean_decision(LOCAL, 5)
    engine = mean_decision(MODEL, 60)
    local = mean_decision(LOCAL, 60)
    print(
        f"\ndecision latency, mean over 60 chats with tools (~450 prompt tokens): "
        f"engine /tokenize {engine * 1e3:.2f} ms, local {local * 1e3:.2f} ms, "
        f"added {(engine - local) * 1e3:.2f} ms"
    )
    assert engine < TIMEOUT_S


def test_after_a_reload_an_outage_admits_at_the_whole_context(stack: Stack, hung_port: int) -> None:
    """Last: the engine-counted model now asks a hung engine, and admits at its bound."""
    path = stack.kvgate_config_path
    config = yaml.safe_load(path.read_text())
    model = next(m for m in config["models"] if m["name"] == MODEL)
    model["engine_counting"] = {
        "timeout_s": TIMEOUT_S,
        "tokenize_url": f"http://127.0.0.1:{hung_port}/tokenize",
        "on_unavailable": "reserve_max_context",
    }
    path.write_text(yaml.safe_dump(config))
    metrics = kvgate_metrics(stack)
    before = metrics.value("kvgate_config_reloads_total", result="success")
    mismatches = metrics.get("kvgate_prompt_count_mismatches_total", model=MODEL) or 0.0
    assert stack.kvgate is not None and stack.kvgate.pid is not None
    os.kill(stack.kvgate.pid, signal.SIGHUP)
    wait_until(
        lambda: kvgate_metrics(stack).value("kvgate_config_reloads_total", result="success"),
        lambda value: value > before,
        timeout=10,
    )
    resp = _post(
        stack,
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
    )
    assert resp.status_code == 200, resp.text
    entry = _kvgate_entry(stack, resp)
    # Never a guess below the prompt: prompt + completion is the whole context.
    assert int(entry["prompt_tokens"]) == MAX_CONTEXT - 16
    assert int(entry["prompt_tokens"]) >= resp.json()["usage"]["prompt_tokens"]
    # The settlement books the engine's usage, and reports the bound as a mismatch.
    reported = wait_until(
        lambda: kvgate_metrics(stack).get("kvgate_prompt_count_mismatches_total", model=MODEL),
        lambda value: (value or 0.0) == mismatches + 1,
        timeout=5,
    )
    assert reported == mismatches + 1
    # A cut stream's output cannot be counted now: one token per content event (3, or 2
    # when the reset overtook the last chunk), after the count's deadline.
    assert _cut_stream_output_charge(stack) in (2, 3)
