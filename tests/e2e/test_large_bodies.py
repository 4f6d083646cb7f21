"""Agent-sized requests: bodies of a few MB that fit the context are counted and served.

Coding agents resend long conversations: 1-2 MB bodies are routine. kvgate refuses from a
cheap bound only what cannot fit; a body that fits is counted exactly, within the decision
deadline, and charged what the engine served.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    SimOptions,
    Stack,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

CONTEXT = 400_000
WORDS = [
    "the",
    "river",
    "runs",
    "past",
    "the",
    "old",
    "mill",
    "where",
    "people",
    "walk",
    "in",
    "the",
    "evening",
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": DEFAULT_MODEL_NAME,
                "tokenizer": str(demo_model_dir()),
                "max_context": CONTEXT,
                "default_max_new_tokens": 64,
                "backend": DEFAULT_BACKEND,
            }
        ],
        backends=[
            {"name": DEFAULT_BACKEND, "kv_budget_tokens": CONTEXT + 1024, "kv_block_size": 16}
        ],
        sim=SimOptions(num_gpu_blocks=(CONTEXT + 1024) // 16, max_model_len=CONTEXT),
    ) as running:
        yield running


def test_a_conversation_of_almost_two_megabytes_is_served_and_charged(stack: Stack) -> None:
    turn = " ".join(WORDS[i % len(WORDS)] for i in range(40_000))  # ~220 KB a message
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: {turn}"}
        for i in range(9)
    ]
    body = {"model": DEFAULT_MODEL_NAME, "messages": messages, "max_tokens": 8}
    before = tenant_totals(stack)
    resp = httpx.post(
        stack.base_url + "/v1/chat/completions",
        json=body,
        headers=stack.auth_headers(),
        timeout=httpx.Timeout(120.0, connect=5.0),
    )
    assert len(resp.request.content) > 1_800_000
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 350_000
    expected = {"requests": 1, **{k: usage[v] for k, v in _FIELDS.items()}}
    got = wait_until(
        lambda: {k: tenant_totals(stack)[k] - before[k] for k in before},
        lambda d: d == expected,
        timeout=10,
    )
    assert got == expected


_FIELDS = {"prompt_tokens": "prompt_tokens", "output_tokens": "completion_tokens"}


def test_a_decision_past_the_deadline_is_kvgates_own_503() -> None:
    """Counting that cannot finish within server.decision_timeout_s (set tiny here) is cut:
    the client gets kvgate's JSON 503 with Retry-After before Envoy's message timeout (never
    Envoy's empty 504), and nothing stays reserved."""
    with Stack(
        models=[
            {
                "name": DEFAULT_MODEL_NAME,
                "tokenizer": str(demo_model_dir()),
                "max_context": CONTEXT,
                "default_max_new_tokens": 64,
                "backend": DEFAULT_BACKEND,
            }
        ],
        backends=[
            {"name": DEFAULT_BACKEND, "kv_budget_tokens": CONTEXT + 1024, "kv_block_size": 16}
        ],
        sim=SimOptions(num_gpu_blocks=(CONTEXT + 1024) // 16, max_model_len=CONTEXT),
        kvgate_overrides={"server": {"decision_timeout_s": 0.02}},
    ) as stack:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(300_000))
        before = tenant_totals(stack)
        resp = httpx.post(
            stack.base_url + "/v1/chat/completions",
            json={"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": text}]},
            headers=stack.auth_headers(),
            timeout=httpx.Timeout(60.0, connect=5.0),
        )
        assert resp.status_code == 503, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == "service_unavailable"
        assert int(resp.headers["retry-after"]) >= 1
        in_flight = wait_until(
            lambda: kvgate_metrics(stack).value(
                "kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND
            ),
            lambda v: v == 0,
            timeout=10,
        )
        assert in_flight == 0
        assert tenant_totals(stack) == before
