"""What the operator-access tests share: a real kvgate started from the session tests'
config, `kvgate backends --admin ...` run as a subprocess, as an operator runs it, the operator
tokens, and clients of the operator surfaces (plain, and over TLS with a test PKI)."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml

from kvgate.admin.auth import is_loopback_listen
from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import load_config, parse_config
from kvgate.logs import JsonFormatter
from tests.admin.pki import Pki
from tests.session.conftest import make_config


async def start_server(tmp_path: Path, **server: Any) -> KvgateServer:
    """A started kvgate whose `server:` section has `server` on top of the test config."""
    config = make_config()
    config["server"].update(server)
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    kvgate = KvgateServer(load_config(path), path)
    await kvgate.start()
    return kvgate


async def run_backends_cli(
    address: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """(exit code, stdout + stderr). The environment is this process's without any
    KVGATE_ADMIN_* (nothing from the developer's shell), plus `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_ADMIN_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "backends",
        "--admin",
        address,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean | (env or {}),
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return process.returncode, stdout.decode() + stderr.decode()


# --------------------------------------------------------------------------- tokens and logs


TOKEN = "op-token-3f9c1a7e5b2d4c6e8a0b"
OTHER = "op-token-rotated-00112233445566"


def non_loopback_ip() -> str | None:
    """This machine's address on a non-loopback interface, if it has one."""
    candidates = []
    for target in ("10.254.254.254", "192.0.2.1", "8.8.8.8"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((target, 9))  # no packet is sent: only the route is chosen
                candidates.append(probe.getsockname()[0])
            except OSError:
                continue
    candidates = [a for a in candidates if a != "0.0.0.0" and not is_loopback_listen(f"{a}:0")]
    if not candidates:
        return None
    address = candidates[0]
    try:  # it must be bindable here
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return None
    return address


EXPOSED_IP = non_loopback_ip()


def rendered_logs(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record as kvgate writes it (JSON, with its extra fields)."""
    formatter = JsonFormatter()
    return "\n".join(formatter.format(record) for record in caplog.records)


def server_config(**server: Any) -> Any:
    config = make_config()
    config["server"].update(server)
    return parse_config(config).server


# --------------------------------------------------------------------------- plain HTTP and gRPC


async def get(
    http: aiohttp.ClientSession, url: str, token: str | None = None, raw: str | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": raw if raw is not None else f"Bearer {token}"}
    async with http.get(url, headers=headers if (token or raw) else None) as response:
        body = await response.json() if "json" in response.content_type else await response.text()
        return response.status, dict(response.headers), body


async def admin_call(address: str, token: str | None = None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            await stub.ListBackends(admin_pb2.ListBackendsRequest(), metadata=metadata, timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        try:
            await stub.GetTenantUsage(
                admin_pb2.GetTenantUsageRequest(tenant="acme"), metadata=metadata, timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


# --------------------------------------------------------------------------- TLS


def tls_section(pki: Pki, *, mutual: bool = True, suffix: str = "") -> dict[str, str]:
    section = {
        "cert_file": str(pki.crt(f"server{suffix}")),
        "key_file": str(pki.key(f"server{suffix}")),
    }
    if mutual:
        section["client_ca_file"] = str(pki.crt(f"ca{suffix}"))
    return section


def client_context(pki: Pki, client: str | None, trust: str = "ca") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.crt(trust)))
    if client is not None:
        context.load_cert_chain(pki.crt(client), pki.key(client))
    return context


async def https_get(
    url: str,
    context: ssl.SSLContext | bool,
    token: str | None = None,
    server_hostname: str | None = None,
) -> tuple[int, Any]:
    """(status, body), or ("refused", the aiohttp error's name) when the handshake fails."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        try:
            async with session.get(
                url, ssl=context, headers=headers, server_hostname=server_hostname
            ) as response:
                body = (
                    await response.json()
                    if "json" in response.content_type
                    else await response.text()
                )
                return response.status, body
        except aiohttp.ClientError as exc:
            return "refused", type(exc).__name__  # type: ignore[return-value]


def grpc_channel(
    address: str,
    pki: Pki,
    client: str | None,
    trust: str = "ca",
    server_name: str | None = None,
) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.crt(trust).read_bytes(),
        private_key=pki.key(client).read_bytes() if client else None,
        certificate_chain=pki.crt(client).read_bytes() if client else None,
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else None
    return grpc.aio.secure_channel(address, credentials, options=options)
