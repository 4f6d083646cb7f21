"""Process lifecycle through real Envoy: SIGTERM drains and settles, SIGHUP reloads."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from testbed.harness import Stack, sha256_hex

MODEL = "qwen2.5-demo"


@pytest.fixture
def stack() -> Iterator[Stack]:
    overrides = {"server": {"shutdown_grace_s": 1, "log_level": "DEBUG"}}
    with Stack(kvgate_overrides=overrides) as running:
        yield running


def kvgate_log_events(stack: Stack) -> list[dict[str, Any]]:
    assert stack.kvgate is not None
    events = []
    for line in stack.kvgate.log_text().splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def test_sigterm_settles_streams_in_flight(stack: Stack) -> None:
    """A stream still running when kvgate gets SIGTERM is settled (cause shutdown or
    disconnected) before the process exits, with the tokens it streamed."""
    received: list[int] = []

    def hold_stream() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 100,
            "stream": True,
        }
        headers = {**stack.auth_headers(), "x-sim-output-tokens": "100", "x-sim-stall-after": "5"}
        count = 0
        try:
            with httpx.stream(
                "POST",
                f"{stack.base_url}/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=15,
            ) as response:
                for line in response.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        count += 1
                        received.append(count)
        except httpx.HTTPError:
            pass  # the stream is cut when kvgate goes away

    client = threading.Thread(target=hold_stream)
    client.start()
    deadline = time.monotonic() + 10
    while len(received) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(received) == 5
    code = stack.stop_kvgate(timeout=20)
    client.join(timeout=20)
    assert code == 0, stack.dump_logs()
    settled = [e for e in kvgate_log_events(stack) if e.get("msg") == "settled"]
    assert len(settled) == 1, settled
    assert settled[0]["cause"] in ("shutdown", "disconnected")
    assert settled[0]["output_tokens"] == 5
    assert any(e.get("msg") == "kvgate stopped" for e in kvgate_log_events(stack))


def test_sighup_reloads_and_a_bad_file_keeps_the_old_config(stack: Stack) -> None:
    path = stack.kvgate_config_path
    config = yaml.safe_load(path.read_text())
    config["tenants"].append({"name": "late", "api_key_sha256": sha256_hex("sk-late")})
    path.write_text(yaml.safe_dump(config))
    assert stack.kvgate is not None and stack.kvgate.pid is not None
    os.kill(stack.kvgate.pid, signal.SIGHUP)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status = 0
    for _ in range(100):  # bounded: the reload runs asynchronously to the signal
        status = httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer sk-late"},
            timeout=10,
        ).status_code
        if status == 200:
            break
        time.sleep(0.05)
    assert status == 200

    path.write_text("tenants: {broken\n")
    os.kill(stack.kvgate.pid, signal.SIGHUP)
    time.sleep(0.5)
    still = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-late"},
        timeout=10,
    )
    assert still.status_code == 200
    metrics = httpx.get(stack.kvgate_metrics_url, timeout=5).text
    # The file watch may notice a change before the signal does: each reload counts once.
    for result in ("success", "failure"):
        line = next(
            m
            for m in metrics.splitlines()
            if m.startswith(f'kvgate_config_reloads_total{{result="{result}"}}')
        )
        assert float(line.split()[-1]) >= 1, line
