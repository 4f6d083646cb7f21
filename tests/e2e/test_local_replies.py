"""Every error a client gets is OpenAI-shaped JSON, Envoy's own local replies included.

Envoy answers some requests itself: 413 over the 8 MiB request buffer, 503 when kvgate or the
backend cannot be reached, 504 when kvgate misses its message deadline, 502/503 when the
backend cuts the connection, 431/400 from the HTTP codec. Its bodies are plain text, which the
OpenAI SDKs cannot parse; the HCM's `local_reply_config` in every shipped bootstrap turns them
into `{"error": {"message", "type", "param", "code"}}` with content-type application/json.
kvgate's own ImmediateResponses (401, 400, 404, 429, the usage report), the backend's errors
and the routing guard's not_admitted 500 (tests/e2e/test_edge_holes.py) must arrive exactly
as they did before.

Real Envoy + kvgate + the vLLM simulator. `KVGATE_LOCAL_REPLY_ENVOY_CONFIG=<path>` runs the
same tests against another bootstrap (e.g. the pre-local_reply_config envoy.yaml, on which
every test of Envoy's own replies fails).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.extproc.session import USAGE_PATH
from kvgate.openai import errors as api_errors
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    DEMO_API_KEY,
    DEMO_TENANT,
    ENVOY_CONFIG,
    ManagedProcess,
    Stack,
    _bin,
    free_port,
    render_envoy_config,
    wait_until,
)

CONFIG = Path(os.environ.get("KVGATE_LOCAL_REPLY_ENVOY_CONFIG", ENVOY_CONFIG))
MODEL = DEFAULT_MODEL_NAME
CHAT = "/v1/chat/completions"
CAPPED_TENANT = "capped"
CAPPED_KEY = "sk-local-replies-capped"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the river and the old mill."}],
    "max_tokens": 4,
}
BUFFER_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": DEMO_API_KEY},
            {"name": CAPPED_TENANT, "api_key": CAPPED_KEY, "limits": {"rpm": 1}},
        ],
        envoy_config=CONFIG,
    ) as running:
        yield running


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as c:
        yield c


def assert_openai_error(
    resp: httpx.Response, *, statuses: set[int], code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped JSON error: the status class decides the type."""
    assert resp.status_code in statuses, (resp.status_code, resp.content)
    assert resp.headers.get("content-type") == "application/json", (
        resp.headers.get("content-type"),
        resp.content,
    )
    doc = json.loads(resp.content)
    assert set(doc) == {"error"}, doc
    error: dict[str, Any] = doc["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] is None, error
    assert isinstance(error["message"], str) and error["message"], error
    expected_type = "invalid_request_error" if resp.status_code < 500 else "server_error"
    assert error["type"] == expected_type, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_kvgate_body(resp: httpx.Response) -> None:
    """Exactly what kvgate serialised: compact JSON, kvgate's own key order, its content-type
    (a local_reply_config mapper would re-serialise it, sort the keys, add a newline)."""
    assert resp.headers.get("content-type") == "application/json", resp.headers
    doc = json.loads(resp.content)
    assert resp.content == json.dumps(doc, separators=(",", ":")).encode(), resp.content
    if "error" in doc:
        assert list(doc["error"]) == ["message", "type", "param", "code"], resp.content


def details_of(stack: Stack, resp: httpx.Response) -> str:
    rid = resp.headers["x-request-id"]
    entry = stack.wait_access_log(lambda e: e["request_id"] == rid)
    return str(entry["response_code_details"])


# --------------------------------------------------------------------------- pass unchanged


def test_kvgate_replies_pass_unchanged(stack: Stack, client: httpx.Client) -> None:
    """kvgate's ImmediateResponses: byte for byte what kvgate built."""
    auth = stack.auth_headers()

    missing = client.post(CHAT, json=CHAT_BODY)
    assert missing.status_code == 401
    assert missing.content == api_errors.missing_api_key().to_body()
    assert_kvgate_body(missing)

    wrong_key = client.post(CHAT, headers={"authorization": "Bearer sk-nope"}, json=CHAT_BODY)
    assert wrong_key.status_code == 401
    assert wrong_key.content == api_errors.invalid_api_key().to_body()

    unknown = client.post(CHAT, headers=auth, json={**CHAT_BODY, "model": "no-such-model"})
    assert unknown.status_code == 404
    assert unknown.content == api_errors.model_not_found("no-such-model").to_body()

    bad_json = client.post(
        CHAT, headers={**auth, "content-type": "application/json"}, content=b"{nope"
    )
    assert bad_json.status_code == 400
    assert_kvgate_body(bad_json)
    assert json.loads(bad_json.content)["error"]["code"] == "invalid_json"

    capped = {"authorization": f"Bearer {CAPPED_KEY}"}
    assert client.post(CHAT, headers=capped, json=CHAT_BODY).status_code == 200
    limited = client.post(CHAT, headers=capped, json=CHAT_BODY)
    assert limited.status_code == 429
    assert_kvgate_body(limited)
    assert json.loads(limited.content)["error"]["code"] == "rpm_exceeded"
    assert limited.headers.get("retry-after"), "kvgate's retry-after is kept"

    usage = client.get(USAGE_PATH, headers=auth)
    assert usage.status_code == 200
    assert_kvgate_body(usage)
    assert json.loads(usage.content)["object"] == "kvgate.usage"

    for resp in (missing, wrong_key, unknown, bad_json, limited, usage):
        assert details_of(stack, resp).startswith("kvgate_")


def test_backend_error_passes_unchanged(stack: Stack, client: httpx.Client) -> None:
    """vLLM's own JSON errors are upstream responses, not local replies."""
    headers = {"x-sim-error": "400"}
    via_envoy = client.post(CHAT, headers={**stack.auth_headers(), **headers}, json=CHAT_BODY)
    direct = httpx.post(f"{stack.sim_url}{CHAT}", headers=headers, json=CHAT_BODY, timeout=30)
    assert via_envoy.status_code == direct.status_code == 400
    assert via_envoy.content == direct.content
    assert via_envoy.headers["content-type"] == direct.headers["content-type"]
    assert details_of(stack, via_envoy) == "via_upstream"


# --------------------------------------------------------------------------- Envoy's own replies


def _oversized_chat() -> bytes:
    filler = "a" * (BUFFER_LIMIT + (1 << 20))  # 9 MiB of prompt
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": filler}], "max_tokens": 1}
    ).encode()


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_body_over_the_buffer_is_413_json(stack: Stack, http2: bool) -> None:
    """Over HTTP/2 Envoy may answer and reset the stream while the client is still sending
    the body; the client library then fails on its own side before reading the answer. That
    race is not under the test's control: a try that ends so is repeated (bounded)."""
    headers = {**stack.auth_headers(), "content-type": "application/json"}
    resp: httpx.Response | None = None
    for _ in range(5):
        with httpx.Client(
            base_url=stack.base_url, timeout=TIMEOUT, http1=not http2, http2=http2
        ) as client:
            try:
                resp = client.post(CHAT, headers=headers, content=_oversized_chat())
                break
            except (httpx.LocalProtocolError, httpx.RemoteProtocolError):
                if not http2:
                    raise
    assert resp is not None, "every try was reset before its answer could be read"
    assert resp.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert_openai_error(resp, statuses={413}, code="payload_too_large")
    assert details_of(stack, resp) == "request_payload_too_large"


def test_upstream_reset_is_json(stack: Stack, client: httpx.Client) -> None:
    """The backend cuts the connection before answering a non-streamed request."""
    headers = {**stack.auth_headers(), "x-sim-abort-after": "0"}
    resp = client.post(CHAT, headers=headers, json=CHAT_BODY)
    error = assert_openai_error(resp, statuses={502, 503})
    assert error["code"] in ("upstream_unavailable", "upstream_error")
    assert details_of(stack, resp).startswith("upstream_reset_before_response_started")


def _signal_kvgate(stack: Stack, sig: signal.Signals) -> None:
    assert stack.kvgate is not None and stack.kvgate.pid is not None
    os.killpg(os.getpgid(stack.kvgate.pid), sig)


def test_extproc_message_timeout_is_504_json(stack: Stack, client: httpx.Client) -> None:
    """kvgate frozen (SIGSTOP) past the 2 s message_timeout: Envoy answers 504 itself."""
    _signal_kvgate(stack, signal.SIGSTOP)
    try:
        resp = client.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
    finally:
        _signal_kvgate(stack, signal.SIGCONT)
    assert_openai_error(resp, statuses={504}, code="gateway_timeout")
    assert resp.headers.get("retry-after") == "1"  # waiting helps: say so
    assert details_of(stack, resp) == "ext_proc_error_per-message_timeout_exceeded"
    stack.wait_extproc_healthy(timeout=30)


def test_kvgate_down_is_503_json(stack: Stack) -> None:
    """kvgate gone: refused connections at once, then no healthy ext_proc endpoint."""
    stack.kill_kvgate()
    try:
        with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as client:
            refused = client.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
            assert_openai_error(refused, statuses={503}, code="upstream_unavailable")
            assert refused.headers.get("retry-after") == "1"
            assert details_of(stack, refused).startswith("ext_proc_error_gRPC_error_14")
            flags = wait_until(stack.extproc_health_flags, lambda f: f != "healthy", timeout=20)
            assert flags != "healthy", "Envoy never marked kvgate unhealthy"
            unhealthy = client.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
            assert_openai_error(unhealthy, statuses={503}, code="upstream_unavailable")
            assert unhealthy.headers.get("retry-after") == "1"
    finally:
        stack.start_kvgate()
        # Requests must pass kvgate again before the next test's request.
        stack.wait_extproc_serving(timeout=30)


def test_backend_down_is_json(stack: Stack) -> None:
    """The simulator killed: Envoy's connect failure to the admitted backend."""
    # kvgate must be admitting (an earlier test may have restarted it): this is about the
    # backend, not about the ext_proc cluster.
    stack.wait_extproc_serving(timeout=30)
    name = stack.backends[0]["name"]
    sim = stack.sims[name]
    sim.kill()
    try:
        with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as client:
            resp = client.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
        error = assert_openai_error(resp, statuses={502, 503})
        assert error["code"] in ("upstream_unavailable", "upstream_error")
        # A connect failure; a pooled connection the kill cut may show as a reset instead.
        assert details_of(stack, resp).startswith("upstream_reset_before_response_started")
    finally:
        sim.start()
        sim.wait_http(f"{stack.sim_urls[name]}/health", timeout=60)


# --------------------------------------------------------------------------- codec errors


def _raw_http1(port: int, request: bytes) -> bytes:
    """Send raw bytes, read until Envoy closes (no half-close: Envoy treats it as a reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data


def _parse_raw(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


BAD_REQUESTS = {
    "headers-too-large": (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n",
        431,
        "request_headers_too_large",
    ),
    "malformed": (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", 400, "invalid_request"),
}


def _assert_raw_error(data: bytes, status: int, code: str) -> None:
    got, headers, body = _parse_raw(data)
    resp = httpx.Response(got, headers={"content-type": headers.get("content-type", "")})
    resp._content = body[: int(headers["content-length"])]
    assert_openai_error(resp, statuses={status}, code=code)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_codec_errors_are_json(case: str, stack: Stack, tmp_path: Path) -> None:
    """HTTP/1 codec errors (431 headers too large, 400 malformed). With the ext_proc filter in
    the chain Envoy 1.40 closes the connection without writing its reply (0 bytes, on the old
    config as well): never text/plain there. Without ext_proc (the same HCM otherwise) the
    reply is written, and must be the mappers' JSON."""
    request, status, code = BAD_REQUESTS[case]
    data = _raw_http1(stack.listen_port, request)
    if data:
        _assert_raw_error(data, status, code)

    listen, admin = free_port(), free_port()
    path = render_envoy_config(
        CONFIG,
        tmp_path / "envoy.yaml",
        listen_port=listen,
        admin_port=admin,
        extproc_port=free_port(),
        backends={stack.backends[0]["name"]: free_port()},
    )
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net_filter in chain["filters"]:
                hcm = net_filter["typed_config"]
                hcm["http_filters"] = [
                    f
                    for f in hcm.get("http_filters", [])
                    if f["name"] != "envoy.filters.http.ext_proc"
                ]
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    with ManagedProcess("envoy-no-extproc", argv, log_dir=tmp_path) as envoy:
        envoy.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30)
        envoy.wait_tcp(listen, timeout=10)
        deadline = time.monotonic() + 10
        while not (data := _raw_http1(listen, request)) and time.monotonic() < deadline:
            time.sleep(0.2)
    _assert_raw_error(data, status, code)
