"""server.operator_tls.allowed_clients: with mutual TLS, only the listed identities (URI SAN,
DNS SAN, subject CN) among the certificates the client CA signed may use the operator
surfaces. Real servers, a PKI made at test time (tests/admin/pki.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvgate.app import KvgateServer
from kvgate.config import ConfigError, parse_config
from tests.admin.pki import Pki, make_pki, needs_openssl
from tests.admin.support import client_context, grpc_channel, https_get, start_server, tls_section
from tests.session.conftest import make_config

pytestmark = needs_openssl

OPERATOR_ID = "spiffe://cluster.local/ns/ops/sa/kvgate-operator"
WORKLOAD_ID = "spiffe://cluster.local/ns/llm/sa/some-workload"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The base PKI plus clients of the same CA (`ca`) with identities on and off the list."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    pki.leaf("operator", "ca", server=False, sans=f"URI:{OPERATOR_ID}")
    pki.leaf("workload", "ca", server=False, sans=f"URI:{WORKLOAD_ID},DNS:workload.llm.svc")
    pki.leaf("ops-host", "ca", server=False, sans="DNS:Ops-Console.Example.com")
    pki.leaf("break-glass", "ca", server=False)  # CN only, no SAN
    return pki


ALLOWED = {
    "uri_sans": [OPERATOR_ID],
    "dns_sans": ["ops-console.example.com"],
    "common_names": ["break-glass"],
}


def allowed_tls(pki: Pki, allowed: dict[str, list[str]] | None = None) -> dict[str, Any]:
    return tls_section(pki) | {"allowed_clients": allowed or ALLOWED}


# --------------------------------------------------------------------------- config


def test_allow_list_is_validated() -> None:
    def problem(section: dict[str, Any]) -> str:
        config = make_config()
        config["server"]["operator_tls"] = section
        with pytest.raises(ConfigError) as raised:
            parse_config(config)
        return str(raised.value)

    base = {"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"}
    assert "allowed_clients needs client_ca_file" in problem(
        base | {"allowed_clients": {"uri_sans": [OPERATOR_ID]}}
    )
    mutual = base | {"client_ca_file": "/tls/ca.crt"}
    assert "list at least one" in problem(mutual | {"allowed_clients": {}})
    assert "is not a URI" in problem(mutual | {"allowed_clients": {"uri_sans": ["ops team"]}})
    assert "is not a DNS name" in problem(mutual | {"allowed_clients": {"dns_sans": ["*.ops"]}})
    assert "listed twice" in problem(mutual | {"allowed_clients": {"common_names": ["a", "a"]}})
    assert "extra" in problem(mutual | {"allowed_clients": {"spiffe_ids": [OPERATOR_ID]}}).lower()


def test_matching_rules() -> None:
    from kvgate.admin.identity import PeerIdentity, is_allowed
    from kvgate.config.model import ClientIdentitiesConfig

    allowed = ClientIdentitiesConfig(**ALLOWED)
    assert is_allowed(allowed, PeerIdentity(uri_sans=(WORKLOAD_ID, OPERATOR_ID)))
    assert is_allowed(allowed, PeerIdentity(dns_sans=("OPS-console.example.com",)))
    assert is_allowed(allowed, PeerIdentity(common_name="break-glass"))
    # Exact: no prefix, no case folding outside DNS, a SAN is not a CN.
    assert not is_allowed(allowed, PeerIdentity(uri_sans=(OPERATOR_ID + "-2",)))
    assert not is_allowed(allowed, PeerIdentity(common_name="Break-Glass"))
    assert not is_allowed(allowed, PeerIdentity(dns_sans=("break-glass",)))
    assert not is_allowed(allowed, PeerIdentity(common_name=OPERATOR_ID))
    assert is_allowed(None, PeerIdentity())  # no list: any certificate of the CA


def test_identity_from_a_python_peer_certificate() -> None:
    from kvgate.admin.identity import PeerIdentity, identity_from_peercert

    peercert = {
        "subject": ((("organizationName", "ops"),), (("commonName", "break-glass"),)),
        "subjectAltName": (("URI", OPERATOR_ID), ("DNS", "a.example"), ("IP Address", "10.0.0.1")),
    }
    identity = identity_from_peercert(peercert)
    assert identity == PeerIdentity((OPERATOR_ID,), ("a.example",), "break-glass")
    assert identity_from_peercert({}) is None


# --------------------------------------------------------------------------- real servers


async def admin_status(address: str, pki: Pki, client: str) -> tuple[grpc.StatusCode, str]:
    from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc

    async with grpc_channel(address, pki, client) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            await stub.ListBackends(admin_pb2.ListBackendsRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def refused_count(kvgate: KvgateServer, listener: str) -> float:
    counter = kvgate.metrics.client_certificates_refused.labels(listener)
    return counter._value.get()


@pytest.fixture
async def kvgate(pki: Pki, tmp_path: Path) -> AsyncIterator[KvgateServer]:
    server = await start_server(
        tmp_path, operator_https_listen="127.0.0.1:0", operator_tls=allowed_tls(pki)
    )
    try:
        yield server
    finally:
        await server.stop()


@pytest.mark.parametrize("client", ["operator", "ops-host", "break-glass"])
async def test_listed_identity_is_served(pki: Pki, kvgate: KvgateServer, client: str) -> None:
    admin = f"127.0.0.1:{kvgate.admin_port}"
    assert await admin_status(admin, pki, client) == (grpc.StatusCode.OK, "")
    usage = f"https://127.0.0.1:{kvgate.operator_https_port}/admin/usage"
    status, body = await https_get(usage, client_context(pki, client))
    assert status == 200 and body["object"] == "kvgate.usage.all"


@pytest.mark.parametrize("client", ["workload", "client"])
async def test_certificate_of_the_ca_off_the_list_is_refused(
    pki: Pki, kvgate: KvgateServer, client: str
) -> None:
    """`workload` has SANs not listed; `client` has neither SAN nor a listed CN."""
    admin = f"127.0.0.1:{kvgate.admin_port}"
    code, details = await admin_status(admin, pki, client)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "server.operator_tls.allowed_clients" in details and "trusted CA" in details
    if client == "workload":
        assert f"URI:{WORKLOAD_ID}" in details and "DNS:workload.llm.svc" in details
    assert refused_count(kvgate, "admin") == 1

    usage = f"https://127.0.0.1:{kvgate.operator_https_port}/admin/usage"
    status, body = await https_get(usage, client_context(pki, client))
    assert status == 403 and body["error"]["code"] == "client_certificate_not_allowed"
    assert "server.operator_tls.allowed_clients" in body["error"]["message"]
    assert refused_count(kvgate, "operator_https") == 1
    # Another CA's certificate still fails the handshake (never reaches the allow-list).
    assert (await admin_status(admin, pki, "intruder"))[0] == grpc.StatusCode.UNAVAILABLE
    assert refused_count(kvgate, "admin") == 1


async def test_reload_changes_the_allow_list(pki: Pki, tmp_path: Path) -> None:
    kvgate = await start_server(
        tmp_path,
        operator_https_listen="127.0.0.1:0",
        operator_tls=allowed_tls(pki, {"uri_sans": [OPERATOR_ID]}),
    )
    assert kvgate.reloader is not None
    admin = f"127.0.0.1:{kvgate.admin_port}"
    path = tmp_path / "kvgate.yaml"
    try:
        assert (await admin_status(admin, pki, "operator"))[0] == grpc.StatusCode.OK
        assert (await admin_status(admin, pki, "workload"))[0] == grpc.StatusCode.PERMISSION_DENIED
        # Revoke the operator, admit the workload: no restart, no new handshake needed.
        config = yaml.safe_load(path.read_text())
        config["server"]["operator_tls"]["allowed_clients"] = {"uri_sans": [WORKLOAD_ID]}
        path.write_text(yaml.safe_dump(config))
        assert await kvgate.reloader.reload("test"), kvgate.reloader.last_error
        assert (await admin_status(admin, pki, "operator"))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert (await admin_status(admin, pki, "workload"))[0] == grpc.StatusCode.OK
        # Dropping the list: any certificate of the CA, as before allow-lists.
        del config["server"]["operator_tls"]["allowed_clients"]
        path.write_text(yaml.safe_dump(config))
        assert await kvgate.reloader.reload("test"), kvgate.reloader.last_error
        assert (await admin_status(admin, pki, "client"))[0] == grpc.StatusCode.OK
    finally:
        await kvgate.stop()
