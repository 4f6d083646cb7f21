"""Two kvgate replicas sharing one Redis, behind one real Envoy.

- A burst split across the replicas admits exactly what one replica would, per limit.
- SIGKILL one replica with streams in flight: its leases expire and the capacity comes back
  within the lease time; the survivor's streams keep theirs (renewed while they stream).
- Redis killed mid-traffic, then restarted (AOF, fsync always): replica 1 (fail_closed)
  answers 503 + Retry-After, replica 2 (fail_open) admits locally; no request waits longer
  than the Redis timeout; afterwards the ledger holds every admitted request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testbed.demo_model import demo_model_dir
from testbed.harness import wait_until
from testbed.redis_harness import RedisStack

MODEL = "qwen2.5-demo"
LEASE_TTL_S = 3.0
REDIS_TIMEOUT_S = 0.3

TENANTS = [
    {"name": "demo", "api_key": "sk-demo"},
    {
        "name": "tpm",
        "api_key": "sk-tpm",
        "limits": {"tpm": {"capacity": 2000, "refill_per_s": 0.001}},
    },
    {"name": "rpm", "api_key": "sk-rpm", "limits": {"rpm": 7}},
    {"name": "conc", "api_key": "sk-conc", "limits": {"concurrency": 5}},
    {"name": "budget", "api_key": "sk-budget", "budget": {"daily_usd": "0.01"}},
]


def models() -> list[dict[str, Any]]:
    return [
        {
            "name": MODEL,
            "tokenizer": str(demo_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 256,
            "backend": "vllm-local",
            "pricing": {"input_per_million": "2", "output_per_million": "6"},
        }
    ]


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        **extra,
    }


def admitted_by(stack: RedisStack, replica: int) -> float:
    return stack.replica_metrics(replica).total("kvgate_requests_total", outcome="admitted")


def decided_by(stack: RedisStack, replica: int) -> float:
    return stack.replica_metrics(replica).total("kvgate_requests_total")


async def burst(
    stack: RedisStack, key: str, bodies: list[dict[str, Any]], headers: dict[str, str]
) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {key}", **headers},
                )
                for body in bodies
            )
        )


def idle(stack: RedisStack) -> None:
    """Wait (bounded) until nothing is in flight in Redis."""
    tag = "{" + str(stack.redis_config["key_prefix"]) + "}"
    with stack.redis.client() as client:
        in_flight = wait_until(
            lambda: int(client.hget(f"{tag}:b|vllm-local", "n") or 0),
            lambda n: n == 0,
            timeout=10,
        )
    assert in_flight == 0


@pytest.fixture(scope="module")
def shared() -> Iterator[RedisStack]:
    with RedisStack(
        tenants=TENANTS,
        models=models(),
        kvgate_overrides={"server": {"lease_ttl_s": LEASE_TTL_S}},
        redis_config={"timeout_s": 1.0},
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def prompt_tokens(shared: RedisStack) -> int:
    reply = httpx.post(
        f"{shared.base_url}/v1/chat/completions",
        json=chat(1),
        headers={"authorization": "Bearer sk-demo"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


# ~2 s each, streaming a token at a time: nothing admitted settles (and gives back unused
# tokens or budget) before the burst has been decided.
SLOW = {"x-sim-output-tokens": "20", "x-sim-itl-ms": "100"}


@pytest.mark.parametrize(
    ("limit", "key", "max_tokens", "headers", "expected", "code"),
    [
        ("tpm", "sk-tpm", 100, SLOW, lambda p: 2000 // (p + 100), "tpm_exceeded"),
        ("rpm", "sk-rpm", 5, {}, lambda p: 7, "rpm_exceeded"),
        ("concurrency", "sk-conc", 50, SLOW, lambda p: 5, "concurrency_exceeded"),
        # $0.01 at $2/M in + $6/M out, reserved at the worst case:
        (
            "budget",
            "sk-budget",
            100,
            SLOW,
            lambda p: 10**10 // (p * 2_000_000 + 600_000_000),
            "budget_exceeded",
        ),
        # The backend's KV budget (48,000 tokens in 16-token blocks), any tenant:
        (
            "kv",
            "sk-demo",
            11_000,
            SLOW,
            lambda p: 48_000 // (-(-(p + 11_000) // 16) * 16),
            "kv_budget_exhausted",
        ),
    ],
)
async def test_a_split_burst_admits_exactly_what_one_replica_would(
    shared: RedisStack,
    prompt_tokens: int,
    limit: str,
    key: str,
    max_tokens: int,
    headers: dict[str, str],
    expected: Any,
    code: str,
) -> None:
    before = (decided_by(shared, 1), decided_by(shared, 2))
    responses = await burst(shared, key, [chat(max_tokens) for _ in range(40)], headers)
    admitted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code != 200]
    assert len(admitted) == expected(prompt_tokens), limit
    assert {r.status_code for r in rejected} == {429}
    assert {r.json()["error"]["code"] for r in rejected} == {code}
    # The burst really was split over both replicas.
    assert decided_by(shared, 1) > before[0] and decided_by(shared, 2) > before[1]
    idle(shared)


async def test_a_killed_replica_returns_its_capacity_within_the_lease(
    shared: RedisStack, prompt_tokens: int
) -> None:
    # Requests completed through both replicas are in the shared ledger.
    before = shared.ledger("demo")
    done = await burst(shared, "sk-demo", [chat(8) for _ in range(6)], {"x-sim-output-tokens": "8"})
    assert all(r.status_code == 200 for r in done)
    served = sum(r.json()["usage"]["completion_tokens"] for r in done)

    # Fill the backend's KV with long streams (4 x ~11k of 48k), spread over both replicas.
    body = chat(11_000, stream=True)
    slow = {"authorization": "Bearer sk-demo", "x-sim-output-tokens": "2000", "x-sim-itl-ms": "50"}
    held = (admitted_by(shared, 1), admitted_by(shared, 2))
    client = httpx.AsyncClient(base_url=shared.base_url, timeout=60)
    streams = []
    try:
        for _ in range(4):
            request = client.build_request("POST", "/v1/chat/completions", json=body, headers=slow)
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            chunks = response.aiter_raw()  # kept: a dropped iterator closes the response
            await chunks.__anext__()  # streaming
            streams.append((response, chunks))
        on_1 = admitted_by(shared, 1) - held[0]
        on_2 = admitted_by(shared, 2) - held[1]
        assert on_1 + on_2 == 4 and on_2 >= 1, (on_1, on_2)

        async def probe() -> int:
            # Needs one stream's worth of KV; when admitted it answers at once (1 token).
            reply = await client.post(
                "/v1/chat/completions",
                json=chat(11_000),
                headers={**slow, "x-sim-output-tokens": "1"},
                timeout=10,
            )
            return reply.status_code

        assert await probe() == 429
        # Longer than the lease: live replicas keep renewing their streams' leases.
        await asyncio.sleep(LEASE_TTL_S + 1)
        assert await probe() == 429

        shared.kill_kvgate2()  # SIGKILL: its streams are cut and never settled
        killed = time.monotonic()
        while (status := await probe()) != 200:
            assert status in (429, 503)  # 503: Envoy has not yet noticed the dead endpoint
            assert time.monotonic() - killed < LEASE_TTL_S + 2, "capacity did not come back"
            await asyncio.sleep(0.2)
        assert time.monotonic() - killed <= LEASE_TTL_S + 2
    finally:
        for response, _ in streams:
            await response.aclose()
        await client.aclose()

    ledger = shared.ledger("demo")
    assert ledger["requests"] - before["requests"] >= 6 + 1
    assert ledger["output_tokens"] - before["output_tokens"] >= served


# ---------------------------------------------------------------- Redis outage


@pytest.fixture(scope="module")
def outage() -> Iterator[RedisStack]:
    with RedisStack(
        tenants=[{"name": "demo", "api_key": "sk-demo"}],
        models=models(),
        redis_config={
            "timeout_s": REDIS_TIMEOUT_S,
            "connect_timeout_s": REDIS_TIMEOUT_S,
            "probe_interval_s": 0.2,
            "failure_policy": "fail_closed",
        },
        redis_config2={"failure_policy": "fail_open"},
        persistent_redis=True,
    ) as stack:
        yield stack


async def test_redis_killed_mid_traffic_policy_holds_and_ledger_is_complete(
    outage: RedisStack,
) -> None:
    results: list[tuple[int, float, httpx.Response]] = []
    stop = asyncio.Event()
    headers = {"authorization": "Bearer sk-demo", "x-sim-output-tokens": "4"}

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            started = time.monotonic()
            reply = await client.post("/v1/chat/completions", json=chat(4), headers=headers)
            results.append((reply.status_code, time.monotonic() - started, reply))

    async with httpx.AsyncClient(base_url=outage.base_url, timeout=30) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(6)]
        await asyncio.sleep(1.0)
        outage.redis.kill()
        await asyncio.sleep(2.0)
        outage.redis.start()  # AOF replayed: nothing acknowledged was lost
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*workers)

    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, set(statuses)
    assert statuses.count(503) > 0 and statuses.count(200) > 0
    # No request waited on Redis longer than its timeout (plus the request's own work).
    assert max(latency for _, latency, _ in results) < REDIS_TIMEOUT_S + 1.0
    for status, _, reply in results:
        if status == 503:
            error = reply.json()["error"]
            assert error["code"] == "service_unavailable" and error["type"] == "server_error"
            assert int(reply.headers["retry-after"]) >= 1

    m1, m2 = outage.replica_metrics(1), outage.replica_metrics(2)
    # Replica 1 (fail_closed) refused; replica 2 (fail_open) decided locally, and said so.
    assert m1.total("kvgate_requests_total", reason="store_unavailable") == statuses.count(503)
    assert m2.total("kvgate_requests_total", reason="store_unavailable") == 0
    assert m2.total("kvgate_store_fallback_decisions_total", outcome="admitted") > 0
    assert m1.total("kvgate_store_errors_total") > 0

    # Both replicas find Redis again, deliver what waited, and the ledger has every request
    # that was admitted: before, during (queued or local) and after the outage.
    def recovered() -> bool:
        return all(
            outage.replica_metrics(n).value("kvgate_store_up") == 1
            and outage.replica_metrics(n).value("kvgate_store_pending_settlements") == 0
            for n in (1, 2)
        )

    assert wait_until(recovered, bool, timeout=10)
    ledger = wait_until(
        lambda: outage.ledger("demo"),
        lambda got: got["requests"] >= statuses.count(200),
        timeout=10,
    )
    served = [reply.json()["usage"] for status, _, reply in results if status == 200]
    assert ledger["requests"] == len(served)
    assert ledger["output_tokens"] == sum(u["completion_tokens"] for u in served)
    assert ledger["prompt_tokens"] == sum(u["prompt_tokens"] for u in served)
