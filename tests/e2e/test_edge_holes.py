"""The Envoy edge of the meter, against the real Envoy: only what kvgate admitted reaches a
backend, and no client can make Envoy retry.

Hole 1: a request Envoy forwards must have been admitted by kvgate. With HTTP/2 request
trailers Envoy hands kvgate the buffered body with end_of_stream=false; whatever kvgate
answers, Envoy routes a metered request to a backend only on kvgate's own routing header,
and answers anything kvgate did not decide with a local OpenAI-shaped 500 (`not_admitted`).

Hole 14: a client must not make Envoy retry (one admission, several generations): no
client counts as internal by what its x-forwarded-for says, and client x-envoy-* control
headers are removed, so Envoy honours none even where the operator declares private
networks and loopback internal.

Two kinds of stacks:
- the routing guard on its own: each shipped Envoy bootstrap (and the Istio sidecar
  EnvoyFilter applied to an Istio-like inbound listener), moved to loopback ports, in front
  of the vLLM simulator, with an ext_proc server that answers CONTINUE to everything and
  never decides (testbed/noop_extproc.py);
- the full stack (Envoy, kvgate, simulator) on the configs where the holes showed.
"""

from __future__ import annotations

import copy
import json
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import yaml

from testbed.harness import (
    DEFAULT_MODEL_NAME,
    DEMO_API_KEY,
    DEMO_TENANT,
    ENVOY_CONFIG,
    EXTPROC_CLUSTER,
    ManagedProcess,
    ProcessError,
    Stack,
    _bin,
    _demo_model_dir,
    free_port,
    sim_stats,
    tenant_totals,
    wait_until,
)
from tests.deploy.manifests import NOT_ADMITTED, istio_inbound_bootstrap, shipped_bootstraps

MODEL = DEFAULT_MODEL_NAME
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CAPPED_TENANT = "capped"
CAPPED_KEY = "sk-edge-capped"
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
SETTLE_TIMEOUT_S = 10.0

CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the river and the old mill."}],
    "max_tokens": 8,
}
COMPLETION_BODY: dict[str, Any] = {"model": MODEL, "prompt": "the river runs", "max_tokens": 8}

# What a hostile client sends to make Envoy retry a generation. Envoy honours x-envoy-*
# headers from internal clients: before the fix, one whose x-forwarded-for names an internal
# address; with use_remote_address, one whose own address is internal (a loopback or
# in-cluster client where the operator declared those networks internal). Both are tried.
RETRY_ME = {"x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3"}
FORWARDED_FOR = pytest.mark.parametrize(
    "forwarded_for", ["10.0.0.1", None], ids=["forged-internal-xff", "own-address"]
)


def retry_headers(stack: Stack, forwarded_for: str | None) -> dict[str, str]:
    headers = {**stack.auth_headers(), **RETRY_ME}
    if forwarded_for:
        headers["x-forwarded-for"] = forwarded_for
    return headers


# --------------------------------------------------------------------------- HTTP/2 client


@dataclass
class H2Response:
    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    reset_code: int | None = None

    def json(self) -> Any:
        return json.loads(self.body)


def h2_request(
    port: int,
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes = b"",
    *,
    trailers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> H2Response:
    """One request over cleartext HTTP/2 (prior knowledge) on a fresh connection, with
    request trailers when given (the body then does not end the stream)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        request_headers = [
            (":method", method),
            (":path", path),
            (":scheme", "http"),
            (":authority", f"127.0.0.1:{port}"),
            *((k.lower(), v) for k, v in headers.items()),
        ]
        conn.send_headers(stream, request_headers, end_stream=not body and not trailers)
        if body:
            conn.send_data(stream, body, end_stream=not trailers)
        if trailers:
            conn.send_headers(stream, list(trailers.items()), end_stream=True)
        sock.sendall(conn.data_to_send())

        response = H2Response(status=None)
        done = False
        while not done:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if getattr(event, "stream_id", None) != stream:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    response.headers = {str(k): str(v) for k, v in event.headers}
                    response.status = int(response.headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    response.body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded):
                    done = True
                elif isinstance(event, h2.events.StreamReset):
                    response.reset_code = int(event.error_code)
                    done = True
            outgoing = conn.data_to_send()
            if outgoing:
                sock.sendall(outgoing)
        return response


def chat_with_trailers(port: int, api_key: str) -> H2Response:
    return h2_request(
        port,
        "POST",
        CHAT,
        {"authorization": f"Bearer {api_key}", "content-type": "application/json"},
        json.dumps(CHAT_BODY).encode(),
        trailers={"x-client-checksum": "0123abcd"},
    )


def assert_not_admitted(status: int | None, content_type: str, body: bytes) -> None:
    assert status == 500, body
    assert content_type == "application/json", content_type
    assert json.loads(body) == NOT_ADMITTED


# --------------------------------------------------------------------------- the guard alone


def _point(cluster: dict[str, Any], port: int) -> None:
    cluster["load_assignment"] = {
        "cluster_name": cluster["name"],
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {
                                "socket_address": {"address": "127.0.0.1", "port_value": port}
                            }
                        }
                    }
                ]
            }
        ],
    }


def loopback_bootstrap(
    bootstrap: dict[str, Any], *, listen: int, admin: int, extproc: int, backend: int
) -> tuple[dict[str, Any], list[str]]:
    """The bootstrap on loopback: listener `ingress` on `listen` (others on free ports),
    kvgate's cluster on `extproc`, every model-server cluster on `backend`. Returns the
    config and the names of the model-server clusters."""
    config = copy.deepcopy(bootstrap)
    config["admin"]["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": admin}}
    for listener in config["static_resources"]["listeners"]:
        port = listen if listener["name"] == "ingress" else free_port()
        listener["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    backends = []
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == EXTPROC_CLUSTER:
            _point(cluster, extproc)
        elif cluster["name"] == "envoy_admin":
            _point(cluster, admin)
        elif cluster.get("type") == "ORIGINAL_DST":
            # A pool's cluster has no endpoints to move: it connects only where kvgate's
            # x-kvgate-destination says, and only kvgate's x-kvgate-backend routes to it.
            continue
        else:
            cluster["type"] = "STATIC"
            cluster.pop("dns_lookup_family", None)
            _point(cluster, backend)
            backends.append(cluster["name"])
    return config, backends


def guard_configs() -> dict[str, dict[str, Any]]:
    configs = shipped_bootstraps()
    configs["deploy/istio/envoyfilter-sidecar.yaml on an Istio inbound"] = istio_inbound_bootstrap()
    return configs


@pytest.fixture(scope="module")
def backend_and_noop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """The simulator and the no-op ext_proc server, shared by the guard tests."""
    log_dir = tmp_path_factory.mktemp("edge-guard")
    sim_port, noop_port = free_port(), free_port()
    sim = ManagedProcess(
        "sim",
        [
            _bin("vllm-sim"),
            "--model-dir",
            str(_demo_model_dir()),
            "--served-model-name",
            MODEL,
            "--port",
            str(sim_port),
        ],
        log_dir=log_dir,
    )
    noop = ManagedProcess(
        "noop-extproc",
        [sys.executable, "-m", "testbed.noop_extproc", "--listen", f"127.0.0.1:{noop_port}"],
        log_dir=log_dir,
    )
    with sim, noop:
        sim.wait_http(f"http://127.0.0.1:{sim_port}/health", timeout=60)
        noop.wait_tcp(noop_port, timeout=30)
        yield sim_port, noop_port


def _wait_extproc_healthy(envoy: ManagedProcess, admin: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        envoy.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=timeout)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=5) as resp:
            last = resp.read().decode()
        if any(
            line.startswith(f"{EXTPROC_CLUSTER}::") and line.endswith("::health_flags::healthy")
            for line in last.splitlines()
        ):
            return
        time.sleep(0.1)
    raise ProcessError(f"the ext_proc endpoint never became healthy\n{envoy.describe()}")


def _upstream_requests(admin: int, clusters: list[str]) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=upstream_rq_total") as r:
        text = r.read().decode()
    total = 0
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if any(name == f"cluster.{c}.upstream_rq_total" for c in clusters):
            total += int(value)
    return total


@pytest.mark.parametrize("name", sorted(guard_configs()))
def test_guard_forwards_nothing_kvgate_did_not_decide(
    name: str, backend_and_noop: tuple[int, int], tmp_path: Path
) -> None:
    """An ext_proc server that lets everything through but never decides (sets no kvgate
    header): every request gets Envoy's local JSON 500, none reaches the model server, not
    even with forged kvgate headers or HTTP/2 trailers."""
    sim_port, noop_port = backend_and_noop
    listen, admin = free_port(), free_port()
    config, backends = loopback_bootstrap(
        guard_configs()[name], listen=listen, admin=admin, extproc=noop_port, backend=sim_port
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    sim_before = sim_stats_at(sim_port)["requests_total"]
    with ManagedProcess("envoy", argv, log_dir=tmp_path) as envoy:
        _wait_extproc_healthy(envoy, admin)
        base = f"http://127.0.0.1:{listen}"
        auth = {"authorization": f"Bearer {DEMO_API_KEY}"}
        forged = {"x-kvgate-backend": backends[0], "x-kvgate-tenant": DEMO_TENANT}
        cases: list[tuple[str, str, dict[str, str], dict[str, Any] | None]] = [
            ("POST", CHAT, auth, CHAT_BODY),
            ("POST", COMPLETIONS, auth, COMPLETION_BODY),
            ("POST", CHAT, {**auth, **forged}, CHAT_BODY),
            ("POST", f"{COMPLETIONS}?stream=1", {**auth, **forged}, COMPLETION_BODY),
            ("GET", "/v1/models", auth, None),
            ("GET", "/v1/models", {**auth, **forged}, None),
            ("GET", f"/v1/models/{MODEL}", {**auth, **forged}, None),
            ("POST", "/v1/embeddings", auth, {"model": MODEL, "input": "x"}),
            ("POST", "/metrics", auth, {"model": MODEL}),
        ]
        # The Istio sidecar sends vLLM's own GET /metrics, /health, ... past kvgate (ext_proc
        # disabled on that route: Prometheus and capacity discovery scrape them); every
        # other config guards them like any path.
        probes_bypass = "envoyfilter-sidecar" in name
        if not probes_bypass:
            cases.append(("GET", "/metrics", {}, None))
        with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as client:
            for method, target, headers, body in cases:
                resp = client.request(method, target, headers=headers, json=body)
                assert_not_admitted(
                    resp.status_code, resp.headers.get("content-type", ""), resp.content
                )
            if probes_bypass:
                assert client.get("/metrics").status_code == 200
        trailers = chat_with_trailers(listen, DEMO_API_KEY)
        assert_not_admitted(
            trailers.status, trailers.headers.get("content-type", ""), trailers.body
        )
        expected_upstream = 1 if probes_bypass else 0  # the one GET /metrics
        assert _upstream_requests(admin, backends) == expected_upstream, (
            "a request reached a model server"
        )
    assert sim_stats_at(sim_port)["requests_total"] == sim_before


def sim_stats_at(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as resp:
        stats: dict[str, Any] = json.loads(resp.read().decode())
    return stats


# --------------------------------------------------------------------------- full stacks


def _operator_internal(config: dict[str, Any]) -> dict[str, Any]:
    """envoy/envoy.yaml as an operator might run it: private networks and loopback declared
    internal (internal_address_config), the setting under which Envoy honours x-envoy-*
    headers from a client."""
    config = copy.deepcopy(config)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    hcm["internal_address_config"] = {
        "cidr_ranges": [
            {"address_prefix": "10.0.0.0", "prefix_len": 8},
            {"address_prefix": "127.0.0.0", "prefix_len": 8},
        ]
    }
    return config


def _envoy_yaml() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(ENVOY_CONFIG.read_text(encoding="utf-8"))
    return loaded


STACK_CONFIGS = {
    "envoy.yaml": lambda: _envoy_yaml(),
    "envoy.yaml+internal-networks": lambda: _operator_internal(_envoy_yaml()),
    "istio-sidecar-inbound": istio_inbound_bootstrap,
}


@pytest.fixture(scope="module", params=sorted(STACK_CONFIGS))
def edge_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    src = tmp_path_factory.mktemp("edge-config") / "envoy.yaml"
    src.write_text(yaml.safe_dump(STACK_CONFIGS[request.param](), sort_keys=False), "utf-8")
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": DEMO_API_KEY},
            {"name": CAPPED_TENANT, "api_key": CAPPED_KEY, "limits": {"rpm": 1}},
        ],
        envoy_config=src,
    ) as stack:
        yield stack


@dataclass(frozen=True)
class Counts:
    """The tenant's ledger and the simulator's engine, side by side."""

    ledger: dict[str, int]
    engine_requests: int
    engine_prompt: int
    engine_output: int

    @classmethod
    def now(cls, stack: Stack, tenant: str = DEMO_TENANT) -> Counts:
        stats = sim_stats(stack)
        return cls(
            tenant_totals(stack, tenant),
            int(stats["requests_total"]),
            int(stats["prompt_tokens_total"]),
            int(stats["completion_tokens_total"]),
        )

    def minus(self, before: Counts) -> dict[str, int]:
        return {
            "ledger_requests": self.ledger["requests"] - before.ledger["requests"],
            "ledger_prompt": self.ledger["prompt_tokens"] - before.ledger["prompt_tokens"],
            "ledger_output": self.ledger["output_tokens"] - before.ledger["output_tokens"],
            "engine_requests": self.engine_requests - before.engine_requests,
            "engine_prompt": self.engine_prompt - before.engine_prompt,
            "engine_output": self.engine_output - before.engine_output,
        }


def settled_delta(stack: Stack, before: Counts, tenant: str = DEMO_TENANT) -> dict[str, int]:
    """The change since `before` once the simulator is idle and the ledger has caught up
    with what it served (or the timeout passed: the caller's assertion shows the values)."""

    def probe() -> dict[str, int]:
        return Counts.now(stack, tenant).minus(before)

    def done(delta: dict[str, int]) -> bool:
        idle = sim_stats(stack)["running"] == 0 and sim_stats(stack)["waiting"] == 0
        return idle and delta["ledger_requests"] >= delta["engine_requests"]

    wait_until(probe, done, timeout=SETTLE_TIMEOUT_S)
    time.sleep(0.3)  # a late duplicate or a late retry would show now
    return probe()


def assert_charged_as_served(delta: dict[str, int]) -> None:
    assert delta["engine_requests"] == 1, delta
    assert delta["ledger_requests"] == 1, delta
    assert delta["ledger_prompt"] == delta["engine_prompt"] > 0, delta
    assert delta["ledger_output"] == delta["engine_output"] > 0, delta


def test_guarded_stack_still_serves(edge_stack: Stack) -> None:
    """The guard lets through what kvgate decided: an admitted chat (charged as served) and
    the models list."""
    models = httpx.get(
        f"{edge_stack.base_url}/v1/models", headers=edge_stack.auth_headers(), timeout=HTTP_TIMEOUT
    )
    assert models.status_code == 200, models.text
    assert models.json()["data"][0]["id"] == MODEL
    before = Counts.now(edge_stack)
    resp = httpx.post(
        f"{edge_stack.base_url}{CHAT}",
        json=CHAT_BODY,
        headers=edge_stack.auth_headers(),
        timeout=HTTP_TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert_charged_as_served(settled_delta(edge_stack, before))


def test_trailers_never_reach_a_backend_unreserved(edge_stack: Stack) -> None:
    """Hole 1: a chat over HTTP/2 with request trailers either is served and charged as
    served, or is refused with an OpenAI-shaped error without reaching the model server."""
    before = Counts.now(edge_stack)
    resp = chat_with_trailers(edge_stack.listen_port, DEMO_API_KEY)
    delta = settled_delta(edge_stack, before)
    assert resp.reset_code is None, resp
    if delta["engine_requests"]:
        assert resp.status == 200, resp.body
        assert_charged_as_served(delta)
    else:
        assert resp.status is not None and resp.status >= 400, resp
        assert resp.headers.get("content-type") == "application/json", resp.headers
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert delta["ledger_output"] == 0, delta


def test_trailers_request_is_admitted_and_charged(edge_stack: Stack) -> None:
    """Hole 1, kvgate's side: the body message is the admission point even when trailers
    follow, so the request is served and charged exactly what the engine did."""
    before = Counts.now(edge_stack)
    resp = chat_with_trailers(edge_stack.listen_port, DEMO_API_KEY)
    assert resp.status == 200, resp.body
    assert resp.json()["usage"]["completion_tokens"] > 0
    assert_charged_as_served(settled_delta(edge_stack, before))


def test_trailers_do_not_escape_tenant_limits(edge_stack: Stack) -> None:
    """A tenant over its RPM limit is refused by kvgate (429) with or without trailers, and
    the model server never sees the request."""
    auth = {"authorization": f"Bearer {CAPPED_KEY}"}
    first = httpx.post(
        f"{edge_stack.base_url}{CHAT}", json=CHAT_BODY, headers=auth, timeout=HTTP_TIMEOUT
    )
    assert first.status_code == 200, first.text  # the one request of the minute
    before = Counts.now(edge_stack, CAPPED_TENANT)
    resp = chat_with_trailers(edge_stack.listen_port, CAPPED_KEY)
    delta = settled_delta(edge_stack, before, CAPPED_TENANT)
    assert resp.status == 429, resp.body
    assert resp.json()["error"]["code"] == "rpm_exceeded", resp.body
    assert delta["engine_requests"] == 0, delta
    assert delta["ledger_requests"] == 0, delta


def _backend_upstream(stack: Stack) -> dict[str, int]:
    stats = stack.envoy_stats(f"cluster.{stack.backends[0]['name']}.upstream_rq_")
    prefix = f"cluster.{stack.backends[0]['name']}."
    return {k.removeprefix(prefix): v for k, v in stats.items()}


@FORWARDED_FOR
def test_forged_retry_headers_do_not_retry_a_failed_generation(
    edge_stack: Stack, forwarded_for: str | None
) -> None:
    """Hole 14: a client asks Envoy to retry 5xx three times; the model server answers 503.
    Envoy sends the request to it exactly once."""
    before = _backend_upstream(edge_stack)
    resp = httpx.post(
        f"{edge_stack.base_url}{CHAT}",
        json=CHAT_BODY,
        headers={**retry_headers(edge_stack, forwarded_for), "x-sim-error": "503"},
        timeout=HTTP_TIMEOUT,
    )
    assert resp.status_code == 503, resp.text
    time.sleep(0.5)  # a retry would have been sent by now (Envoy's backoff starts at 25 ms)
    after = _backend_upstream(edge_stack)
    assert after["upstream_rq_total"] - before["upstream_rq_total"] == 1, after
    assert after["upstream_rq_retry"] == before["upstream_rq_retry"], after


@FORWARDED_FOR
def test_forged_retry_headers_do_not_multiply_generations(
    edge_stack: Stack, forwarded_for: str | None
) -> None:
    """Hole 14 on the GPU: with retry-on 5xx and a 300 ms per-try timeout, a generation
    that takes 1 s would be started four times under one admission (or cut at 300 ms). The
    engine sees exactly one generation, it completes, and the ledger charges what it
    served."""
    before = Counts.now(edge_stack)
    resp = httpx.post(
        f"{edge_stack.base_url}{CHAT}",
        json=CHAT_BODY,
        headers={
            **retry_headers(edge_stack, forwarded_for),
            "x-envoy-upstream-rq-per-try-timeout-ms": "300",
            "x-sim-ttft-ms": "1000",
        },
        timeout=HTTP_TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert_charged_as_served(settled_delta(edge_stack, before))
