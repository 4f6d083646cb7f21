"""A kvgate replica dies (SIGKILL): Envoy leaves it at once and the other one answers.

Two kvgate replicas share one private Redis behind the real Envoy with envoy/envoy.yaml.
Before: for about two seconds (three failed health checks, 1 s apart) Envoy kept opening
ext_proc streams to the dead replica, and every such request failed with a 503. Now the
ext_proc stream is retried on the other replica when its connection is refused (nothing
was processed yet, so nothing is decided twice), and outlier detection ejects the dead
endpoint on its first local-origin failure.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from testbed.demo_model import demo_model_dir
from testbed.harness import wait_until
from testbed.redis_harness import RedisStack

KEY = "sk-demo"


@pytest.fixture(scope="module")
def two_replicas() -> Iterator[RedisStack]:
    with RedisStack(
        tenants=[{"name": "demo", "api_key": KEY}],
        models=[
            {
                "name": "qwen2.5-demo",
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 16,
                "backend": "vllm-local",
            }
        ],
    ) as stack:
        yield stack


def ask(client: httpx.Client) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        json={"model": "qwen2.5-demo", "messages": [{"role": "user", "content": "Hi"}]},
        headers={"authorization": f"Bearer {KEY}", "x-sim-output-tokens": "2"},
    )


def test_requests_after_a_replica_is_killed_all_succeed(two_replicas: RedisStack) -> None:
    before = two_replicas.ledger("demo")
    with httpx.Client(base_url=two_replicas.base_url, timeout=10) as client:
        # Both replicas take traffic first (round robin over healthy endpoints).
        assert all(ask(client).status_code == 200 for _ in range(10))
        assert two_replicas.replica_metrics(2).total("kvgate_requests_total") > 0
        two_replicas.kill_kvgate2()
        started = time.monotonic()
        statuses = []
        # Well inside the ~2-3 s the health checks alone need to mark it down.
        while time.monotonic() - started < 2.0:
            statuses.append(ask(client).status_code)
    assert len(statuses) >= 10
    failed = [s for s in statuses if s != 200]
    assert failed == [], f"{len(failed)} of {len(statuses)} requests failed: {failed}"
    # A retried stream is never decided twice: every answer is charged exactly once (the
    # ten before the kill included), 2 output tokens each.
    answered = 10 + len(statuses)
    ledger = wait_until(
        lambda: two_replicas.ledger("demo"),
        lambda now: now["requests"] - before["requests"] >= answered,
        timeout=10,
    )
    assert ledger["requests"] - before["requests"] == answered
    assert ledger["output_tokens"] - before["output_tokens"] == 2 * answered
