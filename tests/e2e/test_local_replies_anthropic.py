"""Envoy's own local replies on Anthropic's Messages API are Anthropic-shaped errors.

kvgate answers `POST /v1/messages` and `/v1/messages/count_tokens` in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`. Envoy answers some requests there itself
(413 over the 8 MiB buffer, 503 when kvgate or the backend cannot be reached, 504 when kvgate
misses its message deadline, the not_admitted guard's 500): the first mappers of the HCM's
`local_reply_config` turn those into Anthropic errors, kvgate's type for the status
(`kvgate.anthropic.errors.error_type_for_status`), with the same headers as the OpenAI ones
(retry-after on 503 / 504), so that the `anthropic` SDK raises the class that goes with the
status. The paths are matched as kvgate matches them: exactly, without the query string (the
SDK's beta API sends `?beta=true`). The same situations on `/v1/chat/completions` keep
OpenAI's shape, and kvgate's own Anthropic refusals pass byte for byte.

Real Envoy + kvgate + the vLLM simulator; `KVGATE_LOCAL_REPLY_ENVOY_CONFIG=<path>` runs the
same tests against another bootstrap (as tests/e2e/test_local_replies.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic import Anthropic

from kvgate.anthropic.errors import error_type_for_status
from kvgate.anthropic.requests import COUNT_TOKENS_PATH, MESSAGES_PATH
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    DEMO_API_KEY,
    DEMO_TENANT,
    ENVOY_CONFIG,
    ManagedProcess,
    Stack,
    envoy_argv,
    free_port,
    render_envoy_config,
    wait_until,
)
from testbed.noop_extproc import noop_extproc_argv
from tests.deploy.manifests import NOT_ADMITTED
from tests.e2e.test_local_replies import BUFFER_LIMIT, assert_openai_error

CONFIG = Path(os.environ.get("KVGATE_LOCAL_REPLY_ENVOY_CONFIG", ENVOY_CONFIG))
MODEL = DEFAULT_MODEL_NAME
CHAT = "/v1/chat/completions"
CAPPED_TENANT = "capped"
CAPPED_KEY = "sk-local-replies-anthropic-capped"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
ANTHROPIC_VERSION = {"anthropic-version": "2023-06-01"}
MESSAGES_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Tell me about the river and the old mill."}],
}
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the river and the old mill."}],
    "max_tokens": 4,
}
FILLER = "a" * (BUFFER_LIMIT + (1 << 20))  # 9 MiB of prompt


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


def sdk(base_url: str, api_key: str = DEMO_API_KEY) -> Anthropic:
    # No retries: the first answer is what the test is about.
    return Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=60.0)


def anthropic_headers(api_key: str = DEMO_API_KEY) -> dict[str, str]:
    return {"x-api-key": api_key, **ANTHROPIC_VERSION}


def details_of(stack: Stack, resp: httpx.Response | anthropic.APIStatusError) -> str:
    """Envoy's %RESPONSE_CODE_DETAILS% for a request (an httpx answer or the SDK's error)."""
    headers = resp.response.headers if isinstance(resp, anthropic.APIStatusError) else resp.headers
    rid = headers["x-request-id"]
    entry = stack.wait_access_log(lambda e: e["request_id"] == rid)
    return str(entry["response_code_details"])


def assert_envoy_anthropic_error(
    status: int, headers: httpx.Headers, content: bytes, *, statuses: set[int]
) -> dict[str, Any]:
    """An Anthropic error written by a local_reply_config mapper: Anthropic's shape, kvgate's
    type for the status, content-type application/json, Envoy's JSON formatting (sorted keys,
    a final newline: never kvgate's own compact body)."""
    assert status in statuses, (status, content)
    assert headers.get("content-type") == "application/json", (headers, content)
    doc = json.loads(content)
    assert list(doc) == ["error", "type"] and doc["type"] == "error", doc
    error: dict[str, Any] = doc["error"]
    assert list(error) == ["message", "type"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == error_type_for_status(status), (status, error)
    assert content.endswith(b"\n"), content
    return error


def assert_kvgate_anthropic_body(resp: httpx.Response) -> dict[str, Any]:
    """Exactly what kvgate serialised (AnthropicError.to_body): compact, its key order."""
    assert resp.headers.get("content-type") == "application/json", resp.headers
    doc = json.loads(resp.content)
    assert resp.content == json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    assert list(doc) == ["type", "error"] and list(doc["error"]) == ["type", "message"], doc
    assert doc["error"]["type"] == error_type_for_status(resp.status_code), doc
    error: dict[str, Any] = doc["error"]
    return error


def assert_sdk_error(
    exc: anthropic.APIStatusError, stack: Stack | None, *, statuses: set[int]
) -> dict[str, Any]:
    """The SDK's exception carries Envoy's Anthropic body (and its response)."""
    resp = exc.response
    error = assert_envoy_anthropic_error(
        resp.status_code, httpx.Headers(dict(resp.headers)), resp.content, statuses=statuses
    )
    assert exc.status_code == resp.status_code
    assert exc.body == {"type": "error", "error": error}, exc.body
    if stack is not None:
        rid = resp.headers["x-request-id"]
        entry = stack.wait_access_log(lambda e: e["request_id"] == rid)
        assert entry["path"].split("?", 1)[0] in (MESSAGES_PATH, COUNT_TOKENS_PATH), entry
        assert not str(entry["response_code_details"]).startswith("kvgate_"), entry
    return error


# --------------------------------------------------------------------------- kvgate's own


def test_kvgate_anthropic_refusals_pass_unchanged(stack: Stack, client: httpx.Client) -> None:
    """kvgate's ImmediateResponses on the Messages API: its own bytes, not a mapper's."""
    missing = client.post(MESSAGES_PATH, headers=ANTHROPIC_VERSION, json=MESSAGES_BODY)
    assert missing.status_code == 401
    assert assert_kvgate_anthropic_body(missing)["type"] == "authentication_error"

    missing_count = client.post(
        COUNT_TOKENS_PATH,
        headers=ANTHROPIC_VERSION,
        json={"model": MODEL, "messages": MESSAGES_BODY["messages"]},
    )
    assert missing_count.status_code == 401
    assert_kvgate_anthropic_body(missing_count)

    capped = anthropic_headers(CAPPED_KEY)
    assert client.post(MESSAGES_PATH, headers=capped, json=MESSAGES_BODY).status_code == 200
    limited = client.post(f"{MESSAGES_PATH}?beta=true", headers=capped, json=MESSAGES_BODY)
    assert limited.status_code == 429
    assert assert_kvgate_anthropic_body(limited)["type"] == "rate_limit_error"
    assert limited.headers.get("retry-after"), "kvgate's retry-after is kept"

    for resp in (missing, missing_count, limited):
        assert details_of(stack, resp).startswith("kvgate_")


# --------------------------------------------------------------------------- 413


def test_body_over_the_buffer_is_anthropic_413(stack: Stack, client: httpx.Client) -> None:
    """9 MiB on /v1/messages: Envoy's 413 as Anthropic's request_too_large, which the SDK
    raises as ContentTooLargeError; with a query string (the beta API's ?beta=true) too."""
    with pytest.raises(anthropic.ContentTooLargeError) as caught:
        sdk(stack.base_url).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": FILLER}]
        )
    error = assert_sdk_error(caught.value, stack, statuses={413})
    assert error["type"] == "request_too_large"
    assert details_of(stack, caught.value) == "request_payload_too_large"

    with pytest.raises(anthropic.ContentTooLargeError) as counted:
        sdk(stack.base_url).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": FILLER}]
        )
    assert_sdk_error(counted.value, stack, statuses={413})

    body = json.dumps({**MESSAGES_BODY, "messages": [{"role": "user", "content": FILLER}]}).encode()
    headers = {**anthropic_headers(), "content-type": "application/json"}
    beta = client.post(f"{MESSAGES_PATH}?beta=true", headers=headers, content=body)
    error = assert_envoy_anthropic_error(
        beta.status_code, beta.headers, beta.content, statuses={413}
    )
    assert error["type"] == "request_too_large"
    assert details_of(stack, beta) == "request_payload_too_large"


def test_body_over_the_buffer_keeps_openai_shape_elsewhere(
    stack: Stack, client: httpx.Client
) -> None:
    """The same 413 on /v1/chat/completions: OpenAI's shape. Paths next to the Messages API
    that kvgate does not answer as Anthropic's (/v1/messages/batches, /v1/messages/) get
    kvgate's own OpenAI-shaped 404 before any body: the mappers match the same exact paths."""
    headers = {**stack.auth_headers(), "content-type": "application/json"}
    chat = json.dumps({**CHAT_BODY, "messages": [{"role": "user", "content": FILLER}]}).encode()
    for path in (CHAT, f"{CHAT}?messages=1"):
        resp = client.post(path, headers=headers, content=chat)
        assert_openai_error(resp, statuses={413}, code="payload_too_large")
        assert details_of(stack, resp) == "request_payload_too_large"
    for path in (f"{MESSAGES_PATH}/batches", f"{MESSAGES_PATH}/"):
        resp = client.post(path, headers=anthropic_headers(), json=MESSAGES_BODY)
        assert resp.status_code == 404, resp.content
        assert set(json.loads(resp.content)) == {"error"}, resp.content  # OpenAI's shape
        assert details_of(stack, resp).startswith("kvgate_")


# --------------------------------------------------------------------------- 503 / 504


def test_kvgate_down_is_anthropic_503(stack: Stack) -> None:
    """kvgate gone (refused connections, then no healthy ext_proc endpoint): Envoy's 503 on
    /v1/messages is Anthropic's overloaded_error with retry-after, which the SDK raises as
    ServiceUnavailableError; on /v1/chat/completions it stays OpenAI's upstream_unavailable."""
    stack.wait_extproc_serving(timeout=30)
    stack.kill_kvgate()
    try:
        client = sdk(stack.base_url)
        with pytest.raises(anthropic.ServiceUnavailableError) as refused:
            client.messages.create(**MESSAGES_BODY)
        error = assert_sdk_error(refused.value, stack, statuses={503})
        assert error["type"] == "overloaded_error"
        assert refused.value.response.headers.get("retry-after") == "1"
        assert details_of(stack, refused.value).startswith("ext_proc_error_gRPC_error_14")
        with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as http:
            chat = http.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
            assert_openai_error(chat, statuses={503}, code="upstream_unavailable")
            assert chat.headers.get("retry-after") == "1"

            flags = wait_until(stack.extproc_health_flags, lambda f: f != "healthy", timeout=20)
            assert flags != "healthy", "Envoy never marked kvgate unhealthy"
            with pytest.raises(anthropic.ServiceUnavailableError) as unhealthy:
                client.messages.count_tokens(model=MODEL, messages=MESSAGES_BODY["messages"])
            assert_sdk_error(unhealthy.value, stack, statuses={503})
            assert unhealthy.value.response.headers.get("retry-after") == "1"
            beta = http.post(
                f"{MESSAGES_PATH}?beta=true", headers=anthropic_headers(), json=MESSAGES_BODY
            )
            assert_envoy_anthropic_error(
                beta.status_code, beta.headers, beta.content, statuses={503}
            )
            assert beta.headers.get("retry-after") == "1"
            chat = http.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
            assert_openai_error(chat, statuses={503}, code="upstream_unavailable")
    finally:
        stack.start_kvgate()
        stack.wait_extproc_serving(timeout=30)


def test_backend_down_is_anthropic_error(stack: Stack) -> None:
    """The model server killed: Envoy's connect failure to the admitted backend, on
    /v1/messages in Anthropic's shape (503 overloaded_error with retry-after, or 502
    api_error for a pooled connection the kill cut)."""
    stack.wait_extproc_serving(timeout=30)
    name = stack.backends[0]["name"]
    sim = stack.sims[name]
    sim.kill()
    try:
        with pytest.raises(anthropic.InternalServerError) as caught:
            sdk(stack.base_url).messages.create(**MESSAGES_BODY)
        assert_sdk_error(caught.value, stack, statuses={502, 503})
        if caught.value.status_code == 503:
            assert isinstance(caught.value, anthropic.ServiceUnavailableError)
            assert caught.value.response.headers.get("retry-after") == "1"
        assert details_of(stack, caught.value).startswith("upstream_reset_before_response_started")
        with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as http:
            chat = http.post(CHAT, headers=stack.auth_headers(), json=CHAT_BODY)
        error = assert_openai_error(chat, statuses={502, 503})
        assert error["code"] in ("upstream_unavailable", "upstream_error")
    finally:
        sim.start()
        sim.wait_http(f"{stack.sim_urls[name]}/health", timeout=60)


def _signal_kvgate(stack: Stack, sig: signal.Signals) -> None:
    assert stack.kvgate is not None and stack.kvgate.pid is not None
    os.killpg(os.getpgid(stack.kvgate.pid), sig)


def test_extproc_message_timeout_is_anthropic_504(stack: Stack) -> None:
    """kvgate frozen (SIGSTOP) past the 2 s message_timeout: Envoy's 504 as api_error with
    retry-after, which the SDK raises as GatewayTimeoutError."""
    stack.wait_extproc_serving(timeout=30)
    _signal_kvgate(stack, signal.SIGSTOP)
    try:
        with pytest.raises(anthropic.GatewayTimeoutError) as caught:
            sdk(stack.base_url).messages.create(**MESSAGES_BODY)
    finally:
        _signal_kvgate(stack, signal.SIGCONT)
    error = assert_sdk_error(caught.value, stack, statuses={504})
    assert error["type"] == "api_error"
    assert caught.value.response.headers.get("retry-after") == "1"
    assert details_of(stack, caught.value) == "ext_proc_error_per-message_timeout_exceeded"
    stack.wait_extproc_healthy(timeout=30)


# --------------------------------------------------------------------------- the guard


def test_guard_is_anthropic_on_messages(tmp_path: Path) -> None:
    """An ext_proc server that lets everything through but never decides: the guard's
    not_admitted 500 is Anthropic's api_error on the Messages API's paths (the SDK raises
    InternalServerError) and stays byte for byte OpenAI's everywhere else."""
    listen, admin, noop_port = free_port(), free_port(), free_port()
    path = render_envoy_config(
        CONFIG,
        tmp_path / "envoy.yaml",
        listen_port=listen,
        admin_port=admin,
        extproc_port=noop_port,
        backends={"vllm-local": free_port()},  # never reached
    )
    noop = ManagedProcess(
        "noop-extproc", noop_extproc_argv(f"127.0.0.1:{noop_port}"), log_dir=tmp_path
    )
    envoy = ManagedProcess("envoy-guard", envoy_argv(path), log_dir=tmp_path)
    base = f"http://127.0.0.1:{listen}"
    with noop, envoy, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        noop.wait_tcp(noop_port, timeout=30)
        envoy.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30)
        # Until Envoy's health check lets requests reach the no-op server (503 before).
        deadline = time.monotonic() + 30
        while (resp := http.post(CHAT, json=CHAT_BODY)).status_code == 503:
            assert time.monotonic() < deadline, resp.content
            time.sleep(0.2)

        for target in (MESSAGES_PATH, f"{MESSAGES_PATH}?beta=true", COUNT_TOKENS_PATH):
            resp = http.post(target, headers=anthropic_headers(), json=MESSAGES_BODY)
            error = assert_envoy_anthropic_error(
                resp.status_code, resp.headers, resp.content, statuses={500}
            )
            assert error["type"] == "api_error" and "not admitted" in error["message"], error
        with pytest.raises(anthropic.InternalServerError) as caught:
            sdk(base).messages.create(**MESSAGES_BODY)
        assert_sdk_error(caught.value, None, statuses={500})

        for target in (CHAT, f"{MESSAGES_PATH}/batches", "/v1/messages/"):
            resp = http.post(target, headers=anthropic_headers(), json=MESSAGES_BODY)
            assert resp.status_code == 500, resp.content
            assert resp.headers.get("content-type") == "application/json"
            assert json.loads(resp.content) == NOT_ADMITTED
            assert not resp.content.endswith(b"\n"), "the guard's own body, not a mapper's"
