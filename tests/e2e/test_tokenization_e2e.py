"""vLLM's /tokenize and /detokenize through the real Envoy: forwarded to the model's backend
after the tenant's key and RPM slot, never reserved or charged, and never a way past kvgate
(no key, a forged routing header, a tenant's own chat template or media to fetch).

The answers are the engine's own: the same body sent straight to the simulator answers the
same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_TENANT,
    Stack,
    demo_model_dir,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

MODEL = DEFAULT_MODEL_NAME
LIMITED = "two-a-minute"
TIMEOUT_S = 10.0
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Count these words, please."}]},
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"},
            {"name": LIMITED, "api_key": "sk-two-a-minute", "limits": {"rpm": 2}},
        ]
    ) as running:
        yield running


def post(stack: Stack, path: str, body: Any, tenant: str | None = DEMO_TENANT) -> httpx.Response:
    headers = stack.auth_headers(tenant) if tenant is not None else {}
    return httpx.post(f"{stack.base_url}{path}", json=body, headers=headers, timeout=30.0)


def straight(stack: Stack, path: str, body: Any) -> httpx.Response:
    """The same request sent to the simulator itself, around kvgate."""
    return httpx.post(f"{stack.sim_url}{path}", json=body, timeout=30.0)


def in_flight(stack: Stack) -> tuple[float, float]:
    metrics = kvgate_metrics(stack)
    return (
        metrics.value("kvgate_kv_tokens_in_flight", backend=DEFAULT_BACKEND),
        metrics.value("kvgate_requests_in_flight", backend=DEFAULT_BACKEND),
    )


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "Hello there, tokenizer.", "return_token_strs": True},
        {"model": MODEL, "messages": CHAT},
        {"model": MODEL, "messages": CHAT, "add_generation_prompt": False},
    ],
    ids=["prompt", "chat", "chat-without-generation-prompt"],
)
def test_tokenize_answers_what_the_engine_answers(stack: Stack, body: dict[str, Any]) -> None:
    before = tenant_totals(stack)
    answer = post(stack, "/tokenize", body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == straight(stack, "/tokenize", body).json()
    assert answer.json()["count"] == len(answer.json()["tokens"]) > 0
    # Nothing was reserved or booked for it.
    assert in_flight(stack) == (0, 0)
    assert tenant_totals(stack) == before


def test_detokenize_answers_what_the_engine_answers(stack: Stack) -> None:
    tokens = post(stack, "/tokenize", {"model": MODEL, "prompt": "Round trip."}).json()["tokens"]
    body = {"model": MODEL, "tokens": tokens}
    answer = post(stack, "/detokenize", body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == straight(stack, "/detokenize", body).json() == {"prompt": "Round trip."}


def test_no_key_no_backend(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "hi"}
    for headers in ({}, {"x-kvgate-backend": DEFAULT_BACKEND}, {"authorization": "Bearer nope"}):
        answer = httpx.post(f"{stack.base_url}/tokenize", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_tokenize_is_a_request_the_tenant_makes(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "one"}
    assert post(stack, "/tokenize", body, LIMITED).status_code == 200
    assert post(stack, "/detokenize", {"model": MODEL, "tokens": [1]}, LIMITED).status_code == 200
    refused = post(stack, "/tokenize", body, LIMITED)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rpm_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # The other tenants are untouched.
    assert post(stack, "/tokenize", body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "no model"}, "model"),
        ("/tokenize", {"model": MODEL}, "prompt"),
        (
            "/tokenize",
            {"model": MODEL, "messages": CHAT, "chat_template": "{{ x }}"},
            "chat_template",
        ),
        (
            "/tokenize",
            {"model": MODEL, "messages": CHAT, "mm_processor_kwargs": {"max_pixels": 10**9}},
            "mm_processor_kwargs",
        ),
        (
            "/tokenize",
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}},
                        ],
                    }
                ],
            },
            "messages[0].content[1]",
        ),
        ("/tokenize", {"model": MODEL, "messages": "not a list"}, "messages"),
        ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": ["1"]}, "tokens"),
        ("/detokenize", {"model": MODEL}, "tokens"),
    ],
)
def test_what_the_engine_would_do_beyond_tokenizing_is_refused(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    answer = post(stack, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_an_unknown_model_and_other_methods(stack: Stack) -> None:
    unknown = post(stack, "/tokenize", {"model": "no-such-model", "prompt": "hi"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    got = httpx.get(f"{stack.base_url}/tokenize", headers=stack.auth_headers(), timeout=30)
    assert got.status_code == 405
    broken = httpx.post(
        f"{stack.base_url}/tokenize",
        content=b'{"model": ',
        headers={**stack.auth_headers(), "content-type": "application/json"},
        timeout=30,
    )
    assert broken.status_code == 400


def test_a_pool_sends_it_to_one_of_its_endpoints() -> None:
    pool = "vllm-pool"
    with Stack(
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 1024,
                "backend": pool,
            }
        ],
        backends=[
            {
                "name": pool,
                "kv_budget_tokens": 48_000,
                "kv_block_size": 16,
                "max_concurrent_requests": 64,
                "discovery": {"metrics_url": "http://{endpoint}/metrics", "interval_s": 0.5},
            }
        ],
        pool_replicas={pool: 2},
    ) as running:
        body = {"model": MODEL, "prompt": "Which replica?"}
        answer = wait_until(
            lambda: post(running, "/tokenize", body),
            lambda r: r.status_code == 200,
            timeout=TIMEOUT_S,
        )
        assert answer.json() == straight(running, "/tokenize", body).json()
