"""Broken 200 answers are never stored: client -> real Envoy -> kvgate -> simulator.

Each shape is one vLLM (or something in front of it) really sends with a 200 status: a
generation that fails after the headers (the in-band error event), a stream that ends
without `data: [DONE]`, an engine abort (`finish_reason: abort`), an HTML page, an empty
body. With the exact-match cache, the same request again must reach the backend (the
simulator's own request record moves), not replay the broken answer; with an
Idempotency-Key, the retry must run anew, and its good answer is the one kept.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from testbed.harness import DEFAULT_MODEL_NAME, Stack, kvgate_metrics, wait_until

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
NOT_STORED = "kvgate_answers_not_stored_total"
# How long a stored answer takes to land after its last byte went out (a background task
# on the in-memory store: milliseconds); waited before asking again, so that a broken
# answer that was stored would be found.
STORE_SETTLE_S = 0.3


@dataclass(frozen=True)
class Broken:
    name: str
    stream: bool
    steering: dict[str, str]
    reason: str  # the label of kvgate_answers_not_stored_total it is counted under

    def __str__(self) -> str:
        return self.name


SHAPES = [
    Broken("in_band_error_event", True, {"x-sim-stream-error-after": "3"}, "error"),
    Broken("stream_ends_before_done", True, {"x-sim-end-after": "3"}, "no_done"),
    Broken("stream_finish_abort", True, {"x-sim-finish-abort-after": "3"}, "failed_choice"),
    Broken("plain_finish_abort", False, {"x-sim-finish-abort-after": "3"}, "failed_choice"),
    Broken("html_200", False, {"x-sim-proxy-answer": "html"}, "content_type"),
    Broken("html_200_to_a_stream", True, {"x-sim-proxy-answer": "html"}, "content_type"),
    Broken("empty_200", False, {"x-sim-proxy-answer": "empty"}, "empty"),
    Broken("empty_200_stream", True, {"x-sim-proxy-answer": "empty"}, "empty"),
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # Idempotency-Key is on by default; the exact-match cache is turned on.
    with Stack(kvgate_overrides={"response_cache": {"enabled": True}}) as running:
        yield running


def _body(content: str, *, stream: bool, deterministic: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "stream": stream,
    }
    if deterministic:
        body["temperature"] = 0  # what the exact-match cache serves
    return body


def _post(stack: Stack, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={**stack.auth_headers(), **headers},
        timeout=TIMEOUT,
    )


def _arrived(stack: Stack) -> int:
    """Generation requests that reached the simulator."""
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    return sum(1 for r in records["requests"] if r["path"] == "/v1/chat/completions")


def _not_stored(stack: Stack, reason: str) -> float:
    return kvgate_metrics(stack).total(NOT_STORED, reason=reason)


def _is_whole(response: httpx.Response, *, stream: bool) -> bool:
    if stream:
        return response.content.endswith(b"data: [DONE]\n\n")
    return response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_broken_answer_is_not_a_cache_hit(stack: Stack, shape: Broken) -> None:
    body = _body(f"{shape.name} {uuid.uuid4()}", stream=shape.stream, deterministic=True)
    counted = _not_stored(stack, shape.reason)
    arrived = _arrived(stack)
    first = _post(stack, body, shape.steering)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvgate-cache"] == "miss"
    time.sleep(STORE_SETTLE_S)
    again = _post(stack, body, shape.steering)
    assert again.status_code == 200, again.text
    # Not a hit: the backend answered again (a miss, or a bypass while the first
    # attempt's entry is still being given up).
    assert again.headers["x-kvgate-cache"] in ("miss", "bypass"), dict(again.headers)
    assert _arrived(stack) == arrived + 2
    wait_until(lambda: _not_stored(stack, shape.reason), lambda n: n >= counted + 1, timeout=5)
    # And once the backend is well again, its whole answer is the one kept.
    good = _post(stack, body, {})
    assert good.status_code == 200 and _is_whole(good, stream=shape.stream), good.text
    hit = wait_until(
        lambda: _post(stack, body, {}),
        lambda r: r.headers.get("x-kvgate-cache") == "hit",
        timeout=5,
        interval=0.1,
    )
    assert hit.content == good.content


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_broken_answer_is_not_replayed_for_its_idempotency_key(
    stack: Stack, shape: Broken
) -> None:
    key = f"{shape.name}-{uuid.uuid4()}"
    # Sampled (no temperature 0): the exact-match cache stays out of it.
    body = _body(f"{shape.name} {uuid.uuid4()}", stream=shape.stream, deterministic=False)
    first = _post(stack, body, {"idempotency-key": key, **shape.steering})
    assert first.status_code == 200, first.text
    arrived = _arrived(stack)
    retry = _post(stack, body, {"idempotency-key": key})
    assert retry.status_code == 200, retry.text
    assert retry.headers.get("idempotent-replayed") != "true", retry.content[:300]
    assert _arrived(stack) == arrived + 1  # it ran anew
    assert _is_whole(retry, stream=shape.stream), retry.text
    # The retry's whole answer is the one its key replays from now on.
    again = _post(stack, body, {"idempotency-key": key})
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == retry.content
    assert _arrived(stack) == arrived + 1
