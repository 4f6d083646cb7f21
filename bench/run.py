"""One command for the whole benchmark.

    .venv/bin/python -m bench.run --quick     # ~5 min: 2 rounds, short runs
    .venv/bin/python -m bench.run             # ~25-30 min: 3 rounds, longer runs

Starts the simulator, plain Envoy, Envoy + a no-op ext_proc, Envoy + kvgate (memory and
Redis stores, and the split observability config), and LiteLLM's proxy, all on 127.0.0.1;
runs the phases in bench/experiments.py; writes bench/results/{runs,summary,targets}.csv,
summary.md, meta.json, profiles/, and docs/img/bench-*.png; stops everything it started.

Needs: `wrk` (Debian package) and `py-spy` (PyPI) for the peak and profile phases; LiteLLM
is installed on first use into var/bench/litellm-venv (its own venv: its pins would
downgrade packages of kvgate's venv). Redis at 127.0.0.1:6379 for the Redis arm (the arm is
reported as skipped when the store or the server is not available). Benchmarks are not
part of the test suite and `.ci/run` needs none of this.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.experiments import FULL, QUICK, Bench
from bench.provenance import cpu_model
from bench.stack import ARM_ORDER, LITELLM_VENV, REPO_ROOT, BenchStack, ensure_litellm

PHASES = ("baseline", "peak", "load", "sustain", "reject", "sizes", "profile", "stream")
# The experiment names a phase writes (runs.csv's `experiment` column), for --merge.
PHASE_EXPERIMENTS = {"sustain": ("sustain", "sustain_result"), "sizes": ("size",)}


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "?"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "?"


def machine_info() -> dict[str, Any]:
    envoy = REPO_ROOT / ".venv" / "bin" / "envoy"
    dirty = _version(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "src", "envoy"])
    return {
        # What was measured: kvgate's code is the commit plus any uncommitted change to src/.
        "git_commit": _version(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"]),
        "src_uncommitted_changes": dirty not in ("", "?"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model() or "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": _version([str(envoy), "--version"]),
        "wrk": _version(["wrk", "--version"]),
        "litellm": _version(
            [
                str(LITELLM_VENV / "bin" / "python"),
                "-c",
                "import importlib.metadata as m; print(m.version('litellm'))",
            ]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvgate benchmark (see docs/benchmarks.md)")
    parser.add_argument("--quick", action="store_true", help="~5 min instead of ~30")
    parser.add_argument(
        "--arms",
        default=",".join(ARM_ORDER),
        help=f"comma-separated subset of {','.join(ARM_ORDER)}",
    )
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}"
    )
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--img", type=Path, default=REPO_ROOT / "docs" / "img")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--no-litellm-install",
        action="store_true",
        help="do not install LiteLLM when missing (its arm is skipped)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, raw runs)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the other phases already in RESULTS/runs.csv (rerun some phases)",
    )
    args = parser.parse_args(argv)

    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = set(arms) - set(ARM_ORDER)
    if unknown:
        parser.error(f"unknown arms: {sorted(unknown)}")
    if "envoy" not in arms:
        parser.error("the envoy arm is the reference and cannot be left out")
    phases = [p for p in args.phases.split(",") if p]
    plan = QUICK if args.quick else FULL
    if shutil.which("wrk") is None:
        print("wrk is missing: apt-get install wrk (needed for the peak phase)", file=sys.stderr)
        return 2

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    work_dir = REPO_ROOT / "var" / "bench" / f"run-{stamp}"
    work_dir.mkdir(parents=True, exist_ok=True)
    log_file = (work_dir / "bench.log").open("a", encoding="utf-8")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    if "litellm" in arms and not args.no_litellm_install:
        why = ensure_litellm(log=work_dir / "litellm-install.log")
        if why:
            log(f"LiteLLM: {why}")

    started = time.time()
    meta: dict[str, Any] = {
        "plan": plan.name,
        "plan_settings": plan.describe(),
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "arms_requested": list(arms),
        "work_dir": str(work_dir),
    }
    stack = BenchStack(work_dir, arms=arms, redis_url=args.redis_url)
    bench: Bench | None = None
    try:
        log(f"starting the stack in {work_dir} ...")
        stack.start()
        for line in stack.describe():
            log("  " + line)
        bench = Bench(stack, plan, work_dir, args.results, log=log, phases=phases)
        previous = args.results / "meta.json"
        if args.merge and previous.exists():
            # Later phases scale their load from earlier ones' results: reuse them.
            old = json.loads(previous.read_text())
            bench.ctx.peak_rps = dict(old.get("peak_rps") or {})
            bench.ctx.baseline_p99_ms = dict(old.get("baseline_p99_ms") or {})
        bench.run()
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    finally:
        # A second Ctrl-C must not cut short the clean-up: every process we started stops.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if bench is not None:
            bench.close()
        stack.stop()
        meta["skipped"] = stack.skipped
        meta["finished"] = dt.datetime.now().isoformat(timespec="seconds")
        meta["duration_s"] = round(time.time() - started)
        if bench is not None:
            meta["prompt_tokens"] = bench.ctx.prompt_tokens
            meta["reference_peak_rps"] = bench.ctx.peak_rps.get("envoy", 0.0)
            meta["peak_rps"] = bench.ctx.peak_rps
            meta["baseline_p99_ms"] = bench.ctx.baseline_p99_ms
            meta["stream_tokens"] = plan.stream_tokens
            meta["stream_itl_ms"] = plan.stream_itl_ms
            rows = list(bench.rows)
            if args.merge and (args.results / "runs.csv").exists():
                rerun = {e for p in phases for e in PHASE_EXPERIMENTS.get(p, (p,))}
                kept = [
                    r
                    for r in report.read_rows(args.results / "runs.csv")
                    if r.get("experiment") not in rerun | {"skipped"}
                ]
                rows = kept + rows
                old_meta = args.results / "meta.json"
                if old_meta.exists():
                    merged = json.loads(old_meta.read_text())
                    for key, value in meta.items():  # this run's figures, where it has them
                        if key in ("plan_settings", "started", "duration_s"):
                            merged[f"merged_{key}"] = value
                        elif value or key not in merged:
                            merged[key] = value
                    merged["merged_phases"] = phases
                    meta = merged
            for name, why in stack.skipped.items():
                rows.append({"experiment": "skipped", "round": -1, "arm": name, "error_kinds": why})
            if rows:
                md = report.write_all(rows, args.results, args.img, meta)
                log(md)
        log(f"done in {time.time() - started:.0f}s; results in {args.results}")
        for name, why in stack.skipped.items():
            log(f"skipped arm {name}: {why}")
        log_file.close()
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"work dir kept: {work_dir}")
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
