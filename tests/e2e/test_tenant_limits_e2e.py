"""Tenant limits end to end: concurrent bursts, SDK back-off, and an exact ledger."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.demo_model import demo_model_dir
from testbed.harness import Stack

MODEL = "qwen2.5-demo"
SMALL = "small-demo"
KEY = "sk-kvgate-demo"
AUTH = {"Authorization": f"Bearer {KEY}"}


def chat(content: str = "Say something short.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def metric_value(stack: Stack, name: str, **labels: str) -> float:
    text = httpx.get(stack.kvgate_metrics_url, timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def burst(
    stack: Stack, bodies: list[dict[str, Any]], headers: dict[str, str]
) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=body, headers={**AUTH, **headers})
                for body in bodies
            )
        )


async def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url, headers=headers)
        response.raise_for_status()
        return response.json()


def wait_idle(stack: Stack, backend: str = "vllm-local") -> None:
    """Settlement is asynchronous to the client's last byte: poll (bounded) until it lands."""
    for _ in range(200):
        if metric_value(stack, "kvgate_requests_in_flight", backend=backend) == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight on {backend}")


# ---------------------------------------------------------------- concurrent bursts


@pytest.fixture(scope="module")
def burst_stack() -> Iterator[Stack]:
    tenants = [
        {
            "name": "demo",
            "api_key": KEY,
            "limits": {"tpm": {"capacity": 1000, "refill_per_s": 1000 / 60}},
        },
        {"name": "narrow", "api_key": "sk-narrow", "limits": {"concurrency": 5}},
        {
            "name": "thrifty",
            "api_key": "sk-thrifty",
            "budget": {"daily_usd": "0.001", "action": "block"},
        },
    ]
    models = [
        {
            "name": MODEL,
            "tokenizer": str(demo_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 256,
            "backend": "vllm-local",
            "pricing": {"input_per_million": "2", "output_per_million": "6"},
        },
    ]
    with Stack(tenants=tenants, models=models) as stack:
        yield stack


async def test_fifty_parallel_requests_never_exceed_the_tpm_bucket(burst_stack: Stack) -> None:
    started = time.monotonic()
    responses = await burst(
        burst_stack, [chat(max_tokens=100) for _ in range(50)], {"x-sim-output-tokens": "100"}
    )
    elapsed = time.monotonic() - started
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(rejected) == 50
    assert admitted and rejected
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    prompt = admitted[0].json()["usage"]["prompt_tokens"]
    reserved = len(admitted) * (prompt + 100)
    # Everything admitted was reserved up front, so the bucket (1,000 + refill during the
    # burst) bounds it: no concurrent overshoot.
    assert reserved <= 1000 + elapsed * 1000 / 60
    assert used <= reserved
    for response in rejected:
        error = response.json()["error"]
        assert error["code"] == "tpm_exceeded"
        assert int(response.headers["retry-after"]) >= 1
        assert response.headers["x-ratelimit-limit-tokens"] == "1000"
    wait_idle(burst_stack)


async def test_fifty_parallel_requests_respect_tenant_concurrency(burst_stack: Stack) -> None:
    headers = {
        "Authorization": "Bearer sk-narrow",
        "x-sim-output-tokens": "20",
        "x-sim-itl-ms": "100",
    }
    responses = await burst(burst_stack, [chat(max_tokens=50) for _ in range(50)], headers)
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    # Each admitted request holds its slot ~2 s, longer than the whole burst takes to arrive.
    assert len(admitted) == 5
    assert {r.json()["error"]["code"] for r in rejected} == {"concurrency_exceeded"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
    wait_idle(burst_stack)


async def test_fifty_parallel_requests_cannot_jointly_overspend(burst_stack: Stack) -> None:
    headers = {"Authorization": "Bearer sk-thrifty", "x-sim-output-tokens": "100"}
    responses = await burst(burst_stack, [chat(max_tokens=100) for _ in range(50)], headers)
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    prompt = admitted[0].json()["usage"]["prompt_tokens"]
    worst_pico = prompt * 2_000_000 + 100 * 6_000_000
    assert len(admitted) == 10**9 // worst_pico  # $0.001 = 1e9 pico-dollars
    assert {r.json()["error"]["type"] for r in rejected} == {"insufficient_quota"}
    wait_idle(burst_stack)
    report = await get_json(
        f"{burst_stack.base_url}/v1/kvgate/usage", {"Authorization": "Bearer sk-thrifty"}
    )
    assert Decimal(report["today"]["cost_usd"]) <= Decimal("0.001")


# ---------------------------------------------------------------- SDK back-off


@pytest.fixture(scope="module")
def backoff_stack() -> Iterator[Stack]:
    tenants = [
        {"name": "demo", "api_key": KEY, "limits": {"tpm": {"capacity": 200, "refill_per_s": 150}}},
    ]
    with Stack(tenants=tenants) as stack:
        yield stack


def test_openai_sdk_backs_off_on_429_and_succeeds(backoff_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{backoff_stack.base_url}/v1", api_key=KEY, max_retries=6)
    before = metric_value(
        backoff_stack, "kvgate_requests_total", outcome="rejected", reason="tpm_exceeded"
    )
    for _ in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=150,
            extra_headers={"x-sim-output-tokens": "150"},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 150
    after = metric_value(
        backoff_stack, "kvgate_requests_total", outcome="rejected", reason="tpm_exceeded"
    )
    assert after > before  # the SDK really met 429s and retried through them


def test_retry_after_present_only_when_waiting_helps(backoff_stack: Stack) -> None:
    with httpx.Client(base_url=backoff_stack.base_url, timeout=30) as client:
        too_big = client.post("/v1/chat/completions", json=chat(max_tokens=500), headers=AUTH)
        assert too_big.status_code == 400
        assert too_big.json()["error"]["code"] == "request_exceeds_tpm"
        assert "retry-after" not in too_big.headers
        statuses = []
        for _ in range(3):
            response = client.post(
                "/v1/chat/completions",
                json=chat(max_tokens=150),
                headers={**AUTH, "x-sim-output-tokens": "1"},
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert int(response.headers["retry-after-ms"]) > 0
        assert 429 in statuses


# ---------------------------------------------------------------- exact ledger


@pytest.fixture(scope="module")
def ledger_stack() -> Iterator[Stack]:
    tenants = [
        {"name": "demo", "api_key": KEY},
        {
            "name": "clamped",
            "api_key": "sk-clamped",
            "budget": {"daily_usd": "0.01", "action": "clamp"},
        },
        {
            "name": "fallback",
            "api_key": "sk-fallback",
            "budget": {"daily_usd": "0.0005", "action": "fallback", "fallback_model": SMALL},
        },
    ]
    model_dir = str(demo_model_dir())
    models = [
        {
            "name": MODEL,
            "tokenizer": model_dir,
            "max_context": 32768,
            "default_max_new_tokens": 64,
            "backend": "vllm-local",
            "pricing": {
                "input_per_million": "3",
                "cached_input_per_million": "1",
                "output_per_million": "15",
            },
        },
        {
            "name": SMALL,
            "tokenizer": model_dir,
            "max_context": 32768,
            "default_max_new_tokens": 64,
            "backend": "vllm-small",
            "pricing": {"input_per_million": "0.1", "output_per_million": "0.2"},
        },
    ]
    backends = [
        {"name": "vllm-local", "kv_budget_tokens": 48000, "kv_block_size": 16},
        {"name": "vllm-small", "kv_budget_tokens": 48000, "kv_block_size": 16},
    ]
    with Stack(tenants=tenants, models=models, backends=backends) as stack:
        yield stack


async def _stream_and_cut(stack: Stack, key: str, tokens_before_stall: int) -> int:
    """Stream until the simulator stalls, then disconnect. Returns content events read."""
    body = chat("Tell me a story.", stream=True, max_tokens=200)
    headers = {
        "Authorization": f"Bearer {key}",
        "x-sim-output-tokens": "200",
        "x-sim-stall-after": str(tokens_before_stall),
    }
    received = 0
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    received += 1
            if received >= tokens_before_stall:
                break
    return received


async def test_ledger_equals_what_was_served_token_for_token(ledger_stack: Stack) -> None:
    stack = ledger_stack
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        for size in (5, 17, 40):
            r = await client.post(
                "/v1/chat/completions",
                json=chat(max_tokens=50),
                headers={**AUTH, "x-sim-output-tokens": str(size)},
            )
            assert r.status_code == 200
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat(stream=True, max_tokens=30),
            headers={**AUTH, "x-sim-output-tokens": "30"},
        ) as r:
            assert b"[DONE]" in b"".join([chunk async for chunk in r.aiter_bytes()])
        # Clamp: $0.01 cannot cover 5,000 output tokens at $15/M; the answer is shortened.
        clamped = await client.post(
            "/v1/chat/completions",
            json=chat(max_tokens=5000),
            headers={"Authorization": "Bearer sk-clamped", "x-sim-output-tokens": "5000"},
        )
        assert clamped.status_code == 200
        assert "x-kvgate-max-tokens-clamped" in clamped.headers
        # Fallback: too expensive on the big model for $0.0005, served by the small one.
        fell = await client.post(
            "/v1/chat/completions",
            json=chat(max_tokens=100),
            headers={"Authorization": "Bearer sk-fallback", "x-sim-output-tokens": "100"},
        )
        assert fell.status_code == 200
        assert fell.headers["x-kvgate-fallback"] == f"{MODEL} -> {SMALL}"
        assert fell.json()["model"] == SMALL
    assert await _stream_and_cut(stack, KEY, 7) == 7
    wait_idle(stack, "vllm-local")
    wait_idle(stack, "vllm-small")

    # What each simulator served, by the rule in docs/limits-and-billing.md: finished requests
    # pay prompt + output; cut ones pay prompt + what was streamed when anything was.
    prices = {MODEL: (3_000_000, 15_000_000), SMALL: (100_000, 200_000)}
    expected: dict[str, list[int]] = {}
    for backend, model in (("vllm-local", MODEL), ("vllm-small", SMALL)):
        stats = await get_json(f"{stack.sim_urls[backend]}/sim/stats")
        for record in stats["served"]:
            sent = record["completion_tokens_sent"]
            charged = record["finished"] or sent > 0
            prompt = record["prompt_tokens"] if charged else 0
            totals = expected.setdefault(model, [0, 0, 0])
            totals[0] += prompt
            totals[1] += sent if charged else 0
            totals[2] += prompt * prices[model][0] + (sent if charged else 0) * prices[model][1]
    ledger = await get_json(f"{stack.kvgate_http_url}/admin/usage")
    got: dict[str, list[int]] = {}
    for tenant in ledger["tenants"]:
        for model, totals in tenant["today"]["by_model"].items():
            entry = got.setdefault(model, [0, 0, 0])
            entry[0] += totals["prompt_tokens"]
            entry[1] += totals["output_tokens"]
            entry[2] += int(Decimal(totals["cost_usd"]) * 10**12)
    assert got == expected
    # The Prometheus counters tell the same story (the cost counter is a float of dollars).
    for model, (prompt, output, cost) in expected.items():
        assert metric_value(stack, "kvgate_prompt_tokens_total", model=model) == prompt
        assert metric_value(stack, "kvgate_output_tokens_total", model=model) == output
        dollars = metric_value(stack, "kvgate_cost_usd_total", model=model)
        assert dollars == pytest.approx(cost / 10**12, rel=1e-9)
