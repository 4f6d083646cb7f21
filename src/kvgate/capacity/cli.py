"""``kvgate kv-budget``: the KV token budget of a model on a GPU, from its config.json."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from kvgate.capacity.calculator import (
    DEFAULT_BLOCK_SIZE,
    KvBudget,
    KvBudgetError,
    compute_kv_budget,
    load_model_config,
)
from kvgate.capacity.units import SizeError, format_bytes, parse_size

DEFAULT_OVERHEAD = "2GiB"

EPILOG = """\
All memory figures are per GPU. Sizes take B, KB/MB/GB/TB (powers of 1000) or
KiB/MiB/GiB/TiB (powers of 1024), e.g. 24GiB, 80GB, 1.5TiB. vLLM's own default
--gpu-memory-utilization is 0.9.

example:
  kvgate kv-budget --model-config models/llama-3-8b --gpu-memory 24GiB --weights 16GiB
"""


def add_kv_budget_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``kv-budget`` to an argparse subparsers object; ``args.func(args)`` runs it."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "kv-budget",
        help="compute a model's KV-cache bytes per token and token budget on a GPU",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model-config",
        required=True,
        metavar="PATH_OR_DIR",
        help="the model's config.json, or its model directory",
    )
    p.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory of one GPU")
    p.add_argument("--weights", required=True, metavar="SIZE", help="model weights held by one GPU")
    p.add_argument(
        "--overhead",
        default=DEFAULT_OVERHEAD,
        metavar="SIZE",
        help=f"activations, CUDA graphs, non-torch memory per GPU (default {DEFAULT_OVERHEAD})",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="share of GPU memory vLLM may use, in (0, 1] (default 1.0)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        help="KV-cache dtype: auto (the model's dtype), bf16, fp16, fp8, fp8_e4m3, "
        "fp8_e5m2, fp32 (default auto)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_kv_budget)
    return p


def run_kv_budget(
    args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Print the budget; 0 on success, 2 (with a message on stderr) on any input error."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        budget = compute_kv_budget(
            load_model_config(args.model_config),
            gpu_memory_bytes=_size("--gpu-memory", args.gpu_memory),
            weights_bytes=_size("--weights", args.weights),
            overhead_bytes=_size("--overhead", args.overhead),
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_dtype=args.kv_dtype,
            tp=args.tp,
            block_size=args.block_size,
        )
    except KvBudgetError as exc:
        print(f"kvgate kv-budget: {exc}", file=err)
        return 2
    if args.json:
        json.dump(budget.to_dict(), out, indent=2)
        out.write("\n")
    else:
        out.write(render_table(budget))
    return 0


def render_table(budget: KvBudget) -> str:
    """A two-column, human-readable summary."""
    layout = budget.layout
    if layout.attention == "mla":
        shape = f"MLA latent {layout.head_dim} x {layout.num_layers} layers"
    else:
        shape = (
            f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
            f"{layout.head_dim} head_dim"
        )
    rows: list[tuple[str, str]] = [
        ("model type", str(layout.model_type or "?")),
        ("attention", shape),
        ("KV dtype", f"{layout.kv_dtype} ({layout.dtype_bytes} B)"),
        ("tensor parallel", str(layout.tp)),
        ("bytes/token", f"{layout.bytes_per_token:,}"),
        ("KiB/token", _kib(layout.bytes_per_token)),
    ]
    if layout.tp > 1:
        rows += [
            ("bytes/token per GPU", f"{layout.bytes_per_token_per_gpu:,}"),
            ("KiB/token per GPU", _kib(layout.bytes_per_token_per_gpu)),
        ]
    rows += [
        (
            "usable memory",
            f"{format_bytes(budget.gpu_memory_bytes)} x {budget.gpu_memory_utilization:g}"
            f" = {format_bytes(budget.usable_bytes)}",
        ),
        ("weights", format_bytes(budget.weights_bytes)),
        ("overhead", format_bytes(budget.overhead_bytes)),
        ("KV memory", format_bytes(budget.kv_memory_bytes)),
        ("KV tokens", f"{budget.kv_tokens:,}"),
        ("block size", str(budget.block_size)),
        ("KV blocks (num_gpu_blocks)", f"{budget.num_gpu_blocks:,}"),
        ("KV tokens in whole blocks", f"{budget.kv_tokens_block_aligned:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in budget.notes]
    return "\n".join(lines) + "\n"


def _kib(n: int) -> str:
    return f"{n / 1024:,.2f}".rstrip("0").rstrip(".")


def _size(flag: str, text: str) -> int:
    try:
        return parse_size(text)
    except SizeError as exc:
        raise KvBudgetError(f"{flag}: {exc}") from None
