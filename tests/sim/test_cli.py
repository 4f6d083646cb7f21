"""The ``vllm-sim`` console script serves on a real port."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.sim.helpers import MODEL, USER_HI

SCRIPT = Path(sys.executable).parent / "vllm-sim"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sim_process(model_dir: Path) -> Iterator[str]:
    exe = str(SCRIPT) if SCRIPT.exists() else shutil.which("vllm-sim")
    assert exe, "vllm-sim console script not installed"
    port = _free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--model-dir",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--port",
            str(port),
            "--num-gpu-blocks",
            "100",
            "--block-size",
            "8",
            "--force-include-usage",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_healthy(session: aiohttp.ClientSession, base: str) -> None:
    for _ in range(300):
        try:
            async with session.get(f"{base}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("vllm-sim did not become healthy")


async def test_console_script_serves(sim_process: str) -> None:
    async with aiohttp.ClientSession() as session:
        await _wait_healthy(session, sim_process)
        body = {"model": MODEL, "messages": USER_HI, "stream": True, "max_tokens": 3}
        async with session.post(f"{sim_process}/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
        # --force-include-usage: the usage chunk arrives without stream_options.
        assert raw.endswith(b"data: [DONE]\n\n")
        assert b'"choices":[],"usage":{"prompt_tokens":' in raw
        async with session.get(f"{sim_process}/metrics") as resp:
            text = await resp.text()
        assert 'num_gpu_blocks="100"' in text and 'block_size="8"' in text


def test_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_sim.cli", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--model-dir", "--served-model-name", "--num-gpu-blocks", "--itl-ms"):
        assert flag in out.stdout


@pytest.fixture
def sim_with_env_key(model_dir: Path) -> Iterator[str]:
    exe = str(SCRIPT) if SCRIPT.exists() else shutil.which("vllm-sim")
    assert exe, "vllm-sim console script not installed"
    port = _free_port()
    argv = [exe, "--model-dir", str(model_dir), "--served-model-name", MODEL, "--port", str(port)]
    env = {**os.environ, "VLLM_API_KEY": "sk-env"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_console_script_api_key_from_env(sim_with_env_key: str) -> None:
    """VLLM_API_KEY reaches the real process: /v1 is closed, /health open."""
    base = sim_with_env_key
    async with aiohttp.ClientSession() as session:
        await _wait_healthy(session, base)
        body = {"model": MODEL, "messages": USER_HI, "max_tokens": 2}
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 401
            assert await resp.read() == b'{"error":"Unauthorized"}'
        headers = {"Authorization": "Bearer sk-env"}
        async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
        async with session.get(f"{base}/sim/requests") as resp:
            records = (await resp.json())["requests"]
        assert [r["status"] for r in records] == [401, 200]
