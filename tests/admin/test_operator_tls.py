"""Operator TLS (server.operator_tls): the admin gRPC API and /admin/usage on its HTTPS listener
over TLS and mutual TLS, with a PKI made at test time (tests/admin/pki.py) and real servers on
free ports. /metrics and the probes stay plain HTTP; a verified client certificate
authenticates like a loopback listener; with a token as well, both are required."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvgate.admin.auth import OperatorAuth, OperatorTokens
from kvgate.admin.tls import OperatorTls
from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import ConfigError, parse_config
from kvgate.config.model import OperatorTlsConfig
from tests.admin.pki import Pki, SecretVolume, make_pki, needs_openssl
from tests.admin.support import (
    EXPOSED_IP,
    TOKEN,
    client_context,
    grpc_channel,
    https_get,
    rendered_logs,
    run_backends_cli,
    start_server,
    tls_section,
)
from tests.session.conftest import make_config

pytestmark = needs_openssl

ADMIN = "server.admin_listen"
HTTP = "server.http_listen"
HTTPS = "server.operator_https_listen"
# A listener on an address that is not loopback: this machine's own address where it has one
# (reached there), else 0.0.0.0 (reached on 127.0.0.1). Either way kvgate sees it as exposed.
EXPOSED_LISTEN = EXPOSED_IP or "0.0.0.0"
EXPOSED_CONNECT = EXPOSED_IP or "127.0.0.1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --------------------------------------------------------------------------- the decision


def test_mutual_tls_listener_is_authenticated_without_token() -> None:
    auth = OperatorAuth(OperatorTokens())
    auth.use_tls([ADMIN, HTTPS], client_certs=True)
    for field in (ADMIN, HTTPS):
        assert auth.client_certs_on(field)
        assert auth.check(None, listen="0.0.0.0:1", listen_field=field) is None
    # The plain HTTP port refuses the operator endpoint, on loopback too: TLS only.
    denial = auth.check(None, listen="127.0.0.1:9464", listen_field=HTTP)
    assert denial is not None and denial.status == 403
    assert denial.code == "operator_endpoint_requires_tls" and HTTPS in denial.message
    exposed = {HTTP: "0.0.0.0:9464", ADMIN: "0.0.0.0:50052", HTTPS: "0.0.0.0:9443"}
    assert auth.exposure_warnings(exposed) == []
    # Without an HTTPS listener the refusal points at the admin API and the setting.
    only_admin = OperatorAuth(OperatorTokens())
    only_admin.use_tls([ADMIN], client_certs=True)
    denial = only_admin.check(None, listen="127.0.0.1:9464", listen_field=HTTP)
    assert denial is not None and f"set {HTTPS}" in denial.message


def test_tls_without_client_certificates_authenticates_no_one() -> None:
    auth = OperatorAuth(OperatorTokens())
    auth.use_tls([ADMIN, HTTPS], client_certs=False)
    assert not auth.client_certs_on(ADMIN)
    assert auth.check(None, listen="127.0.0.1:1", listen_field=ADMIN) is None  # loopback
    denial = auth.check(None, listen="0.0.0.0:1", listen_field=ADMIN)
    assert denial is not None and denial.status == 403
    assert "server.operator_tls.client_ca_file" in denial.message
    warnings = auth.exposure_warnings({HTTP: "0.0.0.0:1", ADMIN: "0.0.0.0:2", HTTPS: "0.0.0.0:3"})
    assert [w.split(" ")[0] for w in warnings] == [ADMIN, HTTPS]  # not the plain port
    assert all("authenticates no one" in w for w in warnings)


def test_token_and_mutual_tls_are_both_required() -> None:
    auth = OperatorAuth(OperatorTokens(env_token=TOKEN))
    auth.use_tls([ADMIN], client_certs=True)
    denial = auth.check(None, listen="0.0.0.0:1", listen_field=ADMIN)
    assert denial is not None and denial.status == 401  # the certificate is not enough
    assert auth.check(f"Bearer {TOKEN}", listen="0.0.0.0:1", listen_field=ADMIN) is None
    # Nor is the token, on a plain listener.
    denial = auth.check(f"Bearer {TOKEN}", listen="127.0.0.1:1", listen_field=HTTP)
    assert denial is not None and denial.status == 403


# --------------------------------------------------------------------------- config and files


def test_https_listener_needs_tls() -> None:
    config = make_config()
    config["server"]["operator_https_listen"] = "127.0.0.1:0"
    with pytest.raises(ConfigError, match=r"operator_https_listen needs operator_tls"):
        parse_config(config)
    config["server"]["operator_https_listen"] = "no-port"
    config["server"]["operator_tls"] = {"cert_file": "a", "key_file": "b"}
    with pytest.raises(ConfigError, match=r"operator_https_listen"):
        parse_config(config)


def test_unusable_tls_files_name_the_field(pki: Pki, tmp_path: Path) -> None:
    def problem(**section: str) -> str:
        with pytest.raises(ConfigError) as raised:
            OperatorTls(OperatorTlsConfig(**(tls_section(pki) | section)))
        return str(raised.value)

    message = problem(cert_file=str(tmp_path / "absent.crt"))
    assert "server.operator_tls.cert_file" in message and "cannot read" in message
    message = problem(key_file=str(pki.crt("server")))
    assert "server.operator_tls.key_file" in message and "no PEM private key" in message
    # A key that is not the certificate's: refused before anything listens.
    message = problem(key_file=str(pki.key("client")))
    assert "cert_file / key_file" in message and "not a certificate and its private key" in message
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    message = problem(client_ca_file=str(not_pem))
    assert "server.operator_tls.client_ca_file" in message
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n")
    assert "unencrypted" in problem(key_file=str(encrypted))
    # Never the key's contents in a message.
    key_text = pki.key("server").read_text()
    body = "".join(key_text.splitlines()[1:-1])
    assert body[:40] not in problem(cert_file=str(pki.crt("client")))


def test_check_config_reads_tls_files_when_asked(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate.cli import main

    config = make_config()
    config["server"]["operator_tls"] = tls_section(pki) | {"key_file": str(tmp_path / "absent")}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["check-config", str(path)]) == 0  # only named, not read
    assert main(["check-config", "--secrets", str(path)]) == 2
    assert "server.operator_tls.key_file: cannot read" in capsys.readouterr().err
    config["server"]["operator_tls"] = tls_section(pki)
    path.write_text(yaml.safe_dump(config))
    assert main(["check-config", "--secrets", str(path)]) == 0


# --------------------------------------------------------------------------- real servers


async def admin_call(channel: grpc.aio.Channel, token: str | None = None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            await stub.ListBackends(admin_pb2.ListBackendsRequest(), metadata=metadata, timeout=5)
            await stub.GetTenantUsage(
                admin_pb2.GetTenantUsageRequest(tenant="acme"), metadata=metadata, timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


async def plain_get(url: str) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        body = await response.json() if "json" in response.content_type else None
        return response.status, body


@pytest.fixture
async def mutual_tls_exposed(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[KvgateServer]:
    caplog.set_level(logging.INFO)
    kvgate = await start_server(
        tmp_path,
        http_listen=f"{EXPOSED_LISTEN}:0",
        admin_listen=f"{EXPOSED_LISTEN}:0",
        operator_https_listen=f"{EXPOSED_LISTEN}:0",
        operator_tls=tls_section(pki),
    )
    try:
        yield kvgate
    finally:
        await kvgate.stop()


async def test_mutual_tls_on_exposed_listeners_without_token(
    pki: Pki, mutual_tls_exposed: KvgateServer, caplog: pytest.LogCaptureFixture
) -> None:
    kvgate = mutual_tls_exposed
    admin = f"{EXPOSED_CONNECT}:{kvgate.admin_port}"
    https = f"https://{EXPOSED_CONNECT}:{kvgate.operator_https_port}"
    plain = f"http://{EXPOSED_CONNECT}:{kvgate.http_port}"
    # The certificate names 127.0.0.1 and localhost: verify it as localhost.
    name = "localhost"

    # Admin gRPC: served with a client certificate the CA signed; no token configured.
    assert await admin_call(grpc_channel(admin, pki, "client", server_name=name)) == (
        grpc.StatusCode.OK
    )
    # Without a client certificate, with one of another CA, or in plain text: no handshake.
    for client in (None, "intruder"):
        channel = grpc_channel(admin, pki, client, server_name=name)
        assert await admin_call(channel) == grpc.StatusCode.UNAVAILABLE, client
    assert await admin_call(grpc.aio.insecure_channel(admin)) == grpc.StatusCode.UNAVAILABLE
    # Reflection is behind the same handshake.

    def list_services() -> list[str]:
        credentials = grpc.ssl_channel_credentials(
            pki.crt("ca").read_bytes(),
            pki.key("client").read_bytes(),
            pki.crt("client").read_bytes(),
        )
        options = [("grpc.ssl_target_name_override", name)]
        with grpc.secure_channel(admin, credentials, options=options) as channel:
            return list(ProtoReflectionDescriptorDatabase(channel).get_services())

    assert "kvgate.admin.v1.Admin" in await asyncio.to_thread(list_services)

    # /admin/usage over HTTPS, same rules.
    status, body = await https_get(
        f"{https}/admin/usage", client_context(pki, "client"), server_hostname=name
    )
    assert status == 200 and body["object"] == "kvgate.usage.all"
    for client in (None, "intruder"):
        status, _ = await https_get(
            f"{https}/admin/usage", client_context(pki, client), server_hostname=name
        )
        assert status == "refused", client
    # The client checks the server too: a CA that did not sign kvgate's certificate.
    status, _ = await https_get(
        f"{https}/admin/usage", client_context(pki, "client", trust="ca2"), server_hostname=name
    )
    assert status == "refused"
    # The HTTPS listener serves /admin/usage only.
    status, _ = await https_get(
        f"{https}/metrics", client_context(pki, "client"), server_hostname=name
    )
    assert status == 404

    # The plain port: probes and Prometheus as before, /admin/usage refused (TLS only).
    for path in ("/metrics", "/healthz", "/readyz"):
        assert (await plain_get(plain + path))[0] == 200, path
    status, body = await plain_get(f"{plain}/admin/usage")
    assert status == 403 and body["error"]["code"] == "operator_endpoint_requires_tls"
    assert HTTPS in body["error"]["message"]

    # Exposed, no token, and no warning at start: the certificate is the authentication.
    started = "\n".join(r.getMessage() for r in caplog.get_records("setup"))
    assert "operator listeners use mutual TLS" in started
    assert "not a loopback address" not in started + caplog.text


async def test_cli_with_tls_flags_and_environment(
    pki: Pki, mutual_tls_exposed: KvgateServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = f"{EXPOSED_CONNECT}:{mutual_tls_exposed.admin_port}"
    flags = ["--tls-ca", str(pki.crt("ca")), "--tls-server-name", "localhost"]
    client = ["--tls-cert", str(pki.crt("client")), "--tls-key", str(pki.key("client"))]
    code, output = await run_backends_cli(admin, *flags, *client)
    assert code == 0 and "gpu-a" in output, output
    code, output = await run_backends_cli(
        admin,
        env={
            "KVGATE_ADMIN_TLS_CA": str(pki.crt("ca")),
            "KVGATE_ADMIN_TLS_CERT": str(pki.crt("client")),
            "KVGATE_ADMIN_TLS_KEY": str(pki.key("client")),
            "KVGATE_ADMIN_TLS_SERVER_NAME": "localhost",
        },
    )
    assert code == 0 and "gpu-a" in output, output
    # Without a client certificate, with another CA's, in plain text: refused, with a hint.
    for args in (
        flags,
        [*flags, "--tls-cert", str(pki.crt("intruder")), "--tls-key", str(pki.key("intruder"))],
        [],
    ):
        code, output = await run_backends_cli(admin, *args)
        assert code == 2 and "UNAVAILABLE" in output and "--tls-" in output, (args, output)
    # Flags that cannot work are refused before any call, naming the flag.
    code, output = await run_backends_cli(admin, *flags, "--tls-cert", str(pki.crt("client")))
    assert code == 2 and "--tls-cert and --tls-key go together" in output, output
    code, output = await run_backends_cli(admin, env={"KVGATE_ADMIN_TLS_CA": "/nonexistent/ca.crt"})
    assert code == 2 and "--tls-ca ($KVGATE_ADMIN_TLS_CA): cannot read" in output, output


async def test_token_and_mutual_tls_both_required_on_real_listeners(
    pki: Pki, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    kvgate = await start_server(
        tmp_path,
        operator_https_listen="127.0.0.1:0",
        operator_tls=tls_section(pki),
        admin_token_file=str(token_file),
    )
    admin = f"127.0.0.1:{kvgate.admin_port}"
    usage = f"https://127.0.0.1:{kvgate.operator_https_port}/admin/usage"
    try:
        assert await admin_call(grpc_channel(admin, pki, "client")) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert await admin_call(grpc_channel(admin, pki, "client"), TOKEN) == grpc.StatusCode.OK
        assert await admin_call(grpc_channel(admin, pki, None), TOKEN) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert (await https_get(usage, client_context(pki, "client")))[0] == 401
        assert (await https_get(usage, client_context(pki, "client"), TOKEN))[0] == 200
        assert (await https_get(usage, client_context(pki, None), TOKEN))[0] == "refused"
        # The plain port refuses the token too: no way in around TLS.
        status, _ = await plain_get(f"http://127.0.0.1:{kvgate.http_port}/admin/usage")
        assert status == 403
        code, output = await run_backends_cli(
            admin,
            "--token-file",
            str(token_file),
            "--tls-ca",
            str(pki.crt("ca")),
            "--tls-cert",
            str(pki.crt("client")),
            "--tls-key",
            str(pki.key("client")),
        )
        assert code == 0 and "gpu-a" in output, output
    finally:
        await kvgate.stop()


async def test_server_tls_only_encrypts(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a client CA: any client completes the handshake; on loopback that is enough
    (as in plain text), on an exposed listener a token is still needed."""
    caplog.set_level(logging.WARNING)
    loopback = await start_server(
        tmp_path, operator_https_listen="127.0.0.1:0", operator_tls=tls_section(pki, mutual=False)
    )
    try:
        admin = f"127.0.0.1:{loopback.admin_port}"
        assert await admin_call(grpc_channel(admin, pki, None)) == grpc.StatusCode.OK
        usage = f"https://localhost:{loopback.operator_https_port}/admin/usage"
        assert (await https_get(usage, client_context(pki, None)))[0] == 200
    finally:
        await loopback.stop()
    assert "not a loopback address" not in caplog.text

    (tmp_path / "exposed").mkdir()
    exposed = await start_server(
        tmp_path / "exposed",
        admin_listen=f"{EXPOSED_LISTEN}:0",
        operator_https_listen=f"{EXPOSED_LISTEN}:0",
        operator_tls=tls_section(pki, mutual=False),
    )
    try:
        admin = f"{EXPOSED_CONNECT}:{exposed.admin_port}"
        channel = grpc_channel(admin, pki, None, server_name="localhost")
        assert await admin_call(channel) == grpc.StatusCode.PERMISSION_DENIED
        usage = f"https://{EXPOSED_CONNECT}:{exposed.operator_https_port}/admin/usage"
        status, body = await https_get(
            usage, client_context(pki, None), server_hostname="localhost"
        )
        assert status == 403 and "client_ca_file" in body["error"]["message"]
    finally:
        await exposed.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for field in (ADMIN, HTTPS):
        assert any(w.startswith(field) and "authenticates no one" in w for w in warnings), warnings


async def test_renewed_certificates_are_served_without_restart(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cert-manager renews the Secret, the kubelet swaps the volume: the next handshake uses
    the new certificate and CA; a replacement that cannot be used keeps the last good one."""
    caplog.set_level(logging.INFO)
    volume = SecretVolume(tmp_path / "kvgate-operator-tls")

    def publish(server: str, ca: str, key_of: str | None = None) -> None:
        volume.publish(
            {
                "tls.crt": pki.crt(server).read_bytes(),
                "tls.key": pki.key(key_of or server).read_bytes(),
                "ca.crt": pki.crt(ca).read_bytes(),
            }
        )

    publish("server", "ca")
    kvgate = await start_server(
        tmp_path,
        operator_https_listen="127.0.0.1:0",
        operator_tls={
            "cert_file": volume.path("tls.crt"),
            "key_file": volume.path("tls.key"),
            "client_ca_file": volume.path("ca.crt"),
        },
    )
    admin = f"127.0.0.1:{kvgate.admin_port}"
    usage = f"https://127.0.0.1:{kvgate.operator_https_port}/admin/usage"

    async def outcomes(client: str, trust: str) -> tuple[Any, grpc.StatusCode]:
        http_status, _ = await https_get(usage, client_context(pki, client, trust))
        return http_status, await admin_call(grpc_channel(admin, pki, client, trust))

    ok = (200, grpc.StatusCode.OK)
    refused = ("refused", grpc.StatusCode.UNAVAILABLE)
    try:
        assert await outcomes("client", "ca") == ok
        assert await outcomes("client2", "ca2") == refused

        publish("server2", "ca2")  # a new server certificate and a new client CA
        assert await outcomes("client2", "ca2") == ok
        assert await outcomes("client", "ca") == refused  # old CA: neither side trusts it
        assert await outcomes("client", "ca2") == refused  # the old client certificate
        assert "operator TLS files re-read" in caplog.text

        publish("server", "ca2", key_of="server2")  # a key that is not the certificate's
        assert await outcomes("client2", "ca2") == ok  # the last good certificate stays
        assert await outcomes("client2", "ca2") == ok
        warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
        assert len(warnings) == 1, "one warning per replacement"
        assert kvgate.reloader is not None and kvgate.reloader.generation == 1  # no reload
    finally:
        await kvgate.stop()
    logs = rendered_logs(caplog)
    for name in ("server", "server2"):
        key_body = "".join(pki.key(name).read_text().splitlines()[1:-1])
        assert key_body[:40] not in logs


async def test_tls_settings_need_a_restart(pki: Pki, tmp_path: Path) -> None:
    kvgate = await start_server(tmp_path)
    assert kvgate.reloader is not None
    path = tmp_path / "kvgate.yaml"
    try:
        config = yaml.safe_load(path.read_text())
        config["server"]["operator_tls"] = tls_section(pki)
        path.write_text(yaml.safe_dump(config))
        assert not await kvgate.reloader.reload("test")
        error = kvgate.reloader.last_error or ""
        assert "server.operator_tls.cert_file" in error and "restart" in error
        assert await admin_call(grpc.aio.insecure_channel(f"127.0.0.1:{kvgate.admin_port}")) == (
            grpc.StatusCode.OK
        )
    finally:
        await kvgate.stop()


async def test_missing_tls_file_stops_the_start(pki: Pki, tmp_path: Path) -> None:
    config = make_config()
    config["server"]["operator_tls"] = tls_section(pki) | {"cert_file": str(tmp_path / "no.crt")}
    kvgate = KvgateServer(parse_config(config))
    with pytest.raises(ConfigError, match=r"server\.operator_tls\.cert_file"):
        await kvgate.start()
    assert kvgate.admin_port == 0 and kvgate.http_port == 0  # nothing was listening
    await kvgate.stop()
