"""Benchmark usage records: what a sink sustains, and what records cost the request path.

Not a test. Two parts:

- sink: the writer end to end (the request path's `add`, the spool's fsynced batch files,
  the sink's idempotent inserts) for SQLite and a private PostgreSQL server: records/s from
  the first `add` to the last row committed, and the cost of one `add` (ns).
- path: the real stack (Envoy -> kvgate -> simulator, no generation delay) driven by
  `--concurrency` clients, with records off, to SQLite and to PostgreSQL: the three stacks
  run side by side and take turns in `--rounds` slices of `--seconds`, so the machine's
  other load falls on each alike. Client latency p50/p99, kvgate's decision p50/p99 (its
  `kvgate_decision_seconds` histogram, interpolated in the bucket), requests/s.
- crash gap (`--crash-gap N`): a replica SIGKILLed N times under load; the ledger's requests
  no record holds, per kill.

    .venv/bin/python -m bench.usage_records_bench [--records 200000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate.usage_records import UsageRecordWriter
from kvgate.usage_records.postgres_sink import PostgresSink
from kvgate.usage_records.sink import RecordSink
from kvgate.usage_records.spool import Spool
from kvgate.usage_records.sqlite_sink import SqliteSink
from testbed.harness import Stack, kvgate_metrics
from testbed.postgres_harness import PostgresServer
from testbed.usage_records_rig import make_record


async def sink_throughput(sink: RecordSink, spool_dir: Path, count: int) -> dict[str, float]:
    writer = UsageRecordWriter(sink, Spool(spool_dir, 10**10), batch_size=1000)
    records = [make_record(n) for n in range(count)]
    writer.start()
    started = time.perf_counter()
    add_ns = 0
    for i in range(0, count, 1000):
        t0 = time.perf_counter_ns()
        for record in records[i : i + 1000]:
            writer.add(record)
        add_ns += time.perf_counter_ns() - t0
        await asyncio.sleep(0)  # the loop runs the background tasks, as between requests
    while writer.counts.inserted < count:  # noqa: ASYNC110 - polling the writer's counter
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    await writer.close()
    return {"records_per_s": count / elapsed, "add_ns": add_ns / count, "seconds": elapsed}


def _buckets(metrics: Any, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram, summed over its labels."""
    totals: dict[float, float] = {}
    for (sample, labels), value in metrics.samples.items():
        if sample == f"{name}_bucket":
            le = dict(labels)["le"]
            bound = float("inf") if le == "+Inf" else float(le)
            totals[bound] = totals.get(bound, 0.0) + value
    return totals


def _quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] == 0:
        return float("nan")
    target = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in ordered:
        if cumulative >= target:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (target - below) / max(cumulative - below, 1e-9)
        lower, below = le, cumulative
    return lower


async def _drive(base_url: str, concurrency: int, seconds: float) -> list[float]:
    latencies: list[float] = []
    ends = time.monotonic() + seconds
    body = {
        "model": "qwen2.5-demo",
        "messages": [{"role": "user", "content": "Say one word."}],
        "max_tokens": 1,
    }
    headers = {"authorization": "Bearer sk-kvgate-demo"}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:

        async def worker() -> None:
            while time.monotonic() < ends:
                t0 = time.perf_counter()
                reply = await client.post("/v1/chat/completions", json=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                assert reply.status_code == 200, reply.text

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def _overrides(mode: str, work: Path, dsn_file: Path) -> dict[str, Any]:
    if mode == "off":
        return {}
    records: dict[str, Any] = {"sink": mode, "spool_dir": str(work / f"spool-{mode}")}
    if mode == "sqlite":
        records["sqlite_path"] = str(work / "path.sqlite3")
    else:
        records["postgres_dsn_file"] = str(dsn_file)
    return {"usage_records": records}


def path_cost(
    modes: list[str], concurrency: int, seconds: float, rounds: int, work: Path, dsn_file: Path
) -> None:
    """The stacks run side by side and take turns (`rounds` slices of `seconds` each), so
    the machine's other load falls on every mode alike."""
    stacks: dict[str, Stack] = {}
    latencies: dict[str, list[float]] = {mode: [] for mode in modes}
    decisions: dict[str, dict[float, float]] = {mode: {} for mode in modes}
    try:
        for mode in modes:
            stack = Stack(
                kvgate_overrides=_overrides(mode, work, dsn_file),
                work_dir=work / f"stack-{mode}",
                sim={"ttft_ms": 0, "itl_ms": 0},
            )
            stacks[mode] = stack.start()
            asyncio.run(_drive(stack.base_url, concurrency, 2.0))  # warm up
        for round_ in range(rounds):
            for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
                stack = stacks[mode]
                before = _buckets(kvgate_metrics(stack), "kvgate_decision_seconds")
                latencies[mode] += asyncio.run(_drive(stack.base_url, concurrency, seconds))
                after = _buckets(kvgate_metrics(stack), "kvgate_decision_seconds")
                for le, count in after.items():
                    decisions[mode][le] = decisions[mode].get(le, 0.0) + count - before.get(le, 0)
        for mode in modes:
            done = sorted(latencies[mode])
            inserted = kvgate_metrics(stacks[mode]).total(
                "kvgate_usage_records_total", state="inserted"
            )
            print(
                f"path {mode:8} {len(done) / (seconds * rounds):>7.0f} req/s  client p50 "
                f"{1000 * statistics.median(done):.2f} ms p99 "
                f"{1000 * done[int(0.99 * (len(done) - 1))]:.2f} ms  decision p50 "
                f"{1000 * _quantile(decisions[mode], 0.5):.3f} ms p99 "
                f"{1000 * _quantile(decisions[mode], 0.99):.3f} ms  records {inserted:.0f}"
            )
    finally:
        for stack in stacks.values():
            stack.stop()


def crash_gap(trials: int) -> None:
    """SIGKILL one of two replicas (one Redis, one PostgreSQL) while 8 clients send requests,
    restart it, and count what the ledger booked that no record holds: what a crash loses."""
    from testbed.harness import wait_until
    from testbed.usage_records_rig import (
        TENANTS,
        RecordingStack,
        pg_counts,
        records_models,
        send_traffic,
    )

    work = Path(tempfile.mkdtemp(prefix="kvgate-records-gap-"))
    try:
        with PostgresServer() as postgres:
            dsn_file = work / "dsn"
            dsn_file.write_text(postgres.create_database())
            dsn = dsn_file.read_text()
            records = {
                "sink": "postgres",
                "postgres_dsn_file": str(dsn_file),
                "spool_dir": str(work / "spool1"),
                "retry_interval_s": 0.5,
            }
            with RecordingStack(
                tenants=TENANTS,
                models=records_models(),
                kvgate_overrides={"usage_records": records},
                work_dir=work,
                redis_config={"timeout_s": 1.0},
            ) as stack:
                missing_before = 0
                for trial in range(trials):

                    async def killed_mid_traffic(after_s: float) -> None:
                        traffic = asyncio.create_task(send_traffic(stack.base_url, 4.0, workers=8))
                        await asyncio.sleep(after_s)
                        stack.kill_kvgate()
                        with contextlib.suppress(Exception):  # requests on the killed replica
                            await traffic

                    asyncio.run(killed_mid_traffic(2.0 + 0.07 * trial))
                    stack.start_kvgate()
                    ledger = stack.ledger("demo")["requests"]
                    counts = wait_until(
                        lambda: pg_counts(postgres, dsn),
                        lambda c: c[0] >= ledger,  # noqa: B023 - read at once
                        timeout=15,
                        interval=0.5,
                    )
                    missing = ledger - counts[0]
                    print(
                        f"crash {trial}: ledger {ledger} requests, records {counts[0]}, lost "
                        f"{missing - missing_before} by this SIGKILL"
                    )
                    missing_before = missing
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="one slice of one mode")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--skip-path", action="store_true")
    parser.add_argument(
        "--crash-gap", type=int, default=0, metavar="TRIALS", help="only measure what SIGKILLs lose"
    )
    args = parser.parse_args()
    if args.crash_gap:
        crash_gap(args.crash_gap)
        return
    print(f"# {platform.platform()}, {platform.python_version()}")
    with PostgresServer() as postgres:
        work = Path(tempfile.mkdtemp(prefix="kvgate-records-bench-"))
        try:
            for name in ("sqlite", "postgres"):
                sink: RecordSink = (
                    SqliteSink(work / "r.sqlite3")
                    if name == "sqlite"
                    else PostgresSink(postgres.create_database())
                )
                result = asyncio.run(sink_throughput(sink, work / f"spool-{name}", args.records))
                print(
                    f"sink {name:8} {result['records_per_s']:>10,.0f} records/s "
                    f"({args.records} in {result['seconds']:.2f} s; add {result['add_ns']:.0f} ns)"
                )
            if args.skip_path:
                return
            dsn_file = work / "dsn"
            dsn_file.write_text(postgres.create_database())
            path_cost(
                ["off", "sqlite", "postgres"],
                args.concurrency,
                args.seconds,
                args.rounds,
                work,
                dsn_file,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
