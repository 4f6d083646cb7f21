"""One request body message, several waits, one Envoy deadline (end to end).

Envoy extends a message's timeout once (override_message_timeout). A request with an
Idempotency-Key that first waits for a running duplicate and then, when that one gave up,
waits again in its pool's queue must still get its answer, never Envoy's empty 504.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import DEFAULT_MODEL_NAME, SimOptions, Stack, kvgate_metrics, wait_until
from tests.e2e.support import document_messages

POOL = "vllm-pool"
BLOCK = 16
# 2,000 prompt + 1,000 new = 3,008 reserved: one request fills the endpoint.
BUDGET = 4_000
PROMPT = 2_000
MAX_NEW = 1_000
KEY_WAIT_S = 3.0
QUEUE_WAIT_S = 12.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": DEFAULT_MODEL_NAME,
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 1024,
                "backend": POOL,
            }
        ],
        backends=[
            {
                "name": POOL,
                "kv_budget_tokens": BUDGET,
                "kv_block_size": BLOCK,
                "max_concurrent_requests": 64,
                "queue": {"max_wait_s": QUEUE_WAIT_S, "poll_interval_s": 0.05},
            }
        ],
        pool_replicas={POOL: 1},
        sim=SimOptions(num_gpu_blocks=BUDGET // BLOCK, block_size=BLOCK),
        kvgate_overrides={"idempotency": {"max_wait_s": KEY_WAIT_S}},
    ) as running:
        yield running


def _chat(
    stack: Stack, content: str, headers: dict[str, str], timeout: float = 60.0
) -> httpx.Response:
    counter = PromptCounter.from_model_dir(demo_model_dir())
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_NAME,
            "messages": document_messages(counter, PROMPT, content),
            "max_tokens": MAX_NEW,
        },
        headers={**stack.auth_headers(), **headers},
        timeout=httpx.Timeout(timeout, connect=5.0),
    )


def test_a_key_wait_then_a_queue_wait_fit_one_message_deadline(stack: Stack) -> None:
    key = f"two-waits-{uuid.uuid4()}"
    results: dict[str, httpx.Response | Exception] = {}

    def run(name: str, content: str, headers: dict[str, str], timeout: float = 60.0) -> None:
        try:
            results[name] = _chat(stack, content, headers, timeout)
        except httpx.HTTPError as exc:
            results[name] = exc

    admitted = kvgate_metrics(stack).total("kvgate_requests_total", outcome="admitted")
    # The holder fills the pool for about 8 s.
    holder = threading.Thread(
        target=run, args=("holder", "hold", {"x-sim-output-tokens": "160", "x-sim-itl-ms": "50"})
    )
    holder.start()
    wait_until(
        lambda: kvgate_metrics(stack).total("kvgate_requests_total", outcome="admitted"),
        lambda n: n > admitted,
        timeout=10,
        interval=0.05,
    )
    # The first attempt with the key queues behind it, and its client gives up at 1.5 s.
    first = threading.Thread(
        target=run, args=("first", "keyed", {"idempotency-key": key}, 1.5), daemon=True
    )
    first.start()
    wait_until(
        lambda: kvgate_metrics(stack).total("kvgate_queue_length", pool=POOL),
        lambda n: n >= 1,
        timeout=10,
        interval=0.05,
    )
    started = time.monotonic()
    # The duplicate waits for the first attempt (the key's wait), which then gives up: it
    # runs itself and waits again, in the queue, until the holder is done.
    duplicate = _chat(stack, "keyed", {"idempotency-key": key, "x-sim-output-tokens": "4"})
    waited = time.monotonic() - started
    holder.join()
    first.join()
    assert isinstance(results["first"], httpx.TimeoutException)
    assert duplicate.status_code == 200, (duplicate.status_code, duplicate.text)
    assert duplicate.headers.get("idempotent-replayed") is None  # it ran itself
    # Longer than the key's wait and Envoy's own 2 s: both waits happened in one message.
    assert waited > KEY_WAIT_S + 2.0, waited
    samples = kvgate_metrics(stack)
    assert samples.total("kvgate_queue_wait_seconds_count", pool=POOL) >= 1
