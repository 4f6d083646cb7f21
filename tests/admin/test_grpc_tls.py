"""server.grpc_tls: the ext_proc listener's mutual TLS settings are validated and its files
checked before anything listens, naming the field. The listener's behaviour through the real
Envoy is tests/e2e/test_extproc_mtls.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.app import KvgateServer
from kvgate.config import ConfigError, parse_config
from tests.admin.pki import Pki, make_pki, needs_openssl
from tests.session.conftest import make_config


def grpc_tls_problem(section: dict[str, object]) -> str:
    config = make_config()
    config["server"]["grpc_tls"] = section
    with pytest.raises(ConfigError) as raised:
        parse_config(config)
    return str(raised.value)


def test_grpc_tls_needs_a_client_ca() -> None:
    message = grpc_tls_problem({"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"})
    assert "server.grpc_tls.client_ca_file" in message


def test_grpc_tls_allow_list_is_validated() -> None:
    files = {"cert_file": "/a", "key_file": "/b", "client_ca_file": "/c"}
    message = grpc_tls_problem(files | {"allowed_clients": {"uri_sans": ["envoy"]}})
    assert "server.grpc_tls.allowed_clients.uri_sans" in message and "is not a URI" in message


@needs_openssl
async def test_unusable_grpc_tls_file_stops_the_start(tmp_path: Path) -> None:
    pki: Pki = make_pki(tmp_path / "pki")
    config = make_config()
    config["server"]["grpc_tls"] = {
        "cert_file": str(pki.crt("server")),
        "key_file": str(pki.key("client")),  # not the certificate's key
        "client_ca_file": str(pki.crt("ca")),
    }
    kvgate = KvgateServer(parse_config(config))
    with pytest.raises(ConfigError, match=r"server\.grpc_tls\.cert_file / key_file"):
        await kvgate.start()
    assert kvgate.grpc_port == 0 and kvgate.http_port == 0  # nothing was listening
    await kvgate.stop()
