"""Operator surfaces (GET /admin/usage, kvgate.admin.v1): the operator token, the loopback rule,
the CLI's token, and no secret in any log line or error. Real servers on free ports."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvgate.admin.auth import (
    OperatorAuth,
    OperatorTokens,
    is_loopback_listen,
    load_operator_tokens,
)
from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import ConfigError, parse_config
from tests.admin.support import (
    EXPOSED_IP,
    OTHER,
    TOKEN,
    admin_call,
    get,
    rendered_logs,
    run_backends_cli,
    server_config,
    start_server,
)
from tests.session.conftest import make_config

needs_exposed_ip = pytest.mark.skipif(EXPOSED_IP is None, reason="no non-loopback address")


# --------------------------------------------------------------------------- the decision


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:9464", True),
        ("127.0.0.2:9464", True),  # all of 127.0.0.0/8 is loopback
        ("localhost:9464", True),
        ("[::1]:9464", True),
        ("0.0.0.0:9464", False),
        ("[::]:9464", False),
        ("10.0.0.7:9464", False),
        ("192.0.2.2:9464", False),
        ("kvgate.internal:9464", False),  # a name other than localhost counts as exposed
    ],
)
def test_loopback_listeners(listen: str, loopback: bool) -> None:
    assert is_loopback_listen(listen) is loopback


def test_check_without_token_follows_the_listener() -> None:
    auth = OperatorAuth(OperatorTokens())
    assert auth.check(None, listen="127.0.0.1:9464", listen_field="server.http_listen") is None
    denial = auth.check(None, listen="0.0.0.0:9464", listen_field="server.http_listen")
    assert denial is not None and denial.status == 403
    assert "server.admin_token_file" in denial.message and "server.http_listen" in denial.message
    # A token sent to a server that has none does not open an exposed listener.
    sent = auth.check(f"Bearer {TOKEN}", listen="0.0.0.0:9464", listen_field="x")
    assert sent is not None and sent.status == 403


def test_check_with_token() -> None:
    auth = OperatorAuth(OperatorTokens(env_token=TOKEN))
    loopback = {"listen": "127.0.0.1:1", "listen_field": "server.admin_listen"}
    for header in (None, "", "Bearer", "Basic " + TOKEN, TOKEN, f"Bearer {TOKEN}x", "Bearer x"):
        denial = auth.check(header, **loopback)
        assert denial is not None and denial.status == 401, header
        assert denial.headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in denial.message
    assert auth.check(f"Bearer {TOKEN}", **loopback) is None
    assert auth.check(f"bearer   {TOKEN} ", **loopback) is None
    assert auth.check(f"Bearer {TOKEN}", listen="0.0.0.0:1", listen_field="x") is None
    # Not ASCII: refused, not an exception (compare_digest on bytes).
    denial = auth.check("Bearer caf\u00e9-\udcff", **loopback)
    assert denial is not None and denial.status == 401


# --------------------------------------------------------------------------- tokens


def test_token_file_trailing_newline_and_env(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("KVGATE_TEST_OP_TOKEN", OTHER)
    tokens = load_operator_tokens(
        server_config(admin_token_file=str(path), admin_token_env="KVGATE_TEST_OP_TOKEN")
    )
    assert tokens.configured
    assert sorted(tokens.current()) == sorted([TOKEN, OTHER])  # both: a rotation window
    assert load_operator_tokens(server_config()).configured is False


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read"),
        ("", "is empty"),
        ("\n", "is empty"),
        ("short\n", "at least 16"),
        ("has a space in the middle of it\n", "printable ASCII"),
    ],
)
def test_unusable_token_file_names_the_field(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_operator_tokens(server_config(admin_token_file=str(path)))
    message = str(raised.value)
    assert "server.admin_token_file" in message and problem in message
    if content and content.strip():
        assert content.strip() not in message  # never the value


def test_unset_token_env_names_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("KVGATE_TEST_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"server\.admin_token_env.*KVGATE_TEST_NO_SUCH_TOKEN"):
        load_operator_tokens(server_config(admin_token_env="KVGATE_TEST_NO_SUCH_TOKEN"))


def test_token_env_must_be_a_variable_name() -> None:
    config = make_config()
    config["server"]["admin_token_env"] = "op-token-3f9c1a7e5b2d"  # the token itself, by mistake
    with pytest.raises(ConfigError, match=r"server\.admin_token_env"):
        parse_config(config)


def test_missing_token_file_stops_the_server(tmp_path: Path) -> None:
    config = make_config()
    config["server"]["admin_token_file"] = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"server\.admin_token_file"):
        KvgateServer(parse_config(config))


# --------------------------------------------------------------------------- real servers


async def admin_error(address: str, token: str | None = None) -> grpc.aio.AioRpcError:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Reload(admin_pb2.ReloadRequest(), metadata=metadata, timeout=5)
        return raised.value


async def test_token_guards_http_and_grpc_and_the_cli_sends_it(
    tmp_path: Path, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    kvgate = await start_server(tmp_path, admin_token_file=str(token_file))
    base = f"http://127.0.0.1:{kvgate.http_port}"
    admin = f"127.0.0.1:{kvgate.admin_port}"
    try:
        # HTTP: 401 (OpenAI error shape, WWW-Authenticate) without or with a wrong token.
        for kwargs in ({}, {"token": OTHER}, {"raw": f"Basic {TOKEN}"}):
            status, headers, body = await get(http, f"{base}/admin/usage", **kwargs)
            assert status == 401, kwargs
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["code"] in ("operator_token_required", "invalid_operator_token")
            assert TOKEN not in str(body)
        status, _, body = await get(http, f"{base}/admin/usage", token=TOKEN)
        assert status == 200 and body["object"] == "kvgate.usage.all"
        # Probes and Prometheus need no token.
        for path in ("/metrics", "/healthz", "/readyz"):
            status, _, _ = await get(http, base + path)
            assert status == 200, path

        # gRPC: UNAUTHENTICATED without or with a wrong token, served with the right one.
        assert await admin_call(admin) == grpc.StatusCode.UNAUTHENTICATED
        assert await admin_call(admin, OTHER) == grpc.StatusCode.UNAUTHENTICATED
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.OK
        error = await admin_error(admin)
        assert "Bearer" in (error.details() or "") and TOKEN not in (error.details() or "")
        # Reflection stays open (the schema is public; grpcurl needs it to build calls).

        def list_services() -> list[str]:
            with grpc.insecure_channel(admin) as sync_channel:
                return list(ProtoReflectionDescriptorDatabase(sync_channel).get_services())

        assert "kvgate.admin.v1.Admin" in await asyncio.to_thread(list_services)

        # The CLI: --token-file, $KVGATE_ADMIN_TOKEN, nothing.
        code, output = await run_backends_cli(admin, "--token-file", str(token_file))
        assert code == 0 and "gpu-a" in output, output
        code, output = await run_backends_cli(admin, env={"KVGATE_ADMIN_TOKEN": TOKEN})
        assert code == 0 and "gpu-a" in output, output
        code, output = await run_backends_cli(admin)
        assert code == 2 and "UNAUTHENTICATED" in output, output
        code, output = await run_backends_cli(admin, env={"KVGATE_ADMIN_TOKEN": OTHER})
        assert code == 2 and "UNAUTHENTICATED" in output and OTHER not in output, output
        code, output = await run_backends_cli(admin, "--token-file", str(tmp_path / "absent"))
        assert code == 2 and "--token-file" in output, output

        # Rotation: the Secret volume swaps the file; kvgate follows without a reload.
        rotated = tmp_path / "admin-token.new"
        rotated.write_text(OTHER + "\n")
        os.replace(rotated, token_file)
        status, _, _ = await get(http, f"{base}/admin/usage", token=TOKEN)
        assert status == 401, "the old token must stop working once the file is replaced"
        status, _, _ = await get(http, f"{base}/admin/usage", token=OTHER)
        assert status == 200
        assert await admin_call(admin, OTHER) == grpc.StatusCode.OK
        # A broken replacement revokes: the last token is refused too (and the log says
        # so, without the value); tests/admin/test_token_revocation.py has the rest.
        broken = tmp_path / "admin-token.broken"
        broken.write_text("\n")
        os.replace(broken, token_file)
        status, _, body = await get(http, f"{base}/admin/usage", token=OTHER)
        assert status == 401 and body["error"]["code"] == "operator_token_file_unusable"
        assert "cannot be used" in caplog.text
    finally:
        await kvgate.stop()
    logs = rendered_logs(caplog)
    assert TOKEN not in logs and OTHER not in logs


async def test_token_reloads_with_the_config(
    tmp_path: Path, http: aiohttp.ClientSession, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVGATE_TEST_OP_TOKEN", TOKEN)
    kvgate = await start_server(tmp_path, admin_token_env="KVGATE_TEST_OP_TOKEN")
    assert kvgate.reloader is not None
    base = f"http://127.0.0.1:{kvgate.http_port}"
    admin = f"127.0.0.1:{kvgate.admin_port}"
    path = tmp_path / "kvgate.yaml"
    try:
        assert (await get(http, f"{base}/admin/usage", token=TOKEN))[0] == 200
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.OK

        # Switch to a token file: applied by the reload, the env token no longer valid.
        token_file = tmp_path / "token"
        token_file.write_text(OTHER)
        config = yaml.safe_load(path.read_text())
        del config["server"]["admin_token_env"]
        config["server"]["admin_token_file"] = str(token_file)
        path.write_text(yaml.safe_dump(config))
        assert await kvgate.reloader.reload("test"), kvgate.reloader.last_error
        assert (await get(http, f"{base}/admin/usage", token=TOKEN))[0] == 401
        assert (await get(http, f"{base}/admin/usage", token=OTHER))[0] == 200
        assert await admin_call(admin, OTHER) == grpc.StatusCode.OK

        # A token file that cannot be read rejects the reload; the old token keeps working.
        config["server"]["admin_token_file"] = str(tmp_path / "absent")
        path.write_text(yaml.safe_dump(config))
        assert not await kvgate.reloader.reload("test")
        assert "server.admin_token_file" in (kvgate.reloader.last_error or "")
        assert (await get(http, f"{base}/admin/usage", token=OTHER))[0] == 200

        # Dropping the token on a loopback listener: open again, as without one at start.
        del config["server"]["admin_token_file"]
        path.write_text(yaml.safe_dump(config))
        assert await kvgate.reloader.reload("test"), kvgate.reloader.last_error
        assert (await get(http, f"{base}/admin/usage"))[0] == 200
        assert await admin_call(admin) == grpc.StatusCode.OK
    finally:
        await kvgate.stop()
    logs = rendered_logs(caplog)
    assert TOKEN not in logs and OTHER not in logs


async def test_loopback_without_token_is_open(
    tmp_path: Path, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    kvgate = await start_server(tmp_path)
    try:
        assert (await get(http, f"http://127.0.0.1:{kvgate.http_port}/admin/usage"))[0] == 200
        assert await admin_call(f"127.0.0.1:{kvgate.admin_port}") == grpc.StatusCode.OK
    finally:
        await kvgate.stop()
    assert "not a loopback address" not in caplog.text


@needs_exposed_ip
async def test_exposed_without_token_is_refused(
    tmp_path: Path, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    kvgate = await start_server(
        tmp_path, http_listen=f"{EXPOSED_IP}:0", admin_listen=f"{EXPOSED_IP}:0"
    )
    base = f"http://{EXPOSED_IP}:{kvgate.http_port}"
    admin = f"{EXPOSED_IP}:{kvgate.admin_port}"
    try:
        status, _, body = await get(http, f"{base}/admin/usage")
        assert status == 403
        message = body["error"]["message"]
        assert "server.admin_token_file" in message and "server.http_listen" in message
        assert body["error"]["code"] == "operator_endpoint_not_exposed"
        # Probes and Prometheus still work on that address.
        for path in ("/metrics", "/healthz", "/readyz"):
            assert (await get(http, base + path))[0] == 200, path
        assert await admin_call(admin) == grpc.StatusCode.PERMISSION_DENIED
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.PERMISSION_DENIED
        error = await admin_error(admin)
        assert "server.admin_token_file" in (error.details() or "")
        assert "server.admin_listen" in (error.details() or "")
        # The data plane is not affected: the ext_proc port is healthy.
        assert kvgate.grpc_port > 0
    finally:
        await kvgate.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("server.http_listen" in w and "admin_token" in w for w in warnings), warnings
    assert any("server.admin_listen" in w and "admin_token" in w for w in warnings), warnings


@needs_exposed_ip
async def test_exposed_with_token_is_served(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    kvgate = await start_server(
        tmp_path,
        http_listen=f"{EXPOSED_IP}:0",
        admin_listen=f"{EXPOSED_IP}:0",
        admin_token_file=str(token_file),
    )
    base = f"http://{EXPOSED_IP}:{kvgate.http_port}"
    admin = f"{EXPOSED_IP}:{kvgate.admin_port}"
    try:
        assert (await get(http, f"{base}/admin/usage"))[0] == 401
        assert (await get(http, f"{base}/admin/usage", token=TOKEN))[0] == 200
        assert await admin_call(admin) == grpc.StatusCode.UNAUTHENTICATED
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.OK
    finally:
        await kvgate.stop()


def test_check_config_reads_secrets_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate.cli import main

    config = make_config()
    config["server"]["admin_token_file"] = str(tmp_path / "token")
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["check-config", str(path)]) == 0  # the file is only named, not read
    assert main(["check-config", "--secrets", str(path)]) == 2
    assert "server.admin_token_file: cannot read" in capsys.readouterr().err
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert main(["check-config", "--secrets", str(path)]) == 0
    assert TOKEN not in capsys.readouterr().out
