"""A configuration of many tenants: how long `kvgate check-config` and load + compile take,
and how much memory they need at their peak, now and at an earlier revision.

    python bench/config_scale.py --tenants 100000 --baseline 6bb824c

writes the config once (--out, default /tmp), then runs each measurement in a child process
of its own and reads its peak RSS from `resource.getrusage(RUSAGE_CHILDREN)` in a fresh
measurer process (the peak of all of a process's waited-for children, so one measurer per
run). `--baseline REV` exports `src/kvgate` at that revision (git archive) and runs the same
measurements against it, beside the working tree's, with their ratios. Not a timed test:
compare the ratios, the machine is shared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODELS = ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gpt-oss-20b")
# Tiers, as a real fleet has them: most tenants share one of a few limit and budget shapes.
RPM_TIERS = (60, 600, 3000)
TPM_TIERS = (20_000, 100_000, 1_000_000)
DAILY_USD = ("5", "50", "500")
MONTHLY_USD = ("100", "1000", "10000")


def _key_hash(index: int, which: int = 0) -> str:
    return hashlib.sha256(f"sk-tenant-{index}-{which}".encode()).hexdigest()


def _limits(rng: random.Random, indent: str) -> list[str]:
    lines = [f"{indent}rpm: {rng.choice(RPM_TIERS)}", f"{indent}tpm: {rng.choice(TPM_TIERS)}"]
    if rng.random() < 0.2:
        lines.append(f"{indent}concurrency: {rng.choice((4, 16, 64))}")
    return lines


def _tenant(index: int, rng: random.Random, yaml_1_1: bool = False) -> list[str]:
    lines = [f"  - name: tenant-{index:06d}"]
    if rng.random() < 0.05:  # a rotation in progress: two keys
        lines += [
            "    api_key_sha256:",
            f"      - {_key_hash(index)}",
            f"      - {_key_hash(index, 1)}",
        ]
    else:
        lines.append(f"    api_key_sha256: {_key_hash(index)}")
    lines.append("    limits:")
    lines += _limits(rng, "      ")
    tier = rng.randrange(len(DAILY_USD))
    lines += [
        "    budget:",
        f'      daily_usd: "{DAILY_USD[tier]}"',
        f'      monthly_usd: "{MONTHLY_USD[tier]}"',
    ]
    if rng.random() < 0.1:
        lines.append("      action: fallback")
        lines.append(f"      fallback_model: {MODELS[0]}")
    if rng.random() < 0.1:
        lines.append("    model_limits:")
        for model in rng.sample(MODELS, 2):
            lines.append(f"      {model}:")
            lines += _limits(rng, "        ")
    if rng.random() < 0.05:
        lines.append(f"    priority: {rng.choice((-10, 5, 10))}")
        lines.append("    allowed_priorities: [0, 1]")
    if rng.random() < 0.03:
        lines.append("    teams:")
        for team in ("research", "product")[: rng.randint(1, 2)]:
            lines.append(f"      {team}:")
            lines.append("        limits:")
            lines += _limits(rng, "          ")
            lines.append(f"        models: [{MODELS[1]}, {MODELS[2]}]")
    if rng.random() < 0.02:
        lines.append("    users:")
        lines.append(f"      user-{index}@example.com:")
        lines.append("        budget:")
        lines.append('          daily_usd: "1.5"')
    if rng.random() < 0.01:
        lines.append("    user_limits:")
        lines.append("      limits:")
        lines.append("        rpm: 30")
    if rng.random() < 0.02:
        # `on`: a YAML 1.1 boolean (PyYAML reads the file), a string to YAML 1.2.
        lines.append(f"    response_cache: {'on' if yaml_1_1 else 'true'}")
    return lines


def generate_config(tenants: int, seed: int = 0, yaml_1_1: bool = False) -> str:
    """A config of `tenants` tenants (two backends, four models), as YAML text; with
    `yaml_1_1`, some booleans written as YAML 1.1 has them (`on`), read by PyYAML."""
    rng = random.Random(seed)
    lines = [
        "server:",
        "  grpc_listen: 127.0.0.1:50051",
        "backends:",
        "  - name: pool-a",
        "    kv_budget_tokens: 2000000",
        "  - name: pool-b",
        "    kv_budget_tokens: 1000000",
        "models:",
    ]
    for i, model in enumerate(MODELS):
        lines += [
            f"  - name: {model}",
            f"    tokenizer: example/{model}",
            f"    backend: pool-{'ab'[i % 2]}",
            "    max_context: 32768",
            "    default_max_new_tokens: 1024",
            "    pricing:",
            '      input_per_million: "0.15"',
            '      output_per_million: "0.60"',
        ]
    lines.append("tenants:")
    for index in range(tenants):
        lines += _tenant(index, rng, yaml_1_1)
    return "\n".join(lines) + "\n"


# What each measurement runs, in a child of its own ({path}: the config file).
CHECK_CONFIG = (
    "import sys; from kvgate.cli import main; "
    "sys.argv = ['kvgate', 'check-config', {path!r}]; sys.exit(main())"
)
LOAD_AND_COMPILE = (
    "from kvgate.config import compile_snapshot, load_config; "
    "compile_snapshot(load_config({path!r}))"
)


def _measure_child(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run `argv` as this process's only child: its wall time, CPU time (user + system:
    steadier than the wall time on a shared machine) and peak RSS."""
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode not in (0, None):
        raise SystemExit(f"{argv[-1][:80]}... failed: {done.stderr[-2000:]}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def measure(code: str, src: Path) -> dict[str, float]:
    """`code` run in a fresh child of a fresh measurer, importing kvgate from `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    measurer = [sys.executable, __file__, "--child", code]
    done = subprocess.run(measurer, env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def export_revision(revision: str, into: Path) -> Path:
    """`src/kvgate` as it was at `revision`, under `into`/src."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "src/kvgate"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="the config file to write")
    parser.add_argument("--baseline", default=None, help="a git revision to compare with")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the best is kept")
    parser.add_argument(
        "--yaml-1-1", action="store_true", help="booleans as `on` (the file read by PyYAML)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child = [sys.executable, "-c", args.child]
        print(json.dumps(_measure_child(child, dict(os.environ))))
        return

    name = f"kvgate-{args.tenants}-tenants{'-yaml-1-1' if args.yaml_1_1 else ''}.yaml"
    path = args.out or Path(tempfile.gettempdir()) / name
    if not path.exists():
        path.write_text(generate_config(args.tenants, args.seed, args.yaml_1_1), encoding="utf-8")
    size_mb = path.stat().st_size / 1e6
    print(f"{path}: {args.tenants} tenants, {size_mb:.1f} MB of YAML")

    trees = {"now": REPO / "src"}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            trees = {"before": export_revision(args.baseline, Path(scratch)), **trees}
        results: dict[str, dict[str, dict[str, float]]] = {}
        for label, code in (("check-config", CHECK_CONFIG), ("load+compile", LOAD_AND_COMPILE)):
            for tree, src in trees.items():
                runs = [measure(code.format(path=str(path)), src) for _ in range(args.repeat)]
                best = {key: min(r[key] for r in runs) for key in runs[0]}
                results.setdefault(label, {})[tree] = best
                print(
                    f"{label:13} {tree:7} {best['wall_s']:7.2f} s  ({best['cpu_s']:5.2f} s CPU)  "
                    f"{best['peak_rss_mb']:7.0f} MB peak RSS",
                    flush=True,
                )
            if "before" in results[label]:
                before, now = results[label]["before"], results[label]["now"]
                print(
                    f"{label:13} ratio   {now['wall_s'] / before['wall_s']:7.2f} x  "
                    f"({now['cpu_s'] / before['cpu_s']:5.2f} x CPU)  "
                    f"{now['peak_rss_mb'] / before['peak_rss_mb']:7.2f} x"
                )


if __name__ == "__main__":
    main()
