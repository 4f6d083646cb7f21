"""Run the local stack in the foreground: vLLM simulator, kvgate, Envoy. Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO_MODEL = ROOT / "var/models/qwen2.5-demo"


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {url}")


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM (e.g. from a supervisor) stops the stack as cleanly as Ctrl-C does.
    raise KeyboardInterrupt


def main() -> int:
    os.chdir(ROOT)
    signal.signal(signal.SIGTERM, _interrupt)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sim = subprocess.Popen(
            [
                str(BIN / "vllm-sim"),
                "--model-dir",
                str(DEMO_MODEL),
                "--served-model-name",
                "qwen2.5-demo",
                "--port",
                "8000",
                "--num-gpu-blocks",
                "3000",
                "--block-size",
                "16",
                "--ttft-ms",
                "50",
                "--itl-ms",
                "10",
            ]
        )
        procs.append(sim)
        wait_http("http://127.0.0.1:8000/health", 120, sim)
        gate = subprocess.Popen(
            [str(BIN / "kvgate"), "serve", "--config", "deploy/local/kvgate.yaml"]
        )
        procs.append(gate)
        wait_http("http://127.0.0.1:9464/readyz", 120, gate)
        envoy = subprocess.Popen(
            [
                str(BIN / "envoy"),
                "-c",
                "envoy/envoy.yaml",
                "--concurrency",
                "2",
                "-l",
                "warning",
                "--use-dynamic-base-id",
            ]
        )
        procs.append(envoy)
        wait_http("http://127.0.0.1:9901/ready", 60, envoy)
        print(
            "\nkvgate stack up:\n"
            "  Envoy      http://127.0.0.1:10000  (try: curl -s localhost:10000/v1/models "
            "-H 'Authorization: Bearer sk-kvgate-demo')\n"
            "  kvgate     grpc 127.0.0.1:50051, metrics http://127.0.0.1:9464/metrics\n"
            "  simulator  http://127.0.0.1:8000  (metrics /metrics)\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
