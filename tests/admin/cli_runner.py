"""`kvgate backends --admin ...` run as a subprocess, as an operator runs it."""

from __future__ import annotations

import asyncio
import os
import sys


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
