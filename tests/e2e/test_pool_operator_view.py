"""What an operator sees of a busy pool: `kvgate backends` and the admin API's ListBackends
list the pool's total and each endpoint (KV and requests in flight, budget, state, last
scrape), while its requests are being generated. Reservations are kept per endpoint
(`pool/IP:PORT`); a listing that read the pool's own name showed a busy pool idle.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from testbed.harness import DEFAULT_MODEL_NAME, SimOptions, Stack, demo_model_dir, wait_until

POOL = "vllm-pool"
REPLICAS = 2
BUSY = 4
BUDGET = 40_000


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": DEFAULT_MODEL_NAME,
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 64,
                "backend": POOL,
            }
        ],
        backends=[
            {
                "name": POOL,
                "kv_budget_tokens": BUDGET,
                "kv_block_size": 16,
                "max_concurrent_requests": 8,
                "discovery": {"metrics_url": "http://{endpoint}/metrics", "interval_s": 0.5},
            }
        ],
        pool_replicas={POOL: REPLICAS},
        # Each request stays in flight for seconds: long enough to be listed.
        sim=SimOptions(ttft_ms=4_000),
    ) as running:
        yield running


def list_backends(stack: Stack) -> admin_pb2.ListBackendsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{stack.kvgate_admin_port}") as channel:
        reply: admin_pb2.ListBackendsResponse = admin_pb2_grpc.AdminStub(channel).ListBackends(
            admin_pb2.ListBackendsRequest(), timeout=5
        )
        return reply


def test_a_busy_pool_is_listed_per_endpoint(stack: Stack) -> None:
    def chat(i: int) -> None:
        httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            headers=stack.auth_headers(),
            json={
                "model": DEFAULT_MODEL_NAME,
                "messages": [{"role": "user", "content": f"Question number {i}?"}],
                "max_tokens": 16,
            },
            timeout=60,
        ).raise_for_status()

    # Both endpoints scraped (their state is known) before the load.
    wait_until(
        lambda: list_backends(stack),
        lambda r: all(e.HasField("last_scrape_age_s") for e in r.backends[0].endpoints),
        timeout=10,
    )
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(BUSY)]
    for thread in threads:
        thread.start()
    try:
        busy = wait_until(
            lambda: list_backends(stack),
            lambda r: r.backends[0].requests_in_flight == BUSY,
            timeout=10,
        )
        [pool] = busy.backends
        assert pool.name == POOL and pool.pool
        assert sorted(e.address for e in pool.endpoints) == sorted(stack.pool_endpoints(POOL))
        assert sum(e.requests_in_flight for e in pool.endpoints) == BUSY
        assert pool.kv_tokens_in_flight == sum(e.kv_tokens_in_flight for e in pool.endpoints) > 0
        # Each endpoint has its own budget; the pool's is their sum.
        assert [e.kv_budget_tokens for e in pool.endpoints] == [BUDGET] * REPLICAS
        assert pool.kv_budget_tokens == BUDGET * REPLICAS
        for endpoint in pool.endpoints:
            assert endpoint.state == "ready"
            assert 0 <= endpoint.last_scrape_age_s < 5
        # The operator's command shows the same, one line per endpoint.
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvgate.cli",
                "backends",
                "--admin",
                f"127.0.0.1:{stack.kvgate_admin_port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()
        assert shown[0].startswith(POOL) and f"pool of {REPLICAS}" in shown[0]
        assert len(shown) == 1 + REPLICAS
        assert {line.split()[0] for line in shown[1:]} == set(stack.pool_endpoints(POOL))
    finally:
        for thread in threads:
            thread.join(timeout=60)
    idle = wait_until(
        lambda: list_backends(stack),
        lambda r: r.backends[0].requests_in_flight == 0,
        timeout=10,
    )
    assert idle.backends[0].kv_tokens_in_flight == 0
