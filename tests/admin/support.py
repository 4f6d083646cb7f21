"""What the operator-access tests share: a real kvgate started from the session tests'
config, and `kvgate backends --admin ...` run as a subprocess, as an operator runs it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from kvgate.app import KvgateServer
from kvgate.config import load_config
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
