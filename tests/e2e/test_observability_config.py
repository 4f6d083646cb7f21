"""envoy/envoy-observability.yaml runs for real: the request path through kvgate as usual,
the response path observed by a second ext_proc filter in observability mode.

These checks cover the Envoy side of the split (test_envoy_configs.py validates the file):
admission still fails closed on the request path, answers reach the client whole, and the
response really goes to kvgate over a second ext_proc stream. What kvgate itself does with
that stream (settlement from it, no injected usage event) is kvgate's split mode, not checked
here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from testbed.harness import DEFAULT_MODEL_NAME, REPO_ROOT, SimOptions, Stack

OBSERVABILITY_CONFIG = REPO_ROOT / "envoy" / "envoy-observability.yaml"
CHAT = "/v1/chat/completions"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# The observability filter's stats: http.<hcm stat_prefix>.ext_proc.<filter stat_prefix>.
OBSERVE_STATS = "http.ingress.ext_proc.observe."


@pytest.fixture(scope="module")
def split_stack() -> Iterator[Stack]:
    with Stack(envoy_config=OBSERVABILITY_CONFIG, sim=SimOptions(itl_ms=2)) as running:
        yield running


def _chat(max_tokens: int, *, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me about the old town."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


def _observed_streams(stack: Stack) -> int:
    return stack.envoy_stats(OBSERVE_STATS).get(f"{OBSERVE_STATS}streams_started", 0)


def test_request_path_still_fails_closed(split_stack: Stack) -> None:
    resp = httpx.post(
        f"{split_stack.base_url}{CHAT}",
        json=_chat(8, stream=False),
        headers={"authorization": "Bearer sk-not-a-key"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["code"] == "invalid_api_key"


def test_non_streamed_answer_is_whole_and_observed(split_stack: Stack) -> None:
    before = _observed_streams(split_stack)
    resp = httpx.post(
        f"{split_stack.base_url}{CHAT}",
        json=_chat(12, stream=False),
        headers=split_stack.auth_headers(),
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 12
    # Routed by kvgate's request-path reply, as with envoy.yaml.
    assert resp.headers.get("x-request-id")
    assert _observed_streams(split_stack) == before + 1


def test_streamed_answer_reaches_the_client_whole(split_stack: Stack) -> None:
    before = _observed_streams(split_stack)
    with httpx.stream(
        "POST",
        f"{split_stack.base_url}{CHAT}",
        json=_chat(12, stream=True),
        headers=split_stack.auth_headers(),
        timeout=TIMEOUT,
    ) as resp:
        assert resp.status_code == 200
        events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    assert len(text.split()) == 12  # one word per token in the simulator's output
    assert _observed_streams(split_stack) == before + 1
    # Observability mode never fails a response, and nothing timed out waiting for kvgate.
    stats = split_stack.envoy_stats(OBSERVE_STATS)
    assert stats.get(f"{OBSERVE_STATS}streams_failed", 0) == 0
    assert stats.get(f"{OBSERVE_STATS}message_timeouts", 0) == 0
