"""kvgate's ledger reconciled with the engine's own counters, through the real Envoy: what
kvgate booked per engine equals what the engine counted, and traffic sent straight to the
engine, around kvgate, shows up as exactly its tokens, in the admin API, `kvgate reconcile`
and the kvgate_engine_unbooked_tokens gauge.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import pytest
from openai import OpenAI

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    Stack,
    kvgate_metrics,
    wait_until,
)

THROUGH_KVGATE = 5
AROUND_KVGATE = 20
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    running = Stack()
    # The engine's /metrics, scraped twice a second (the same discovery that reads its KV).
    running.backends[0]["discovery"] = {
        "metrics_url": f"{running.sim_url}/metrics",
        "interval_s": 0.5,
    }
    with running:
        yield running


def reconcile(stack: Stack) -> admin_pb2.ReconcileResponse:
    with grpc.insecure_channel(f"127.0.0.1:{stack.kvgate_admin_port}") as channel:
        reply: admin_pb2.ReconcileResponse = admin_pb2_grpc.AdminStub(channel).Reconcile(
            admin_pb2.ReconcileRequest(), timeout=5
        )
        return reply


def engine_row(stack: Stack) -> admin_pb2.EngineReconciliation:
    [row] = [e for e in reconcile(stack).engines if e.ledger == DEFAULT_BACKEND]
    return row


def test_traffic_around_kvgate_is_the_unbooked_tokens(stack: Stack) -> None:
    # Watching starts at the first scrape the store can be compared with.
    wait_until(lambda: reconcile(stack).engines, bool, timeout=TIMEOUT_S)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key(), max_retries=0)
    booked_prompt = booked_output = 0
    for i in range(THROUGH_KVGATE):
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": f"Through kvgate, question {i}."}],
            max_tokens=12,
        )
        assert answer.usage is not None
        booked_prompt += answer.usage.prompt_tokens
        booked_output += answer.usage.completion_tokens
    # Booked = counted: nothing unbooked once the engine's counters are scraped again.
    settled = wait_until(
        lambda: engine_row(stack),
        lambda r: (
            r.booked_prompt_tokens == booked_prompt
            and r.engine_prompt_tokens == booked_prompt
            and r.engine_output_tokens == booked_output
        ),
        timeout=TIMEOUT_S,
    )
    assert settled.booked_output_tokens == booked_output
    assert (settled.unbooked_prompt_tokens, settled.unbooked_output_tokens) == (0, 0)

    around_prompt = around_output = 0
    for i in range(AROUND_KVGATE):
        straight = httpx.post(
            f"{stack.sim_url}/v1/chat/completions",
            json={
                "model": DEFAULT_MODEL_NAME,
                "messages": [{"role": "user", "content": f"Around kvgate, question {i}?"}],
                "max_tokens": 7,
            },
            timeout=30,
        )
        straight.raise_for_status()
        around_prompt += straight.json()["usage"]["prompt_tokens"]
        around_output += straight.json()["usage"]["completion_tokens"]
    drift = wait_until(
        lambda: engine_row(stack),
        lambda r: (
            r.unbooked_prompt_tokens == around_prompt and r.unbooked_output_tokens == around_output
        ),
        timeout=TIMEOUT_S,
    )
    assert drift.booked_prompt_tokens == booked_prompt  # kvgate booked only its own
    assert drift.engine_restarts == 0
    metrics = kvgate_metrics(stack)
    for kind, tokens in (("prompt", around_prompt), ("output", around_output)):
        assert (
            metrics.value("kvgate_engine_unbooked_tokens", backend=DEFAULT_BACKEND, kind=kind)
            == tokens
        )
    # The operator's table says the same.
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "reconcile",
            "--admin",
            f"127.0.0.1:{stack.kvgate_admin_port}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.splitlines()
    [line] = [row for row in table if row.startswith(DEFAULT_BACKEND)]
    assert line.split()[1:7] == [
        str(booked_prompt + around_prompt),
        str(booked_prompt),
        str(around_prompt),
        str(booked_output + around_output),
        str(booked_output),
        str(around_output),
    ]
