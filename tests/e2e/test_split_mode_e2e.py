"""kvgate's split mode through envoy/envoy-observability.yaml: admitted on the request path,
settled from the observability stream, with exact usage and nothing left in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from testbed.harness import REPO_ROOT, SimOptions, Stack

CONFIG = REPO_ROOT / "envoy" / "envoy-observability.yaml"
MODEL = "qwen2.5-demo"


@pytest.fixture(scope="module")
def split() -> Iterator[Stack]:
    with Stack(envoy_config=CONFIG, sim=SimOptions(itl_ms=2)) as running:
        yield running


def usage_today(stack: Stack) -> tuple[int, int, int]:
    report = httpx.get(f"{stack.kvgate_http_url}/admin/usage", timeout=5).json()
    today = report["tenants"][0]["today"]
    return today["requests"], today["prompt_tokens"], today["output_tokens"]


def wait_settled(stack: Stack, requests: int) -> tuple[int, int, int]:
    for _ in range(200):  # bounded: settlement follows the observed end of the response
        totals = usage_today(stack)
        if totals[0] >= requests:
            return totals
        time.sleep(0.05)
    raise AssertionError(f"not settled: {usage_today(stack)}")


def test_split_mode_settles_exactly_from_the_observed_response(split: Stack) -> None:
    before = usage_today(split)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 20,
        "stream": True,
    }
    headers = {**split.auth_headers(), "x-sim-output-tokens": "20"}
    with httpx.stream(
        "POST", f"{split.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        text = response.read().decode()
    # Nothing was injected, so the client sees exactly what it asked for: no usage event.
    assert '"choices":[]' not in text and text.rstrip().endswith("data: [DONE]")

    plain = httpx.post(
        f"{split.base_url}/v1/chat/completions",
        json={**body, "stream": False},
        headers={**split.auth_headers(), "x-sim-output-tokens": "7"},
        timeout=30,
    )
    assert plain.status_code == 200
    usage = plain.json()["usage"]

    requests, prompt, output = wait_settled(split, before[0] + 2)
    assert requests - before[0] == 2
    # A "length" finish shows every token, so counting the streamed text is exact (20);
    # the non-streamed answer carries vLLM's own usage (7).
    assert output - before[2] == 20 + usage["completion_tokens"]
    assert prompt - before[1] == 2 * usage["prompt_tokens"]
    metrics = httpx.get(split.kvgate_metrics_url, timeout=5).text
    assert 'kvgate_requests_in_flight{backend="vllm-local"} 0.0' in metrics
