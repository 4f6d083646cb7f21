"""The exact-match response cache end to end: client -> real Envoy -> kvgate -> simulator.

Whether the backend worked is read from the simulator's own request record; what was
charged from kvgate's ledger.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from testbed.harness import (
    DEFAULT_MODEL_NAME,
    Stack,
    assert_free_cache_hit_booked,
    kvgate_metrics,
    sdk_stream_text,
    tenant_totals,
    wait_until,
)
from testbed.redis_harness import RedisStack

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
OTHER_KEY = "sk-cache-other"
CHARGED_KEY = "sk-cache-charged"


def _tenants() -> list[dict[str, Any]]:
    return [
        {"name": "demo", "api_key": "sk-kvgate-demo"},
        {"name": "other", "api_key": OTHER_KEY},
        {"name": "charged", "api_key": CHARGED_KEY},
    ]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=_tenants(), kvgate_overrides={"response_cache": {"enabled": True}}
    ) as running:
        yield running


def _body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }


def _post(
    stack: Stack, body: dict[str, Any], key: str = "sk-kvgate-demo", **headers: str
) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=TIMEOUT,
    )


def _arrived(stack: Stack) -> int:
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()
    return sum(1 for r in records["requests"] if r["path"] == "/v1/chat/completions")


def _stored(stack: Stack, body: dict[str, Any], key: str = "sk-kvgate-demo") -> httpx.Response:
    """Send once and wait until the answer is in the cache (it is stored at settlement)."""
    first = _post(stack, body, key)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvgate-cache"] == "miss"
    return first


def test_a_repeated_deterministic_request_is_answered_without_the_backend(stack: Stack) -> None:
    body = _body(f"What is the capital of France? {uuid.uuid4()}")
    first = _stored(stack, body)
    arrived, before = _arrived(stack), tenant_totals(stack, cache=True)
    hit = wait_until(
        lambda: _post(stack, body),
        lambda r: r.headers.get("x-kvgate-cache") == "hit",
        timeout=5,
        interval=0.1,
    )
    assert hit.status_code == 200 and hit.content == first.content
    assert _arrived(stack) == arrived
    # hit_charge: free -> no request is charged; the ledger records the hit and the tokens
    # it saved.
    made = assert_free_cache_hit_booked(stack, before, first.json())
    saved = kvgate_metrics(stack).total("kvgate_response_cache_saved_tokens_total", tenant="demo")
    assert saved >= made


def test_a_replayed_stream_parses_with_the_openai_sdk(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key())
    question = f"Count to three. {uuid.uuid4()}"

    def run(include_usage: bool) -> tuple[str, Any, str]:
        response = client.chat.completions.with_raw_response.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
        text, usage = sdk_stream_text(response.parse())
        return text, usage, response.headers["x-kvgate-cache"]

    text, usage, result = run(include_usage=False)
    assert result == "miss" and usage is None
    arrived = _arrived(stack)
    replay = wait_until(lambda: run(include_usage=False), lambda r: r[2] == "hit", timeout=5)
    assert replay == (text, None, "hit")
    assert _arrived(stack) == arrived
    # Asking for usage is another request (another entry): usage only where asked.
    with_usage = run(include_usage=True)
    assert with_usage[2] == "miss" and with_usage[1] is not None


def test_sampled_requests_bypass_the_cache(stack: Stack) -> None:
    body = _body(f"Write a poem. {uuid.uuid4()}", temperature=0.7)
    arrived = _arrived(stack)
    answers = [_post(stack, body) for _ in range(2)]
    assert [a.headers["x-kvgate-cache"] for a in answers] == ["bypass", "bypass"]
    assert _arrived(stack) == arrived + 2


def test_failed_and_cut_answers_are_never_stored(stack: Stack) -> None:
    """A 500 and a stream cut mid-answer leave nothing in the cache: the same request
    again reaches the backend (a miss, or a bypass while the failed attempt's entry is
    still being given up) and is never a hit."""
    failed = _body(f"fails {uuid.uuid4()}")
    assert _post(stack, failed, **{"x-sim-error": "500"}).status_code == 500
    arrived = _arrived(stack)
    again = _post(stack, failed)
    assert again.status_code == 200, again.text
    assert again.headers.get("x-kvgate-cache") in ("miss", "bypass"), dict(again.headers)
    assert _arrived(stack) == arrived + 1
    cut = _body(f"cut {uuid.uuid4()}", stream=True)
    status, raw = _cut_stream(stack, cut)
    # Cut before Envoy passed the headers on: its JSON 502; after: a broken stream.
    assert status == 502 or (status == 200 and b"[DONE]" not in raw), (status, raw[:300])
    arrived = _arrived(stack)
    retry = _post(stack, cut)
    assert retry.headers.get("x-kvgate-cache") in ("miss", "bypass"), dict(retry.headers)
    assert _arrived(stack) == arrived + 1


def _cut_stream(stack: Stack, body: dict[str, Any]) -> tuple[int, bytes]:
    """A stream the engine cuts after 3 tokens, read until the connection closes or goes
    silent (Envoy closes an HTTP/1.1 client only after its delayed_close_timeout)."""
    raw = b""
    with (
        httpx.Client(timeout=httpx.Timeout(10.0, read=0.3)) as client,
        client.stream(
            "POST",
            f"{stack.base_url}/v1/chat/completions",
            json=body,
            headers={
                **stack.auth_headers(),
                "x-sim-output-tokens": "20",
                "x-sim-abort-after": "3",
            },
        ) as response,
    ):
        try:
            for part in response.iter_raw():
                raw += part
        except (httpx.RemoteProtocolError, httpx.ReadTimeout):
            pass
        return response.status_code, raw


def test_entries_are_per_tenant(stack: Stack) -> None:
    body = _body(f"Tenant-scoped question {uuid.uuid4()}")
    _stored(stack, body)
    wait_until(
        lambda: _post(stack, body).headers["x-kvgate-cache"], lambda r: r == "hit", timeout=5
    )
    arrived = _arrived(stack)
    theirs = _post(stack, body, OTHER_KEY)
    assert theirs.headers["x-kvgate-cache"] == "miss" and _arrived(stack) == arrived + 1


def test_a_charged_hit_is_booked_like_the_request_it_replays() -> None:
    with Stack(
        tenants=_tenants(),
        kvgate_overrides={"response_cache": {"enabled": True, "hit_charge": "full"}},
    ) as stack:
        body = _body(f"Charged question {uuid.uuid4()}")
        first = _stored(stack, body, CHARGED_KEY)
        totals = wait_until(
            lambda: tenant_totals(stack, "charged"), lambda t: t["requests"] == 1, timeout=10
        )
        hit = wait_until(
            lambda: _post(stack, body, CHARGED_KEY),
            lambda r: r.headers.get("x-kvgate-cache") == "hit",
            timeout=5,
        )
        assert hit.content == first.content
        after = wait_until(
            lambda: tenant_totals(stack, "charged"), lambda t: t["requests"] == 2, timeout=10
        )
        assert after["prompt_tokens"] == 2 * totals["prompt_tokens"]
        assert after["output_tokens"] == 2 * totals["output_tokens"]


def test_replicas_sharing_redis_share_the_entries() -> None:
    with RedisStack(
        kvgate_overrides={"response_cache": {"enabled": True}}, redis_config={"timeout_s": 2.0}
    ) as stack:
        body = _body(f"Shared question {uuid.uuid4()}")
        _stored(stack, body)
        answers = [
            wait_until(
                lambda: _post(stack, body),
                lambda r: r.headers.get("x-kvgate-cache") == "hit",
                timeout=5,
            )
            for _ in range(4)  # Envoy spreads them over both replicas
        ]
        assert all(a.headers["x-kvgate-cache"] == "hit" for a in answers)
        assert _arrived(stack) == 1
