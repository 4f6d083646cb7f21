"""A/B of kvgate's own cost under one fixed open-loop load: two `kvgate serve` variants.

    .venv/bin/python -m bench.ab_kvgate --b-args="--log-level warning" [--rate 150]

Starts Envoy + kvgate (memory store) + the simulator twice, once per variant (A: default
arguments, B: `--b-args`), runs `--rounds` open-loop runs of a 1k-token chat request at
`--rate` against each, alternating A and B, and prints kvgate's CPU per request and the
latency percentiles. Used for the logging measurement in docs/benchmarks.md; handy to check
an optimisation of kvgate (run it on two checkouts by pointing --a-args/--b-args at options,
or compare before/after by hand).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import tempfile
from pathlib import Path

from bench.experiments import FULL, Bench
from bench.stack import BenchStack, SimSettings
from bench.stats import Spread


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-args", default="", help="extra `kvgate serve` args for A")
    parser.add_argument("--b-args", required=True, help="extra `kvgate serve` args for B")
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    variants = {"A": shlex.split(args.a_args), "B": shlex.split(args.b_args)}
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            work = Path(tempfile.mkdtemp(prefix=f"kvbench-ab-{name}-"))
            stack = BenchStack(
                work, arms=("kvgate",), sim=SimSettings(), kvgate_args=tuple(variants[name])
            )
            try:
                stack.start()
                bench = Bench(stack, FULL, work, work / "results", log=lambda _line: None)
                try:
                    bench.phase_warmup()
                    job = bench._job(
                        stack.arms["kvgate"],
                        bench.bodies[(1000, False)],
                        mode="open",
                        rate=args.rate,
                        duration_s=args.seconds,
                        warmup_s=1.0,
                    )
                    row = bench.measure("ab", r, "kvgate", job, variant=name)
                finally:
                    bench.close()
            finally:
                stack.stop()
                shutil.rmtree(work, ignore_errors=True)
            results[name].append(row)
            print(
                f"round {r} {name}: kvgate {row['cpu_kvgate_ms_per_req']:.3f} ms CPU/request, "
                f"Envoy {row['cpu_envoy_ms_per_req']:.3f}, p50 {row['lat_p50']:.2f} ms, "
                f"p99 {row['lat_p99']:.2f} ms, foreign CPU {row['foreign_cpu_cores']:.2f} cores",
                flush=True,
            )
    for name, rows in results.items():
        cpu = Spread.of(r["cpu_kvgate_ms_per_req"] for r in rows)
        p50 = Spread.of(r["lat_p50"] for r in rows)
        p99 = Spread.of(r["lat_p99"] for r in rows)
        print(
            f"{name} ({args.a_args if name == 'A' else args.b_args or 'default'}): kvgate CPU "
            f"{cpu.fmt(3)} ms/request, p50 {p50.fmt()} ms, p99 {p99.fmt()} ms"
        )


if __name__ == "__main__":
    main()
