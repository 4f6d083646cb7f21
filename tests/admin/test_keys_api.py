"""The key RPCs of the admin API through a real kvgate, and `kvgate keys` against it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import load_config
from kvgate.config.model import LevelConfig, hash_api_key
from tests.admin.support import TOKEN
from tests.session.conftest import make_config

AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
async def kvgate(tmp_path: Path) -> AsyncIterator[KvgateServer]:
    """kvgate with an operator token and the embedded key store in tmp_path."""
    config = make_config()
    token_file = tmp_path / "operator-token"
    token_file.write_text(TOKEN + "\n")
    config["server"]["admin_token_file"] = str(token_file)
    config["keys"] = {"store": "embedded", "path": str(tmp_path / "keys.sqlite3")}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    server = KvgateServer(load_config(path), path)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def admin(kvgate: KvgateServer) -> AsyncIterator[admin_pb2_grpc.AdminStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvgate.admin_port}") as channel:
        yield admin_pb2_grpc.AdminStub(channel)  # type: ignore[no-untyped-call]


async def refused(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    raise AssertionError("the call was not refused")


async def test_create_get_list_revoke_rotate(
    kvgate: KvgateServer, admin: admin_pb2_grpc.AdminStub
) -> None:
    created = await admin.CreateKey(
        admin_pb2.CreateKeyRequest(
            tenant="acme",
            team="search",
            labels={"env": "prod"},
            ttl_s=3600,
            limits_json=json.dumps({"limits": {"rpm": 30}, "models": ["qwen2.5-demo"]}),
        ),
        metadata=AUTH,
        timeout=10,
    )
    key = created.key
    assert created.secret.startswith("kvg-") and key.state == "active"
    assert (key.tenant, key.team, dict(key.labels)) == ("acme", "search", {"env": "prod"})
    assert key.expires_at_unix_s > time.time() + 3000
    asked = LevelConfig.model_validate({"limits": {"rpm": 30}, "models": ["qwen2.5-demo"]})
    assert LevelConfig.model_validate_json(key.limits_json) == asked
    # The gateway's directory finds it by the secret's hash.
    assert kvgate.services.keys is not None
    found = await kvgate.services.keys.lookup(hash_api_key(created.secret))
    assert found is not None and found.key_id == key.key_id

    shown = await admin.GetKey(admin_pb2.GetKeyRequest(key_id=key.key_id), metadata=AUTH)
    assert shown == key  # no secret anywhere but in the create's answer
    assert created.secret not in str(shown)

    others = [
        await admin.CreateKey(admin_pb2.CreateKeyRequest(tenant="acme"), metadata=AUTH)
        for _ in range(4)
    ]
    ids = sorted([key.key_id, *(o.key.key_id for o in others)])
    first = await admin.ListKeys(
        admin_pb2.ListKeysRequest(tenant="acme", page_size=3), metadata=AUTH
    )
    second = await admin.ListKeys(
        admin_pb2.ListKeysRequest(tenant="acme", page_size=3, page_token=first.next_page_token),
        metadata=AUTH,
    )
    assert [k.key_id for k in (*first.keys, *second.keys)] == ids
    assert first.next_page_token and not second.next_page_token

    rotated = await admin.RotateKey(
        admin_pb2.RotateKeyRequest(key_id=key.key_id, grace_s=600), metadata=AUTH
    )
    assert rotated.secret != created.secret and rotated.key.team == "search"
    old = await admin.GetKey(admin_pb2.GetKeyRequest(key_id=key.key_id), metadata=AUTH)
    assert old.state == "active" and old.revoked_at_unix_s > time.time() + 500  # its grace

    revoked = await admin.RevokeKey(
        admin_pb2.RevokeKeyRequest(key_id=rotated.key.key_id), metadata=AUTH
    )
    assert revoked.state == "revoked"
    record = await kvgate.services.keys.lookup(hash_api_key(rotated.secret))
    assert record is not None and record.refusal(time.time()) is not None


async def test_refusals(admin: admin_pb2_grpc.AdminStub) -> None:
    create = admin.CreateKey
    assert (
        await refused(create(admin_pb2.CreateKeyRequest(tenant="acme"), timeout=10))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert (
        await refused(create(admin_pb2.CreateKeyRequest(tenant="nobody"), metadata=AUTH))
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        await refused(
            create(
                admin_pb2.CreateKeyRequest(tenant="acme", limits_json='{"models": ["gpt-9"]}'),
                metadata=AUTH,
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        await refused(
            create(admin_pb2.CreateKeyRequest(tenant="acme", limits_json="{"), metadata=AUTH)
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        await refused(create(admin_pb2.CreateKeyRequest(tenant="acme", ttl_s=-5), metadata=AUTH))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        await refused(
            admin.GetKey(admin_pb2.GetKeyRequest(key_id="key_0000000000000000"), metadata=AUTH)
        )
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        await refused(admin.RevokeKey(admin_pb2.RevokeKeyRequest(key_id="../etc"), metadata=AUTH))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        await refused(admin.ListKeys(admin_pb2.ListKeysRequest(page_token="nope"), metadata=AUTH))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


async def kvgate_keys(address: str, token_file: Path, *args: str) -> tuple[int, str, str]:
    """`kvgate keys ...` as an operator runs it: (exit code, stdout, stderr)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_ADMIN_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "keys",
        *args,
        "--admin",
        address,
        "--token-file",
        str(token_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_cli(kvgate: KvgateServer, tmp_path: Path) -> None:
    address = f"127.0.0.1:{kvgate.admin_port}"
    token = tmp_path / "operator-token"
    assert kvgate.services.keys is not None

    code, out, err = await kvgate_keys(
        address, token, "create", "--tenant", "acme", "--user", "u-1", "--label", "env=ci",
        "--expires-in", "30d", "--models", "qwen2.5-demo",
    )  # fmt: skip
    assert code == 0, err
    [secret] = out.splitlines()  # the key alone on stdout
    assert secret.startswith("kvg-")
    record = await kvgate.services.keys.lookup(hash_api_key(secret))
    assert record is not None and record.user == "u-1" and dict(record.labels) == {"env": "ci"}
    assert record.limits is not None and record.limits.models == ["qwen2.5-demo"]
    assert record.key_id in err

    code, out, err = await kvgate_keys(address, token, "list", "--json")
    assert code == 0, err
    assert [k["key_id"] for k in json.loads(out)["keys"]] == [record.key_id]
    code, out, _ = await kvgate_keys(address, token, "list")
    assert record.key_id in out and "acme" in out and secret not in out

    code, out, err = await kvgate_keys(address, token, "rotate", record.key_id, "--grace", "1h")
    assert code == 0, err
    [new_secret] = out.splitlines()
    assert new_secret != secret
    assert await kvgate.services.keys.lookup(hash_api_key(new_secret)) is not None

    code, out, err = await kvgate_keys(address, token, "revoke", record.key_id)
    assert code == 0, err
    assert "revoked" in out
    code, out, _ = await kvgate_keys(address, token, "show", record.key_id, "--json")
    assert json.loads(out)["state"] == "revoked"

    code, _, err = await kvgate_keys(address, token, "create", "--tenant", "nobody")
    assert code == 2 and "NOT_FOUND" in err
