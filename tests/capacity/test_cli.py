"""The kv-budget subcommand, mounted on a parser of our own."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from kvgate.capacity.cli import add_kv_budget_command, run_kv_budget
from testbed.demo_model import demo_model_dir
from tests.capacity.model_configs import DEEPSEEK_V3, LLAMA3_8B


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate")
    add_kv_budget_command(p.add_subparsers(dest="command", required=True))
    return p


def run(argv: list[str]) -> tuple[int, str, str]:
    args = parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    assert args.func is run_kv_budget
    code = args.func(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return tmp_path


def test_table(llama_dir: Path) -> None:
    code, out, err = run(
        ["kv-budget", "--model-config", str(llama_dir), "--gpu-memory", "24GiB",
         "--weights", "16GiB"]
    )  # fmt: skip
    assert code == 0, err
    assert err == ""
    lines = dict(line.split("  ", 1) for line in out.splitlines() if not line.startswith("note"))
    fields = {k.strip(): v.strip() for k, v in lines.items()}
    assert fields["bytes/token"] == "131,072"
    assert fields["KiB/token"] == "128"
    # Default overhead 2 GiB, utilization 1.0: the seed example.
    assert fields["overhead"] == "2 GiB"
    assert fields["KV tokens"] == "49,152"
    assert fields["KV blocks (num_gpu_blocks)"] == "3,072"
    assert fields["KV dtype"] == "bfloat16 (2 B)"


def test_json(llama_dir: Path) -> None:
    code, out, _ = run(
        ["kv-budget", "--model-config", str(llama_dir / "config.json"), "--gpu-memory",
         "24 GiB", "--weights", "16 GiB", "--overhead", "2GiB", "--kv-dtype", "fp8",
         "--block-size", "32", "--json"]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["bytes_per_token"] == 65536
    assert data["kv_tokens"] == 98304
    assert data["block_size"] == 32
    assert data["num_gpu_blocks"] == 3072


def test_tp_and_utilization(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    code, out, _ = run(
        ["kv-budget", "--model-config", str(tmp_path), "--gpu-memory", "20GiB",
         "--weights", "10GiB", "--overhead", "0", "--tp", "8", "--json"]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["layout"]["attention"] == "mla"
    assert data["bytes_per_token_per_gpu"] == 70272
    assert data["kv_tokens"] == 152797
    assert any("replicated" in n for n in data["notes"])


def test_demo_model_dir() -> None:
    # The repo's demo model has Qwen2.5-7B's shape: 2 x 28 x 4 x 128 x 2 = 57,344 B.
    code, out, _ = run(
        ["kv-budget", "--model-config", str(demo_model_dir()), "--gpu-memory", "24GiB",
         "--weights", "15GiB", "--overhead", "1GiB", "--json"]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["bytes_per_token"] == 57344
    # 8 GiB / 56 KiB = 149,796.57 -> 149,796 tokens, 9,362 blocks.
    assert data["kv_tokens"] == 149796
    assert data["num_gpu_blocks"] == 9362


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpu-memory", "24GiB", "--weights", "23GiB"], "no GPU memory left"),
        (["--gpu-memory", "24G", "--weights", "16GiB"], "--gpu-memory: unknown unit"),
        (["--gpu-memory", "24GiB", "--weights", "lots"], "--weights: not a size"),
        (["--gpu-memory", "24GiB", "--weights", "1GiB", "--kv-dtype", "int4"], "unknown KV"),
        (["--gpu-memory", "24GiB", "--weights", "1GiB", "--tp", "0"], "tensor-parallel"),
    ],
)
def test_errors_exit_2(llama_dir: Path, extra: list[str], message: str) -> None:
    code, out, err = run(["kv-budget", "--model-config", str(llama_dir), *extra])
    assert code == 2
    assert out == ""
    assert err.startswith("kvgate kv-budget: ")
    assert message in err


def test_missing_config_exits_2(tmp_path: Path) -> None:
    code, _, err = run(
        ["kv-budget", "--model-config", str(tmp_path), "--gpu-memory", "24GiB",
         "--weights", "16GiB"]
    )  # fmt: skip
    assert code == 2
    assert "has no config.json" in err


def test_missing_field_exits_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    code, _, err = run(
        ["kv-budget", "--model-config", str(tmp_path), "--gpu-memory", "24GiB",
         "--weights", "16GiB"]
    )  # fmt: skip
    assert code == 2
    assert "num_hidden_layers" in err


def test_notes_are_printed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "sliding_window": 4096}))
    code, out, _ = run(
        ["kv-budget", "--model-config", str(tmp_path), "--gpu-memory", "24GiB",
         "--weights", "16GiB"]
    )  # fmt: skip
    assert code == 0
    assert "note: sliding-window attention (window 4096)" in out
