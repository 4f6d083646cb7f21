"""kvgate's ext_proc listener with mutual TLS (server.grpc_tls), through the real Envoy.

Envoy runs envoy/envoy.yaml with the shipped `kvgate_extproc` cluster of
deploy/envoy/kvgate-extproc-mtls-cluster.yaml (client certificate, kvgate's name checked);
kvgate runs the grpc_tls section of deploy/kubernetes/kvgate-extproc-mtls.yaml. Only the
certificate files are the test PKI's (made with `openssl` at test time). Envoy's requests are
admitted; a client without a certificate, with another CA's, or with one of the same CA but
another identity, cannot open an ext_proc stream, whatever route settings it sends.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testbed.harness import ENVOY_CONFIG, REPO_ROOT, Stack, kvgate_metrics, sim_stats
from tests.admin.pki import Pki, needs_openssl

pytestmark = needs_openssl

MTLS_CLUSTER = REPO_ROOT / "deploy" / "envoy" / "kvgate-extproc-mtls-cluster.yaml"
MTLS_CONFIGMAP = REPO_ROOT / "deploy" / "kubernetes" / "kvgate-extproc-mtls.yaml"
GATEWAY_ID = "spiffe://cluster.local/ns/llm-gateway/sa/llm-gateway"
KVGATE_NAME = "kvgate-headless.kvgate-system.svc.cluster.local"
EXTPROC_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def make_pki(directory: Path) -> Pki:
    pki = Pki(directory)
    pki.ca("gateway-ca")
    # kvgate's certificate names what Envoy's cluster checks (and 127.0.0.1 for direct calls).
    pki.leaf("kvgate", "gateway-ca", server=True, sans=f"DNS:{KVGATE_NAME},IP:127.0.0.1")
    pki.leaf("envoy", "gateway-ca", server=False, sans=f"URI:{GATEWAY_ID}")
    # Same CA, another workload: the handshake passes, the allow-list does not.
    pki.leaf(
        "stranger", "gateway-ca", server=False, sans="URI:spiffe://cluster.local/ns/llm/sa/app"
    )
    pki.ca("other-ca")
    pki.leaf("intruder", "other-ca", server=False, sans=f"URI:{GATEWAY_ID}")
    return pki


def shipped_grpc_tls(pki: Pki) -> dict[str, Any]:
    """server.grpc_tls of the shipped mTLS ConfigMap, its files swapped for the test PKI's."""
    (configmap,) = [
        d
        for d in yaml.safe_load_all(MTLS_CONFIGMAP.read_text(encoding="utf-8"))
        if d.get("kind") == "ConfigMap"
    ]
    section = yaml.safe_load(configmap["data"]["kvgate.yaml"])["server"]["grpc_tls"]
    files = {"tls.crt": pki.crt("kvgate"), "tls.key": pki.key("kvgate")}
    files["ca.crt"] = pki.crt("gateway-ca")
    for field in ("cert_file", "key_file", "client_ca_file"):
        section[field] = str(files[Path(section[field]).name])
    assert section["allowed_clients"] == {"uri_sans": [GATEWAY_ID]}
    return section


def envoy_config_with_mtls_cluster(pki: Pki) -> dict[str, Any]:
    """envoy/envoy.yaml whose kvgate_extproc cluster takes the shipped mTLS cluster's fields
    (the harness then points its endpoint at kvgate's port), with the test PKI's files."""
    config = yaml.safe_load(ENVOY_CONFIG.read_text(encoding="utf-8"))
    shipped = yaml.safe_load(MTLS_CLUSTER.read_text(encoding="utf-8"))
    shipped = copy.deepcopy(shipped)
    common = shipped["transport_socket"]["typed_config"]["common_tls_context"]
    (certificate,) = common["tls_certificates"]
    certificate["certificate_chain"] = {"filename": str(pki.crt("envoy"))}
    certificate["private_key"] = {"filename": str(pki.key("envoy"))}
    common["validation_context"]["trusted_ca"] = {"filename": str(pki.crt("gateway-ca"))}
    clusters = config["static_resources"]["clusters"]
    index = next(i for i, c in enumerate(clusters) if c["name"] == shipped["name"])
    clusters[index] = {**clusters[index], **shipped}
    return config


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    envoy_src = tmp_path_factory.mktemp("envoy") / "envoy-extproc-mtls.yaml"
    envoy_src.write_text(yaml.safe_dump(envoy_config_with_mtls_cluster(pki), sort_keys=False))
    with Stack(
        envoy_config=envoy_src,
        kvgate_overrides={"server": {"grpc_tls": shipped_grpc_tls(pki)}},
    ) as running:
        yield running


def chat(stack: Stack) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        headers=stack.auth_headers(),
        json={
            "model": "qwen2.5-demo",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
        },
        timeout=30,
    )


def test_envoy_with_the_client_certificate_is_served(stack: Stack) -> None:
    served_before = len(sim_stats(stack)["served"])
    response = chat(stack)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert len(sim_stats(stack)["served"]) == served_before + 1  # the backend ran it
    # Envoy's connection to kvgate is TLS (its health checks pass over it, too).
    stats = stack.envoy_stats("cluster.kvgate_extproc.ssl.")
    assert stats.get("cluster.kvgate_extproc.ssl.handshake", 0) >= 1, stats
    assert stack.extproc_health_flags() == "healthy"


def channel(stack: Stack, pki: Pki, client: str | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.crt("gateway-ca").read_bytes(),
        private_key=pki.key(client).read_bytes() if client else None,
        certificate_chain=pki.crt(client).read_bytes() if client else None,
    )
    return grpc.secure_channel(stack.kvgate_grpc_address, credentials)


def open_stream(ch: grpc.Channel) -> tuple[grpc.StatusCode, str]:
    """One ext_proc stream as an attacker would open it: shadow mode and another backend in
    the route settings, the headers of a request kvgate decides on its headers alone (GET
    /v1/models); the first answer, or the call's status."""
    stub = pb_grpc.ExternalProcessorStub(ch)
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=":method", raw_value=b"GET"),
                    core.HeaderValue(key=":path", raw_value=b"/v1/models"),
                    core.HeaderValue(key="authorization", raw_value=b"Bearer sk-kvgate-demo"),
                ]
            )
        )
    )
    metadata = (("x-kvgate-route-shadow", "true"), ("x-kvgate-route-backend", "vllm-local"))
    try:
        for _ in stub.Process(iter([headers]), metadata=metadata, timeout=10):
            return grpc.StatusCode.OK, "answered"
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, "closed"


def refused_streams(stack: Stack) -> float:
    return (
        kvgate_metrics(stack).get("kvgate_client_certificates_refused_total", listener="grpc") or 0
    )


@pytest.mark.parametrize("client", [None, "intruder"])
def test_a_client_without_a_certificate_of_the_ca_gets_no_stream(
    stack: Stack, pki: Pki, client: str | None
) -> None:
    with channel(stack, pki, client) as ch:
        code, _ = open_stream(ch)
    assert code == grpc.StatusCode.UNAVAILABLE, client  # the handshake fails
    with grpc.insecure_channel(stack.kvgate_grpc_address) as plain:
        code, _ = open_stream(plain)
    assert code == grpc.StatusCode.UNAVAILABLE  # no plaintext either


def test_a_certificate_off_the_allow_list_gets_no_stream(stack: Stack, pki: Pki) -> None:
    before = refused_streams(stack)
    with channel(stack, pki, "stranger") as ch:
        code, details = open_stream(ch)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "server.grpc_tls.allowed_clients" in details
        assert "URI:spiffe://cluster.local/ns/llm/sa/app" in details
        # Only ext_proc is gated: the handshake alone is enough for the health service.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert refused_streams(stack) == before + 1
    # Envoy still gets through after the refusals.
    assert chat(stack).status_code == 200


def test_the_listed_identity_opens_a_stream_directly(stack: Stack, pki: Pki) -> None:
    """The gate refuses by identity, not by being a direct client: Envoy's certificate gets
    kvgate's answer to the headers."""
    with channel(stack, pki, "envoy") as ch:
        code, details = open_stream(ch)
    assert (code, details) == (grpc.StatusCode.OK, "answered")
