"""Identity from the mesh, through the real Envoy: a JWT Envoy's jwt_authn filter verified
(a local JWKS, tokens signed here) names the tenant and the user; an mTLS client
certificate's SPIFFE ID (made with openssl here) names the tenant. Envoy refuses what it
cannot verify (401), kvgate refuses what names no tenant (401 unknown_identity), and
nothing a client writes in a header is taken for an identity.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from openai import OpenAI

from testbed import envoy_variants
from testbed.harness import DEFAULT_MODEL_NAME, DEMO_TENANT, Stack, tenant_totals, wait_until
from tests.admin.pki import Pki, needs_openssl
from tests.e2e.identity_support import ISSUER, PAYLOAD_KEY, JwtStack, Signer

TEAM = "team-a"  # no API key: only the mesh names it
AGENT_ID = "spiffe://cluster.local/ns/agents/sa/coder"
TIMEOUT_S = 10.0
CHAT = {
    "model": DEFAULT_MODEL_NAME,
    "messages": [{"role": "user", "content": "Who am I?"}],
    "max_tokens": 5,
}


TENANTS = [{"name": DEMO_TENANT, "api_key": "sk-kvgate-demo"}, {"name": TEAM}]


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Signer:
    return Signer(tmp_path_factory.mktemp("issuer"))


@pytest.fixture(scope="module")
def stack(signer: Signer) -> Iterator[Stack]:
    with JwtStack(
        signer,
        tenants=TENANTS,
        kvgate_overrides={
            "identity": {
                "jwt": {"payload_key": PAYLOAD_KEY, "tenant_claim": "tenant", "issuers": [ISSUER]}
            }
        },
    ) as running:
        yield running


def chat(stack: Stack, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30
    )


def test_a_verified_token_names_the_tenant_and_the_user(stack: Stack, signer: Signer) -> None:
    before = tenant_totals(stack, TEAM)
    token = signer.token(tenant=TEAM, sub="alice@example.com")
    # The official SDK sends the token as its API key (Authorization: Bearer).
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=token, max_retries=0)
    request_id = "mesh-identity-jwt-1"
    answer = client.chat.completions.create(**CHAT, extra_headers={"x-request-id": request_id})  # type: ignore[call-overload]
    assert answer.usage is not None
    assert answer.usage.completion_tokens > 0
    after = wait_until(
        lambda: tenant_totals(stack, TEAM),
        lambda t: t["requests"] == before["requests"] + 1,
        timeout=TIMEOUT_S,
    )
    assert after["output_tokens"] - before["output_tokens"] == answer.usage.completion_tokens
    entry = stack.wait_access_log(lambda e: e.get("request_id") == request_id)
    assert (entry["tenant"], entry["user"], entry["identity"]) == (TEAM, "alice@example.com", "jwt")


@pytest.mark.parametrize(
    "token",
    [
        # Past jwt_authn's default clock skew (60 s).
        # Past jwt_authn's default clock skew (60 s).
        pytest.param(lambda s: s.token(tenant=TEAM, expires_in=-600), id="expired"),
        pytest.param(lambda s: s.token(tenant=TEAM, issuer="https://evil.test"), id="issuer"),
        pytest.param(
            lambda s: jwt.encode({"iss": ISSUER, "tenant": TEAM}, key="", algorithm="none"),
            id="unsigned",
        ),
        pytest.param(lambda s: s.token(tenant=TEAM)[:-4] + "AAAA", id="bad-signature"),
    ],
)
def test_envoy_refuses_a_token_it_cannot_verify(stack: Stack, signer: Signer, token: Any) -> None:
    answer = chat(stack, {"authorization": f"Bearer {token(signer)}"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["type"]  # the OpenAI shape of Envoy's local reply


def test_a_token_naming_no_tenant_is_refused_by_kvgate(stack: Stack, signer: Signer) -> None:
    for claims in ({"tenant": "nobody"}, {"sub": "alice"}, {"tenant": ["team-a"]}):
        answer = chat(stack, {"authorization": f"Bearer {signer.token(**claims)}"})
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "unknown_identity"
        assert "team-a" not in answer.text


def test_a_forged_payload_header_is_only_a_header(stack: Stack) -> None:
    forged = json.dumps({"iss": ISSUER, "tenant": TEAM, "sub": "mallory"})
    for name in ("x-jwt-payload", PAYLOAD_KEY, "x-kvgate-tenant", "x-forwarded-client-cert"):
        answer = chat(stack, {name: forged})
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["message"].startswith("You didn't provide an API key.")


def test_api_keys_still_work_beside_tokens(stack: Stack) -> None:
    """jwt_authn reads tokens from Authorization: a key travels in x-api-key there (a key
    sent as a Bearer token is a token jwt_authn cannot verify)."""
    assert chat(stack, {"x-api-key": stack.api_key(DEMO_TENANT)}).status_code == 200
    assert chat(stack, stack.auth_headers(DEMO_TENANT)).status_code == 401


# --------------------------------------------------------------------------- mTLS


class MtlsStack(Stack):
    def __init__(self, pki: Pki, **kwargs: Any) -> None:
        self.pki = pki
        super().__init__(**kwargs)

    def write_configs(self) -> None:
        super().write_configs()
        envoy_variants.require_client_certificates(
            self.envoy_config_path,
            ca=self.pki.crt("mesh-ca"),
            cert=self.pki.crt("gateway"),
            key=self.pki.key("gateway"),
        )

    @property
    def base_url(self) -> str:
        return f"https://localhost:{self.listen_port}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    made = Pki(tmp_path_factory.mktemp("mesh-pki"))
    made.ca("mesh-ca")
    made.leaf("gateway", "mesh-ca", server=True)
    made.leaf("agent", "mesh-ca", server=False, sans=f"URI:{AGENT_ID}")
    made.leaf("stranger", "mesh-ca", server=False, sans="URI:spiffe://cluster.local/ns/x/sa/y")
    return made


@pytest.fixture(scope="module")
def mtls_stack(pki: Pki) -> Iterator[Stack]:
    with MtlsStack(
        pki,
        tenants=TENANTS,
        kvgate_overrides={"identity": {"spiffe": {"tenants": {AGENT_ID: TEAM}}}},
    ) as running:
        yield running


def mtls_post(stack: Stack, pki: Pki, client: str, headers: dict[str, str]) -> httpx.Response:
    tls = ssl.create_default_context(cafile=str(pki.crt("mesh-ca")))
    tls.load_cert_chain(str(pki.crt(client)), str(pki.key(client)))
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=CHAT, headers=headers, verify=tls, timeout=30
    )


@needs_openssl
def test_a_client_certificate_names_the_tenant(mtls_stack: Stack, pki: Pki) -> None:
    before = tenant_totals(mtls_stack, TEAM)
    answer = mtls_post(mtls_stack, pki, "agent", {})
    assert answer.status_code == 200, answer.text
    wait_until(
        lambda: tenant_totals(mtls_stack, TEAM),
        lambda t: t["requests"] == before["requests"] + 1,
        timeout=TIMEOUT_S,
    )
    # An API key on the same connection is the request's own credential, and wins.
    keyed = mtls_post(
        mtls_stack,
        pki,
        "agent",
        {**mtls_stack.auth_headers(DEMO_TENANT), "x-request-id": "mesh-identity-keyed"},
    )
    assert keyed.status_code == 200
    entry = mtls_stack.wait_access_log(lambda e: e.get("request_id") == "mesh-identity-keyed")
    assert entry["tenant"] == DEMO_TENANT and not entry["identity"]


@needs_openssl
def test_a_certificate_naming_no_tenant_is_refused(mtls_stack: Stack, pki: Pki) -> None:
    answer = mtls_post(mtls_stack, pki, "stranger", {"x-forwarded-client-cert": f"URI={AGENT_ID}"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "unknown_identity"
