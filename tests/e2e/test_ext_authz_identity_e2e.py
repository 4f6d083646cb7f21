"""Identity from an ext_authz server, through the real Envoy: a gRPC Authorization server
(envoy.service.auth.v3, run here) answers OK with dynamic_metadata naming the tenant and the
user, which Envoy's ext_authz filter puts in its namespace and the ext_proc filter forwards
to kvgate. A header of the same name is only a header, a check the server denies is
answered by Envoy and never reaches kvgate, and metadata naming no tenant is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.auth.v3 import external_auth_pb2 as authz
from envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from testbed import envoy_variants
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    DEMO_TENANT,
    Stack,
    free_port,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

TEAM = "team-a"  # no API key: only the ext_authz server names it
# The credential the ext_authz server checks (its own, not kvgate's API key) -> who it is.
AUTHZ_HEADER = "x-authz-token"
PRINCIPALS: dict[str, dict[str, Any]] = {
    "alice-token": {"tenant": TEAM, "user": "alice@example.com"},
    "stranger-token": {"tenant": "nobody", "user": "eve"},
}
DENIED = "revoked-token"
TIMEOUT_S = 10.0
CHAT = {
    "model": DEFAULT_MODEL_NAME,
    "messages": [{"role": "user", "content": "Who am I?"}],
    "max_tokens": 5,
}


class AuthorizationServer(authz_grpc.AuthorizationServicer):  # type: ignore[misc]
    """OK with the principal's identity as dynamic metadata; DENIED (403) for a revoked
    token; OK with no metadata for a request without one (an API key then decides)."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self._lock = threading.Lock()

    def Check(
        self, request: authz.CheckRequest, context: grpc.ServicerContext
    ) -> authz.CheckResponse:
        headers = request.attributes.request.http.headers
        token = headers.get(AUTHZ_HEADER)
        with self._lock:
            self.checked.append(headers.get("x-request-id", ""))
        if token == DENIED:
            denied = authz.CheckResponse(
                denied_response=authz.DeniedHttpResponse(
                    status=http_status_pb2.HttpStatus(code=http_status_pb2.Forbidden),
                    body="token revoked",
                )
            )
            denied.status.code = grpc.StatusCode.PERMISSION_DENIED.value[0]
            return denied
        response = authz.CheckResponse()
        response.status.code = grpc.StatusCode.OK.value[0]
        principal = PRINCIPALS.get(token or "")
        if principal is not None:
            metadata = struct_pb2.Struct()
            json_format.ParseDict(principal, metadata)
            response.dynamic_metadata.CopyFrom(metadata)
        return response


class ExtAuthzStack(Stack):
    def __init__(self, authz_port: int, **kwargs: Any) -> None:
        self.authz_port = authz_port
        super().__init__(**kwargs)

    def write_configs(self) -> None:
        super().write_configs()
        envoy_variants.check_ext_authz(self.envoy_config_path, port=self.authz_port)


@pytest.fixture(scope="module")
def authz_server() -> Iterator[tuple[AuthorizationServer, int]]:
    servicer = AuthorizationServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    authz_grpc.add_AuthorizationServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def stack(authz_server: tuple[AuthorizationServer, int]) -> Iterator[Stack]:
    with ExtAuthzStack(
        authz_server[1],
        tenants=[{"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"}, {"name": TEAM}],
        kvgate_overrides={"identity": {"ext_authz": {"tenant_key": "tenant", "user_key": "user"}}},
    ) as running:
        yield running


def chat(stack: Stack, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30
    )


def test_the_ext_authz_identity_names_the_tenant_and_the_user(stack: Stack) -> None:
    before = tenant_totals(stack, TEAM)
    request_id = "ext-authz-identity-1"
    answer = chat(stack, {AUTHZ_HEADER: "alice-token", "x-request-id": request_id})
    assert answer.status_code == 200, answer.text
    wait_until(
        lambda: tenant_totals(stack, TEAM),
        lambda t: t["requests"] == before["requests"] + 1,
        timeout=TIMEOUT_S,
    )
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert (entry["tenant"], entry["user"], entry["identity"]) == (
        TEAM,
        "alice@example.com",
        "ext_authz",
    )


def test_the_ext_authz_identity_beats_an_api_key(stack: Stack) -> None:
    request_id = "ext-authz-identity-keyed"
    headers = {**stack.auth_headers(DEMO_TENANT), AUTHZ_HEADER: "alice-token"}
    answer = chat(stack, {**headers, "x-request-id": request_id})
    assert answer.status_code == 200, answer.text
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert (entry["tenant"], entry["identity"]) == (TEAM, "ext_authz")


def test_forged_identity_headers_change_nothing(stack: Stack) -> None:
    forged = {
        "tenant": TEAM,
        "user": "mallory",
        "x-kvgate-tenant": TEAM,
        "x-ext-authz-tenant": TEAM,
        "envoy.filters.http.ext_authz": f'{{"tenant": "{TEAM}"}}',
    }
    # Without a credential: the headers name nobody.
    answer = chat(stack, forged)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["message"].startswith("You didn't provide an API key.")
    # With the demo tenant's key: the key decides, not the headers.
    request_id = "ext-authz-forged-keyed"
    answer = chat(stack, {**forged, **stack.auth_headers(DEMO_TENANT), "x-request-id": request_id})
    assert answer.status_code == 200, answer.text
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert entry["tenant"] == DEMO_TENANT and not entry["user"] and not entry["identity"]
    # With alice's token and a header naming the demo tenant: the server's answer decides.
    request_id = "ext-authz-forged-token"
    answer = chat(
        stack, {AUTHZ_HEADER: "alice-token", "tenant": DEMO_TENANT, "x-request-id": request_id}
    )
    assert answer.status_code == 200, answer.text
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert (entry["tenant"], entry["user"]) == (TEAM, "alice@example.com")


def test_a_denied_check_never_reaches_kvgate(
    stack: Stack, authz_server: tuple[AuthorizationServer, int]
) -> None:
    """Envoy answers the denial itself: kvgate decides nothing (it may see the 403 on its
    way out, as every local reply passes the ext_proc filter's response path)."""
    servicer = authz_server[0]
    keyed = stack.auth_headers(DEMO_TENANT)
    before = kvgate_metrics(stack).total("kvgate_requests_total")
    request_id = "ext-authz-denied"
    answer = chat(stack, {**keyed, AUTHZ_HEADER: DENIED, "x-request-id": request_id})
    assert answer.status_code == 403, answer.text
    assert request_id in servicer.checked  # the server, not something else, said no
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert entry["response_code_details"] == "ext_authz_denied"
    assert not entry["tenant"] and not entry["decision"]
    assert kvgate_metrics(stack).total("kvgate_requests_total") == before
    # The same request with a token the server accepts is one kvgate decides (and counts).
    assert chat(stack, {**keyed, AUTHZ_HEADER: "alice-token"}).status_code == 200
    assert kvgate_metrics(stack).total("kvgate_requests_total") == before + 1


def test_metadata_naming_no_tenant_is_refused_by_kvgate(stack: Stack) -> None:
    answer = chat(stack, {AUTHZ_HEADER: "stranger-token", **stack.auth_headers(DEMO_TENANT)})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "unknown_identity"
    assert TEAM not in answer.text
