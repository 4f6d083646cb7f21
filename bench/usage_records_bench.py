"""Benchmark usage records: what a sink sustains, and what records cost the request path.

Not a test. Two parts:

- sink: the writer end to end (the request path's `add`, the spool's fsynced batch files,
  the sink's idempotent inserts) for SQLite and a private PostgreSQL server: records/s from
  the first `add` to the last row committed, and the cost of one `add` (ns).
- path: the real stack (Envoy -> kvgate -> simulator, no generation delay) driven by
  `--concurrency` clients for `--seconds`, with records off, to SQLite and to PostgreSQL:
  client latency p50/p99, kvgate's decision p99 (from its `kvgate_decision_seconds`
  histogram, interpolated in the bucket), requests/s.

    .venv/bin/python bench/usage_records_bench.py [--records 200000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
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
from tests.usage_records.records import make_record


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


def _histogram_quantile(metrics: Any, name: str, q: float) -> float:
    buckets: list[tuple[float, float]] = []
    for (sample, labels), value in metrics.samples.items():
        if sample == f"{name}_bucket":
            le = dict(labels)["le"]
            buckets.append((float("inf") if le == "+Inf" else float(le), value))
    totals: dict[float, float] = {}
    for le, value in buckets:
        totals[le] = totals.get(le, 0.0) + value
    ordered = sorted(totals.items())
    if not ordered or ordered[-1][1] == 0:
        return float("nan")
    target = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for le, cumulative in ordered:
        if cumulative >= target:
            if le == float("inf"):
                return lower
            share = (target - below) / max(cumulative - below, 1e-9)
            return lower + (le - lower) * share
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


def path_cost(mode: str, concurrency: int, seconds: float, dsn_file: Path | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvgate-records-bench-"))
    overrides: dict[str, Any] = {}
    if mode == "sqlite":
        overrides = {
            "usage_records": {
                "sink": "sqlite",
                "sqlite_path": str(work / "r.sqlite3"),
                "spool_dir": str(work / "spool"),
            }
        }
    elif mode == "postgres":
        assert dsn_file is not None
        overrides = {
            "usage_records": {
                "sink": "postgres",
                "postgres_dsn_file": str(dsn_file),
                "spool_dir": str(work / "spool"),
            }
        }
    try:
        with Stack(
            kvgate_overrides=overrides, work_dir=work, sim={"ttft_ms": 0, "itl_ms": 0}
        ) as stack:
            asyncio.run(_drive(stack.base_url, concurrency, 2.0))  # warm up
            before = kvgate_metrics(stack)
            latencies = asyncio.run(_drive(stack.base_url, concurrency, seconds))
            after = kvgate_metrics(stack)
            del before
            latencies.sort()
            inserted = after.total("kvgate_usage_records_total", state="inserted")
            return {
                "mode": mode,
                "requests_per_s": len(latencies) / seconds,
                "client_p50_ms": 1000 * statistics.median(latencies),
                "client_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
                "decision_p99_ms": 1000
                * _histogram_quantile(after, "kvgate_decision_seconds", 0.99),
                "records_inserted": inserted,
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--skip-path", action="store_true")
    args = parser.parse_args()
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
            for mode in ("off", "sqlite", "postgres", "off"):
                r = path_cost(mode, args.concurrency, args.seconds, dsn_file)
                print(
                    f"path {r['mode']:8} {r['requests_per_s']:>7.0f} req/s  client p50 "
                    f"{r['client_p50_ms']:.2f} ms p99 {r['client_p99_ms']:.2f} ms  decision p99 "
                    f"{r['decision_p99_ms']:.3f} ms  records {r['records_inserted']:.0f}"
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
