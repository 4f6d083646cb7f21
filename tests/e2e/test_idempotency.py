"""Idempotency-Key end to end: client -> real Envoy -> kvgate -> simulator.

What the backend did is read from the simulator's own request record, what was charged
from kvgate's ledger: a duplicate must neither reach the GPU nor be billed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI

from testbed.harness import DEFAULT_MODEL_NAME, Stack, tenant_totals, wait_until
from testbed.redis_harness import RedisStack

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
SLOW = {"x-sim-output-tokens": "30", "x-sim-itl-ms": "30"}  # ~1 s of generation


OTHER_KEY = "sk-other-tenant"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": "demo", "api_key": "sk-kvgate-demo"},
            {"name": "other", "api_key": OTHER_KEY},
        ]
    ) as running:
        yield running


def _body(content: str = "Tell me a story.", *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 64,
        "stream": stream,
    }


def _post(
    stack: Stack, key: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={**stack.auth_headers(), "idempotency-key": key, **(headers or {})},
        timeout=TIMEOUT,
    )


def _arrived(stack: Stack) -> int:
    """Generation requests that reached the simulator."""
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    return sum(1 for r in records["requests"] if r["path"] == "/v1/chat/completions")


def _settled(stack: Stack, requests: int) -> dict[str, int]:
    return wait_until(lambda: tenant_totals(stack), lambda t: t["requests"] >= requests, timeout=10)


def test_concurrent_duplicates_make_one_generation_and_one_charge(stack: Stack) -> None:
    key = f"story-{uuid.uuid4()}"
    arrived, before = _arrived(stack), tenant_totals(stack)
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: _post(stack, key, _body(), SLOW), range(20)))
    assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
    assert len({a.content for a in answers}) == 1  # the same answer, byte for byte
    replayed = [a for a in answers if a.headers.get("idempotent-replayed") == "true"]
    assert len(replayed) == 19
    assert _arrived(stack) == arrived + 1
    after = _settled(stack, before["requests"] + 1)
    usage = answers[0].json()["usage"]
    assert after["requests"] == before["requests"] + 1
    assert after["output_tokens"] == before["output_tokens"] + usage["completion_tokens"]
    # And after completion, within the retention window: the stored answer again.
    late = _post(stack, key, _body())
    assert late.status_code == 200 and late.content == answers[0].content
    assert late.headers["idempotent-replayed"] == "true"
    time.sleep(0.3)
    assert tenant_totals(stack)["requests"] == after["requests"]


def test_a_key_reused_with_another_body_is_refused(stack: Stack) -> None:
    key = f"reuse-{uuid.uuid4()}"
    first = _post(stack, key, _body("first question"))
    assert first.status_code == 200, first.text
    arrived = _arrived(stack)
    second = _post(stack, key, _body("another question"))
    assert second.status_code == 422, second.text
    error = second.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
    assert _arrived(stack) == arrived


def test_a_replayed_stream_parses_with_the_openai_sdk(stack: Stack) -> None:
    key = f"stream-{uuid.uuid4()}"
    client = OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=stack.api_key(),
        default_headers={"idempotency-key": key},
    )
    messages = [{"role": "user", "content": "Count to five."}]

    def text_of(stream: Any) -> tuple[str, Any]:
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        return "".join(parts), usage

    arrived = _arrived(stack)
    first = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, stream=True
    )
    first_text, first_usage = text_of(first)
    replay = client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, stream=True
    )
    assert replay.headers["idempotent-replayed"] == "true"
    replay_text, replay_usage = text_of(replay.parse())
    assert first_text and replay_text == first_text
    # The client did not ask for usage: kvgate's injected usage event is in neither.
    assert first_usage is None and replay_usage is None
    assert _arrived(stack) == arrived + 1


def test_a_cut_first_attempt_lets_the_retry_run_and_the_retry_is_kept(stack: Stack) -> None:
    key = f"cut-{uuid.uuid4()}"
    arrived = _arrived(stack)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json=_body("a long answer"),
            headers={
                **stack.auth_headers(),
                "idempotency-key": key,
                "x-sim-output-tokens": "60",
                "x-sim-itl-ms": "50",
            },
            timeout=httpx.Timeout(0.5, connect=5.0),
        )
    # The cut attempt gave the key up: the retry runs (it does not wait, nor replay a cut).
    retry = wait_until(
        lambda: _post(stack, key, _body("a long answer")),
        lambda r: r.status_code == 200,
        timeout=10,
        interval=0.2,
    )
    assert retry.status_code == 200, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert _arrived(stack) == arrived + 2
    again = _post(stack, key, _body("a long answer"))
    assert again.headers.get("idempotent-replayed") == "true" and again.content == retry.content
    assert _arrived(stack) == arrived + 2


def test_another_tenants_key_is_another_key(stack: Stack) -> None:
    """Tenant B sending the key (and body) tenant A used gets its own generation, never A's
    stored answer, and pays for it itself."""
    key = f"shared-{uuid.uuid4()}"
    first = _post(stack, key, _body("whose answer?"))
    assert first.status_code == 200, first.text
    arrived, other_before = _arrived(stack), tenant_totals(stack, "other")
    theirs = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=_body("whose answer?"),
        headers={"authorization": f"Bearer {OTHER_KEY}", "idempotency-key": key},
        timeout=TIMEOUT,
    )
    assert theirs.status_code == 200, theirs.text
    assert "idempotent-replayed" not in theirs.headers
    assert theirs.json()["id"] != first.json()["id"]
    assert _arrived(stack) == arrived + 1
    wait_until(
        lambda: tenant_totals(stack, "other"),
        lambda t: t["requests"] == other_before["requests"] + 1,
        timeout=10,
    )


def test_a_malformed_key_is_a_400(stack: Stack) -> None:
    answer = _post(stack, "x" * 300, _body())
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "Idempotency-Key"


def test_two_replicas_sharing_redis_coalesce_one_key() -> None:
    """Envoy spreads the duplicates over both kvgate processes; the key lives in Redis, so
    one generation runs and every duplicate gets its answer."""
    # A generous per-call Redis deadline: ten duplicates poll the key while the machine is
    # busy; a 0.3 s timeout would turn a slow poll into fail_closed's 503.
    with RedisStack(redis_config={"timeout_s": 2.0}) as stack:
        key = f"replicas-{uuid.uuid4()}"
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: _post(stack, key, _body(), SLOW), range(10)))
        assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
        assert len({a.content for a in answers}) == 1
        assert _arrived(stack) == 1
        totals = _settled(stack, 1)
        assert totals["requests"] == 1
