"""`python -m bench.pools`: the command line, the run of the chosen parts and its outputs."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import time
from pathlib import Path
from typing import Any

import bench.pools
from bench.pools.plans import FULL, PARTS, QUICK, Plans
from bench.pools.report import RAW, jsonable, markdown, write_raw
from bench.pools.rig import PoolRig
from bench.pools.scenarios import run_affinity, run_cost, run_fairness
from bench.provenance import git_output, machine
from testbed.harness import REPO_ROOT

RESULTS = REPO_ROOT / "bench" / "results" / "pools"


def run(parts: list[str], plans: Plans, work: Path, results: dict[str, Any]) -> None:
    t0 = time.monotonic()

    def stage(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {text}", flush=True)

    rig = PoolRig(work)
    try:
        stage("starting the processes")
        rig.start(parts, plans)
        for part in parts:
            if part == "affinity":
                stage("1. prefix affinity vs load-only vs round-robin")
                results["affinity"] = run_affinity(rig, plans.affinity, plans.quiet_timeout_s)
            elif part == "fairness":
                stage("2. fairness")
                results["fairness"] = run_fairness(rig, plans.fairness, plans.quiet_timeout_s)
            else:
                stage("3. decision cost")
                results["cost"] = run_cost(rig, plans.cost, plans.quiet_timeout_s)
        stage("done")
    finally:
        results["meta"]["notes"] = rig.notes
        rig.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pools", description=(bench.pools.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short runs (~2 min)")
    parser.add_argument("--parts", default=",".join(PARTS), help=",".join(PARTS))
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (process logs)")
    args = parser.parse_args(argv)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown or not parts:
        parser.error(f"--parts: choose from {', '.join(PARTS)}")

    started = dt.datetime.now()
    work = REPO_ROOT / "var" / "bench" / f"pools-{started:%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "pools-quick" if args.quick else "pools"
    dirty = git_output("status", "--porcelain", "--", "src", "sim", "envoy", "testbed")
    results: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "commit": git_output("rev-parse", "--short", "HEAD").strip(),
            "dirty": ", ".join(line[3:] for line in dirty.splitlines()),
            "started": f"{started:%Y-%m-%d %H:%M}",
            "machine": machine(),
            "parts": parts,
        }
    }
    t0 = time.monotonic()
    try:
        run(parts, QUICK if args.quick else FULL, work, results)
    finally:
        results["meta"]["duration_s"] = time.monotonic() - t0
        clean = jsonable(results)
        (out_dir / f"{stem}.json").write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
        with contextlib.suppress(Exception):
            (out_dir / f"{stem}.md").write_text(markdown(clean), encoding="utf-8")
        if RAW:
            write_raw(out_dir / f"{stem}-requests.csv.gz")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print((out_dir / f"{stem}.md").read_text(encoding="utf-8"))
    print(f"written: {out_dir / (stem + '.json')}, {out_dir / (stem + '.md')}")
    return 0
