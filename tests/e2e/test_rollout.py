"""Rolling a gateway pod: no generation is cut, every one is settled once.

The sequence is the one deploy/kubernetes/gateway-with-sidecar.yaml runs when the pod is
deleted, with the hooks' commands read from the manifest (paths and the admin address swapped
for the stack's): at t0 both preStop hooks start, kvgate's `kvgate drain` (drains Envoy's
listeners, waits for its requests in flight, writes the done file) and Envoy's shell loop
(waits for that file). Each container gets SIGTERM when its own hook returns: kvgate, then
Envoy. Envoy runs with the manifest's `--drain-strategy` and a shorter `--drain-time-s`.

The negative control runs the old manifests' order (no kvgate preStop, so kvgate gets SIGTERM
at t0; Envoy's preStop only `sleep 5`, then SIGTERM) and shows what used to happen: new
requests get 503 while the pod is still in the endpoints, and Envoy's exit cuts the streams
in flight. Swap the new hooks for the old ones in the first test and it fails the same way.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.cli import build_parser
from testbed.harness import (
    REPO_ROOT,
    Stack,
    _bin,
    sim_reset,
    sim_stats,
    tenant_totals,
    wait_until,
)

SIDECAR = REPO_ROOT / "deploy" / "kubernetes" / "gateway-with-sidecar.yaml"
MODEL = "qwen2.5-demo"
STREAMS = 4
STREAM_TOKENS = 80
ITL_MS = 60  # 80 tokens x 60 ms: each stream runs ~5 s, longer than the drain time below
DRAIN_TIME_S = 2  # the manifest's is 5 s; shorter here so the test stays quick
OLD_ENVOY_SLEEP_S = 1.5  # the old manifest's `sleep 5`, scaled like the drain time
SHUTDOWN_GRACE_S = 10
CHAT = "/v1/chat/completions"


# --------------------------------------------------------------------------- the manifest


def pod_spec() -> dict[str, Any]:
    for doc in yaml.safe_load_all(SIDECAR.read_text(encoding="utf-8")):
        if doc and doc.get("kind") == "Deployment":
            spec: dict[str, Any] = doc["spec"]["template"]["spec"]
            return spec
    raise AssertionError(f"{SIDECAR}: no Deployment")


def container(name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec()["containers"] if c["name"] == name]
    return found


def pre_stop(name: str) -> list[str]:
    command: list[str] = container(name)["lifecycle"]["preStop"]["exec"]["command"]
    return command


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def with_flag(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


DONE_FILE = flag(pre_stop("kvgate"), "--done-file")


def test_the_manifest_hooks_fit_together() -> None:
    """The order only holds if the numbers agree: read them from the manifest."""
    spec = pod_spec()
    grace = spec["terminationGracePeriodSeconds"]
    kvgate_hook = pre_stop("kvgate")
    assert kvgate_hook[:2] == ["kvgate", "drain"]
    args = build_parser().parse_args(kvgate_hook[1:])  # the CLI accepts exactly these flags
    assert args.trigger is True
    assert args.envoy_admin == "http://127.0.0.1:9901"
    config = yaml.safe_load(
        next(
            d
            for d in yaml.safe_load_all(SIDECAR.read_text(encoding="utf-8"))
            if d and d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "kvgate-config"
        )["data"]["kvgate.yaml"]
    )
    envoy_bootstrap = yaml.safe_load(
        next(
            d
            for d in yaml.safe_load_all(SIDECAR.read_text(encoding="utf-8"))
            if d and d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "llm-gateway-envoy"
        )["data"]["envoy.yaml"]
    )
    assert envoy_bootstrap["admin"]["address"]["socket_address"]["port_value"] == 9901
    shutdown_grace = config["server"]["shutdown_grace_s"]
    # After a drain timeout kvgate still needs its grace and up to 10 s of settling.
    assert args.timeout + shutdown_grace + 10 < grace, (args.timeout, shutdown_grace, grace)

    envoy = container("envoy")
    assert flag(envoy["args"], "--drain-strategy") == "immediate"
    drain_time = int(flag(envoy["args"], "--drain-time-s"))
    assert 0 < drain_time < args.timeout
    script = pre_stop("envoy")[-1]
    assert pre_stop("envoy")[:2] == ["/bin/sh", "-c"]
    assert DONE_FILE in script
    waits = [int(w) for w in _numbers_after(script, '"$i" -lt ')]
    (extra,) = [int(w) for w in _numbers_after(script, "|| sleep ")]
    assert waits and waits[0] > args.timeout, "Envoy must outwait the drain"
    assert extra >= shutdown_grace, "after a timeout Envoy must outlive kvgate's grace"
    assert waits[0] + extra < grace

    mounts = {
        name: {m["mountPath"]: m for m in container(name)["volumeMounts"]}
        for name in ("kvgate", "envoy")
    }
    directory = str(Path(DONE_FILE).parent)
    assert directory in mounts["kvgate"] and directory in mounts["envoy"]
    assert mounts["kvgate"][directory]["name"] == mounts["envoy"][directory]["name"]
    assert not mounts["kvgate"][directory].get("readOnly")


def _numbers_after(text: str, marker: str) -> list[str]:
    found = []
    for part in text.split(marker)[1:]:
        digits = "".join(ch for ch in part[:6] if ch.isdigit())
        if digits:
            found.append(digits)
    return found


def test_envoys_hook_waits_for_the_file_and_longer_after_a_timeout(tmp_path: Path) -> None:
    done = tmp_path / "done"
    script = (
        pre_stop("envoy")[-1].replace(DONE_FILE, str(done)).replace("|| sleep 30", "|| sleep 2")
    )
    hook = subprocess.Popen(["/bin/sh", "-c", script])
    time.sleep(1.5)
    assert hook.poll() is None, "the hook returned before the drain was over"
    done.write_text("drained\n")
    assert hook.wait(timeout=5) == 0
    done.write_text("timeout\n")
    started = time.monotonic()
    assert subprocess.run(["/bin/sh", "-c", script], timeout=10, check=False).returncode == 0
    assert time.monotonic() - started >= 1.9  # the extra wait (30 s in the manifest)


# --------------------------------------------------------------------------- the stack


class GatewayPod(Stack):
    """The harness's stack with Envoy's drain flags as in the manifest."""

    def _envoy_argv(self) -> list[str]:
        argv = with_flag(super()._envoy_argv(), "--drain-time-s", str(DRAIN_TIME_S))
        return [*argv, "--drain-strategy", flag(container("envoy")["args"], "--drain-strategy")]


@pytest.fixture
def pod() -> Iterator[GatewayPod]:
    overrides = {"server": {"shutdown_grace_s": SHUTDOWN_GRACE_S, "log_level": "DEBUG"}}
    with GatewayPod(kvgate_overrides=overrides) as stack:
        yield stack


@dataclass
class StreamResult:
    status: int | None = None
    chunks: int = 0
    done: bool = False
    error: str | None = None
    ended: float = 0.0
    lines: list[str] = field(default_factory=list)


def run_stream(stack: Stack, result: StreamResult) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "write a long answer"}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }
    headers = {
        **stack.auth_headers(),
        "x-sim-output-tokens": str(STREAM_TOKENS),
        "x-sim-itl-ms": str(ITL_MS),
    }
    try:
        with httpx.stream(
            "POST", f"{stack.base_url}{CHAT}", json=body, headers=headers, timeout=30
        ) as response:
            result.status = response.status_code
            for line in response.iter_lines():
                result.lines.append(line)
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: {"):
                    result.chunks += 1
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    finally:
        result.ended = time.monotonic()


def start_streams(stack: Stack) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(stack, r)) for r in results]
    for thread in threads:
        thread.start()
    started = wait_until(
        lambda: [r.chunks for r in results], lambda c: all(n >= 3 for n in c), timeout=15
    )
    assert all(n >= 3 for n in started), (started, [r.error for r in results])
    return results, threads


def ask(stack: Stack) -> tuple[str, int | None, str | None]:
    """A short request, as a client that has not seen the endpoint removal would send it."""
    try:
        response = httpx.post(
            f"{stack.base_url}{CHAT}",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={**stack.auth_headers(), "x-sim-output-tokens": "2"},
            timeout=10,
        )
    except httpx.ConnectError:
        return ("refused", None, None)
    return ("answered", response.status_code, response.headers.get("connection"))


def ledger_delta(stack: Stack, before: dict[str, int]) -> dict[str, int]:
    now = tenant_totals(stack)
    return {key: now[key] - before[key] for key in before}


def settled_events(stack: Stack) -> list[dict[str, Any]]:
    assert stack.kvgate is not None
    events = []
    for line in stack.kvgate.log_text().splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("msg") == "settled":
                events.append(event)
    return events


# --------------------------------------------------------------------------- the rollout


def test_rolling_the_pod_completes_and_settles_every_stream(
    pod: GatewayPod, tmp_path: Path
) -> None:
    assert pod.kvgate is not None and pod.envoy is not None
    sim_reset(pod)
    before = tenant_totals(pod)
    results, threads = start_streams(pod)

    # t0: the pod is deleted; the kubelet starts both preStop hooks.
    done = tmp_path / "kvgate-drain" / "done"
    hook_log = tmp_path / "kvgate-hook.log"
    kvgate_hook = [_bin("kvgate"), *pre_stop("kvgate")[1:]]
    kvgate_hook = with_flag(kvgate_hook, "--envoy-admin", pod.envoy_admin_url)
    kvgate_hook = with_flag(kvgate_hook, "--done-file", str(done))
    kvgate_hook = with_flag(kvgate_hook, "--log-file", str(hook_log))
    envoy_script = pre_stop("envoy")[-1].replace(DONE_FILE, str(done))
    kvgate_pre_stop = subprocess.Popen(
        kvgate_hook, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    envoy_pre_stop = subprocess.Popen(["/bin/sh", "-c", envoy_script])
    # A second waiter, as a pod whose Envoy drains itself would run it in kvgate's container.
    waiter = subprocess.Popen(
        [_bin("kvgate"), "wait-drained", "--envoy-admin", pod.envoy_admin_url, "--timeout", "60"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    draining = wait_until(
        lambda: hook_log.read_text() if hook_log.exists() else "",
        lambda text: "is draining" in text,
        timeout=10,
    )
    assert "is draining" in draining, draining

    # New clients during the drain: answered (with `connection: close`) while the listeners
    # still accept, refused once they are closed. Never a 503.
    asked: list[tuple[float, tuple[str, int | None, str | None]]] = []
    while kvgate_pre_stop.poll() is None:
        asked.append((time.monotonic(), ask(pod)))
        time.sleep(0.1)
    hook_returned = time.monotonic()
    hook_err = kvgate_pre_stop.stderr.read() if kvgate_pre_stop.stderr else ""
    assert kvgate_pre_stop.returncode == 0, hook_err
    assert "Envoy drained" in hook_err and "0 requests in flight" in hook_err, hook_err

    for thread in threads:
        thread.join(timeout=5)
    # Every stream that had started ran to its end, through the drain.
    for result in results:
        assert result.error is None, result
        assert result.status == 200 and result.done, result.lines[-3:]
        assert result.chunks >= STREAM_TOKENS, result.chunks
    # The hook waited for them (Envoy counts a request done when its last byte is sent).
    assert hook_returned >= max(r.ended for r in results) - 0.5
    outcomes = [outcome for _, outcome in asked]
    assert all(
        o == ("refused", None, None) or (o[1] == 200 and o[2] == "close") for o in outcomes
    ), outcomes
    refused_at = [t for t, o in asked if o[0] == "refused"]
    assert refused_at, "the listeners never closed"
    # ...and they closed while the streams were still running: Envoy keeps those going.
    assert min(refused_at) < max(r.ended for r in results), "streams ended before the close"
    admitted_new = sum(1 for o in outcomes if o[1] == 200)

    # Before kvgate's SIGTERM (its memory store goes with it): the ledger is what was served.
    served = sim_stats(pod)["served"]
    assert len(served) == STREAMS + admitted_new, served
    assert all(record["finished"] for record in served), served
    expected = {
        "requests": len(served),
        "prompt_tokens": sum(record["prompt_tokens"] for record in served),
        "output_tokens": sum(record["completion_tokens_sent"] for record in served),
    }
    delta = wait_until(lambda: ledger_delta(pod, before), lambda d: d == expected, timeout=5)
    assert delta == expected
    assert waiter.wait(timeout=10) == 0
    waiter_err = waiter.stderr.read() if waiter.stderr else ""
    assert "kvgate wait-drained: Envoy drained" in waiter_err, waiter_err
    # kvgate was SERVING for Envoy's health check the whole time.
    assert pod.extproc_health_flags() == "healthy"

    # Steps 3 and 4: kvgate gets SIGTERM when its hook returns, Envoy when its hook does.
    assert pod.stop_kvgate(timeout=SHUTDOWN_GRACE_S + 15) == 0, pod.dump_logs()
    assert envoy_pre_stop.wait(timeout=5) == 0  # `drained`: no extra wait
    pod.envoy.stop(timeout=10)
    settled = settled_events(pod)
    assert len(settled) == STREAMS + admitted_new, settled
    assert {e["cause"] for e in settled} == {"completed"}, settled
    assert len({e["request_id"] for e in settled}) == len(settled)  # each exactly once


def test_the_old_order_cuts_streams_and_refuses_new_requests(pod: GatewayPod) -> None:
    """Negative control: kvgate without a preStop gets SIGTERM at t0, Envoy after `sleep`."""
    assert pod.kvgate is not None and pod.envoy is not None
    results, threads = start_streams(pod)
    t0 = time.monotonic()
    stopping = threading.Thread(target=pod.stop_kvgate, kwargs={"timeout": 30})
    stopping.start()
    # Still in the endpoints (the old Envoy hook is sleeping): new requests fail closed.
    refused = wait_until(lambda: ask(pod), lambda o: o[1] == 503, timeout=3)
    assert refused[1] == 503, refused
    time.sleep(max(0.0, OLD_ENVOY_SLEEP_S - (time.monotonic() - t0)))
    pod.envoy.stop(timeout=10)  # the old preStop's sleep is over: Envoy exits at once
    for thread in threads:
        thread.join(timeout=10)
    stopping.join(timeout=30)
    cut = [r for r in results if not r.done]
    assert len(cut) == STREAMS, [(r.status, r.chunks, r.done) for r in results]
    assert all(r.chunks < STREAM_TOKENS for r in cut)
    # kvgate still settles each one, with what was streamed: the generation was lost, not billed.
    settled = settled_events(pod)
    assert len(settled) == STREAMS, settled
    assert {e["cause"] for e in settled} <= {"disconnected", "shutdown"}, settled
