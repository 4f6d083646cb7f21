"""The semantic cache end to end, what its test modules share: a stack with the cache on
(WordLlama, the simulator serving /v1/embeddings), its tenants, and the requests that ask a
question in a context and read how it was answered."""

from __future__ import annotations

from typing import Any

import httpx

from testbed.harness import DEFAULT_MODEL_NAME, Stack, default_models, wait_until

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
DEMO_KEY = "sk-kvgate-demo"
OTHER_KEY = "sk-semantic-other"
OPTED_OUT_KEY = "sk-semantic-opted-out"


def tenants() -> list[dict[str, Any]]:
    return [
        {"name": "demo", "api_key": DEMO_KEY, "semantic_cache": True},
        {"name": "other", "api_key": OTHER_KEY, "semantic_cache": True},
        {"name": "opted-out", "api_key": OPTED_OUT_KEY},
    ]


def models() -> list[dict[str, Any]]:
    return [{**model, "semantic_cache": True} for model in default_models()]


def stack(**semantic: Any) -> Stack:
    return Stack(
        tenants=tenants(),
        models=models(),
        sim={"extra_args": ["--embedding-model", "wordllama"]},
        kvgate_overrides={"semantic_cache": {"enabled": True, **semantic}},
    )


def body(question: str, context: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": [
            {"role": "system", "content": f"Answer briefly. Session {context}."},
            {"role": "user", "content": question},
        ],
        "max_tokens": 16,
        "temperature": 0,
        **extra,
    }


def post(stack: Stack, body: dict[str, Any], key: str = DEMO_KEY) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=TIMEOUT,
    )


def arrived(stack: Stack) -> int:
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    return sum(1 for r in records["requests"] if r["path"] == "/v1/chat/completions")


def answered(stack: Stack, body: dict[str, Any], key: str = DEMO_KEY) -> httpx.Response:
    first = post(stack, body, key)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvgate-cache"] == "miss"
    return first


def hit(stack: Stack, body: dict[str, Any], key: str = DEMO_KEY) -> httpx.Response:
    """The first answer is indexed at settlement, just after the client has it: wait."""
    return wait_until(
        lambda: post(stack, body, key),
        lambda r: r.headers.get("x-kvgate-cache") == "semantic-hit",
        timeout=5,
        interval=0.1,
    )
