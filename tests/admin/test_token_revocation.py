"""A token file that goes missing or unusable revokes: every operator token is refused (HTTP 401
and gRPC UNAUTHENTICATED, code operator_token_file_unusable) until the file holds a valid token
again, with a warning and kvgate_operator_token_file_valid 0. Real servers on free ports."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
import pytest

from kvgate.admin.auth import OperatorAuth, load_operator_tokens
from kvgate.app import KvgateServer
from tests.admin.pki import SecretVolume
from tests.admin.support import (
    OTHER,
    TOKEN,
    admin_call,
    get,
    rendered_logs,
    server_config,
    start_server,
)

REVOKED = "operator_token_file_unusable"


async def token_file_valid_metric(http: aiohttp.ClientSession, kvgate: KvgateServer) -> str:
    """The sample line of kvgate_operator_token_file_valid on /metrics."""
    async with http.get(f"http://127.0.0.1:{kvgate.http_port}/metrics") as response:
        text = await response.text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvgate_operator_token_file_valid")]
    return line


def delete(path: Path) -> None:
    path.unlink()


def empty(path: Path) -> None:
    path.write_text("")


def newline_only(path: Path) -> None:
    path.write_text("\n")


def too_short(path: Path) -> None:
    path.write_text("short\n")


def with_spaces(path: Path) -> None:
    path.write_text("op token with spaces in it\n")


def not_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfe" + os.urandom(32))


def unreadable(path: Path) -> None:
    # A directory where the file was: read fails (chmod would not stop root).
    path.unlink()
    path.mkdir()


BREAKAGES: list[Callable[[Path], None]] = [
    delete,
    empty,
    newline_only,
    too_short,
    with_spaces,
    not_utf8,
    unreadable,
]


def restore(path: Path, token: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    path.write_text(token + "\n")


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__)
def test_a_broken_token_file_refuses_every_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breakage: Callable[[Path], None]
) -> None:
    """With the env token beside the file (a rotation window), both are refused: the file
    going bad means the operator's Secret went bad, so nothing is trusted until it is back."""
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("KVGATE_TEST_OP_TOKEN", OTHER)
    auth = OperatorAuth(
        load_operator_tokens(
            server_config(admin_token_file=str(path), admin_token_env="KVGATE_TEST_OP_TOKEN")
        )
    )
    exposed = {"listen": "0.0.0.0:1", "listen_field": "server.admin_listen"}
    assert auth.check(f"Bearer {TOKEN}", **exposed) is None
    assert auth.token_file_valid() is True

    breakage(path)
    for token in (TOKEN, OTHER):
        denial = auth.check(f"Bearer {token}", **exposed)
        assert denial is not None and denial.status == 401 and denial.code == REVOKED, token
        assert "server.admin_token_file" in denial.message and str(path) not in denial.message
    # On loopback too: a revoked token file never falls back to the no-token rule.
    denial = auth.check(None, listen="127.0.0.1:1", listen_field="server.admin_listen")
    assert denial is not None and denial.code == REVOKED
    assert auth.token_file_valid() is False

    restore(path, OTHER)  # a new token: the old one stays refused
    assert auth.token_file_valid() is True
    assert auth.check(f"Bearer {OTHER}", **exposed) is None
    denial = auth.check(f"Bearer {TOKEN}", **exposed)
    assert denial is not None and denial.code == "invalid_operator_token"


async def test_deleted_token_file_revokes_until_restored(
    tmp_path: Path, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    kvgate = await start_server(tmp_path, admin_token_file=str(token_file))
    usage = f"http://127.0.0.1:{kvgate.http_port}/admin/usage"
    admin = f"127.0.0.1:{kvgate.admin_port}"
    try:
        assert (await get(http, usage, token=TOKEN))[0] == 200
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.OK
        assert await token_file_valid_metric(http, kvgate) == "kvgate_operator_token_file_valid 1.0"

        token_file.unlink()
        # The metric sees it at the scrape, before any operator call.
        assert await token_file_valid_metric(http, kvgate) == "kvgate_operator_token_file_valid 0.0"
        status, _, body = await get(http, usage, token=TOKEN)
        assert status == 401 and body["error"]["code"] == REVOKED
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.UNAUTHENTICATED
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("every operator token is refused" in r.getMessage() for r in warnings)

        token_file.write_text(TOKEN + "\n")
        assert (await get(http, usage, token=TOKEN))[0] == 200
        assert await admin_call(admin, TOKEN) == grpc.StatusCode.OK
        assert await token_file_valid_metric(http, kvgate) == "kvgate_operator_token_file_valid 1.0"
        assert "operator tokens accepted" in caplog.text
    finally:
        await kvgate.stop()
    assert TOKEN not in rendered_logs(caplog)


async def test_token_removed_from_the_secret_volume_revokes(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The kubelet's swap publishes a Secret without the key: the file's symlink dangles."""
    volume = SecretVolume(tmp_path / "kvgate-admin-token")
    volume.publish({"token": (TOKEN + "\n").encode()})
    kvgate = await start_server(tmp_path, admin_token_file=volume.path("token"))
    usage = f"http://127.0.0.1:{kvgate.http_port}/admin/usage"
    try:
        assert (await get(http, usage, token=TOKEN))[0] == 200
        volume.publish({"other": b"x"})
        status, _, body = await get(http, usage, token=TOKEN)
        assert status == 401 and body["error"]["code"] == REVOKED
        volume.publish({"token": (OTHER + "\n").encode()})
        assert (await get(http, usage, token=OTHER))[0] == 200
        assert (await get(http, usage, token=TOKEN))[0] == 401
    finally:
        await kvgate.stop()


async def test_no_token_file_no_metric_sample(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    kvgate = await start_server(tmp_path)
    try:
        async with http.get(f"http://127.0.0.1:{kvgate.http_port}/metrics") as response:
            text = await response.text()
        assert "# TYPE kvgate_operator_token_file_valid gauge" in text
        assert "\nkvgate_operator_token_file_valid " not in text
    finally:
        await kvgate.stop()
