"""Pools: prefix affinity, fair queueing and the cost of picking, measured.

    .venv/bin/python -m bench.pools --quick    # ~2 min: short versions of every part
    .venv/bin/python -m bench.pools            # the published run (~7 min)
    .venv/bin/python -m bench.pools --parts affinity,fairness,cost --out DIR --keep

Every process runs on 127.0.0.1 (free ports) and is started once: six vLLM simulators
(`vllm-sim`; r0-r2 for parts 1 and 2, c0-c2 for part 3), the main kvgate (memory store; each
arm is a hot reload of its config, SIGHUP, checked with `kvgate_config_reloads_total`; a
failed reload would restart it, noted in the results), its Envoy (`envoy/envoy.yaml`,
`--concurrency 1`, with the pool's ORIGINAL_DST cluster and a STATIC round-robin cluster of
r0-r2) and, for part 3, a kvgate with one plain backend (c0) behind its own Envoy and a plain
Envoy without ext_proc. Results: `bench/results/pools/pools.json`, `pools.md` and
`pools-requests.csv.gz` (every request of parts 1 and 2); `pools-quick.*` with --quick; `--out
DIR` writes there instead. Process logs: `var/bench/pools-<date>/logs` (kept with --keep).
Before each arm the run waits (bounded) for the shared machine to be quiet, and records the
CPU other users took during the arm.

**1. affinity** — prefix affinity against load-only picking and round-robin. r0-r2 run with
vLLM's prefix caching (`--enable-prefix-caching --enable-prompt-tokens-details`), 1,000 blocks
of 16 tokens, `--ttft-ms 2 --itl-ms 10` and a prefill cost of 50 ms per 1k uncached prompt
tokens (`--prefill-ms-per-1k-tokens 50`: on this machine the simulator itself spends ~45 ms
tokenizing a 3k-token prompt, which would hide a 20 ms/1k saving). Six tenants (API keys), each
with its own system prompt (2,000-4,000 tokens, distinct text); each request is a random
tenant's system prompt plus a short new user turn, streamed, 16 output tokens, closed loop with
8 in flight. Arms back to back on the same processes, simulators reset between arms
(`POST /sim/reset`, checked to empty the prefix cache; else they are restarted); the request
sequence is the same in every arm:

| arm                 | kvgate backend                                   | Envoy cluster          |
|---------------------|--------------------------------------------------|------------------------|
| pool-affinity       | pool of r0-r2, 16,000 KV tokens each, defaults   | ORIGINAL_DST           |
| pool-load           | the same, `picking.prefix_affinity: false`       | ORIGINAL_DST           |
| round-robin         | one backend of 48,000 KV tokens (the sum)        | STATIC x3, ROUND_ROBIN |
| pool-affinity-gate1 | the pool with `picking.load_gate: 1.0` (a probe) | ORIGINAL_DST           |

Per arm: prefix-cache hit rate from the simulators' counters (hits / queries, in tokens), mean
`cached_tokens` from the streamed usage, client TTFT (first content event) p50/p95/mean and
split by cache hit, throughput, and per pod the requests served (and by which tenants),
preemptions, the peak KV its running sequences held (a shared block once) against its
capacity, and kvgate's reserved KV on it (`kvgate_kv_tokens_in_flight`, sampled at 10 Hz).

**2. fairness** — a full pool with a queue, on r0-r2 with per-request `x-sim-*` headers
(5 ms TTFT, 10 ms per token, 32 output tokens, 8 tokens per SSE event). kvgate's budget per
endpoint is 2,400 tokens: two requests of ~1,010 prompt + 32 output tokens each, six in the
pool, ~0.4 s each. Closed loop: tenant `heavy` with 20 clients, `light` with 2, same shape:

| phase    | kvgate                                     | load                             |
|----------|--------------------------------------------|----------------------------------|
| queue    | pool with `queue: {max_wait_s: 10}`        | heavy 20, light 2                |
| no-queue | the same pool without a queue              | the same; a 429 retries in 0.1 s |
| priority | the queue; tenant `vip` has `priority: 1`  | heavy 20, light 2, vip 2         |

A request's admission time is its arrival at a simulator (`/sim/requests`, matched by an
`x-bench-id` header; Envoy forwards as soon as kvgate admits). Per tenant: attempts, 429s, the
wait from send to admission (client clock) and kvgate's own `kvgate_queue_wait_seconds`
(bucket-interpolated), requests and tokens (prompt + max_tokens) admitted per second, and the
VTC check: over every interval in which both heavy and light had a request waiting, the largest
difference of their weighted service (w_p·prompt + w_q·output, the queue's weights, counted at
admission), against 2·max over requests of (w_p·L_input + w_q·M); over the whole phase and
from the moment both had been admitted once (the start-up burst left out).

**3. cost** — one request in flight, arms interleaved request by request (bench/interleaved.py's
`send`: CPU per request from /proc/<pid>/task/*/schedstat): plain Envoy, kvgate with one
backend, kvgate with a pool of three (picking on); ~1k-token prompts, unique per request,
c0-c2 answering at once. And an in-process `timeit` of the pieces of `PoolScheduler.place`
(affinity_text, block_hashes, matches, rendezvous_order, rank_endpoints, record) for 3 and 32
endpoints and 1k / 16k-token prompts, on a prefix index filled to its 100,000 entries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import signal
import sys
import threading
import time
import timeit
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.interleaved import Request as OneRequest
from bench.interleaved import Sample, rotated, send
from bench.interleaved import _session as one_connection_session
from bench.loadgen import _StreamClock
from bench.prompts import prompt_text
from bench.stack import (
    Arm,
    envoy_argv,
    envoy_unguarded,
    envoy_without_extproc,
    git_output,
    machine_busy_seconds,
    process_cpu_seconds,
    wait_extproc_healthy,
)
from bench.stats import percentile
from testbed.harness import (
    ENVOY_CONFIG,
    REPO_ROOT,
    ManagedProcess,
    MetricSamples,
    free_port,
    render_envoy_config,
    sha256_hex,
)
from vllm_sim.tokenization import SINGLE_TOKEN_WORDS

MODEL = "qwen2.5-demo"
POOL = "vllm-pool"
RR = "vllm-rr"
SINGLE = "vllm-local"
BLOCK = 16
BIG = 200_000_000  # a budget nothing reaches
RESULTS = REPO_ROOT / "bench" / "results" / "pools"
PARTS = ("affinity", "fairness", "cost")
REPLICAS = 3
# Simulators of parts 1 and 2 (prefix caching on), and of part 3 (answering at once).
SIM_NAMES = tuple(f"r{i}" for i in range(REPLICAS))
COST_SIMS = tuple(f"c{i}" for i in range(REPLICAS))
TENANTS_1 = ("acme", "globex", "initech", "umbrella", "hooli", "stark")
AFFINITY_ARMS = ("pool-affinity", "pool-load", "round-robin", "pool-affinity-gate1")
FAIR_PHASES = ("queue", "no-queue", "priority")
COST_ARMS = ("envoy", "kvgate", "kvgate-pool")


# =========================================================================== plans


@dataclass(frozen=True)
class AffinityPlan:
    blocks: int = 1000  # per replica: 16,000 tokens of KV
    ttft_ms: float = 2.0
    itl_ms: float = 10.0
    prefill_ms_per_1k: float = 50.0
    output_tokens: int = 16
    system_tokens: tuple[int, ...] = (2000, 2400, 2800, 3200, 3600, 4000)
    user_tokens: tuple[int, int] = (20, 80)
    concurrency: int = 8
    requests: int = 600
    rounds: int = 2  # arms in order, then reversed; each round a slice of the sequence
    warmup: int = 16
    seed: int = 13


@dataclass(frozen=True)
class FairnessPlan:
    blocks: int = 150  # kvgate's budget per endpoint: 2,400 tokens = two requests
    ttft_ms: float = 5.0
    itl_ms: float = 10.0
    chunk_tokens: int = 8
    prompt_words: int = 990
    max_tokens: int = 32
    heavy_clients: int = 20
    light_clients: int = 2
    vip_clients: int = 2
    duration_s: float = 30.0
    max_wait_s: float = 10.0
    retry_429_s: float = 0.1
    input_weight: float = 1.0
    output_weight: float = 2.0


@dataclass(frozen=True)
class CostPlan:
    iterations: int = 300
    warmup: int = 10
    prompt_tokens: int = 1000
    max_tokens: int = 16
    pause_ms: float = 2.0
    timeit_repeat: int = 7
    timeit_budget_s: float = 0.2  # per measurement and repeat, at least


@dataclass(frozen=True)
class Plans:
    affinity: AffinityPlan
    fairness: FairnessPlan
    cost: CostPlan
    quiet_timeout_s: float  # longest wait for the machine to be quiet before an arm


QUICK = Plans(
    AffinityPlan(requests=80, rounds=1, warmup=6),
    FairnessPlan(duration_s=5.0),
    CostPlan(iterations=30, warmup=3, timeit_repeat=3, timeit_budget_s=0.02),
    quiet_timeout_s=1.0,
)
FULL = Plans(
    AffinityPlan(),
    FairnessPlan(),
    CostPlan(timeit_repeat=15, timeit_budget_s=0.05),
    quiet_timeout_s=5.0,
)


# =========================================================================== processes


def _bin(name: str) -> str:
    candidate = REPO_ROOT / ".venv" / "bin" / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(name)
    return found


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def _get_json(url: str) -> Any:
    return json.loads(_get(url, 15).decode())


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        resp.read()


def api_key(name: str) -> str:
    return f"sk-pools-{name}"


def tenant(name: str, *, priority: int = 0) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "api_key_sha256": sha256_hex(api_key(name))}
    if priority:
        entry["priority"] = priority
    return entry


ALL_TENANTS = [
    *(tenant(t) for t in TENANTS_1),
    tenant("heavy"),
    tenant("light"),
    tenant("vip", priority=1),
    tenant("bench"),
]


@dataclass
class Kvgate:
    name: str
    grpc: int
    http: int
    admin: int
    config_path: Path
    proc: ManagedProcess | None = None
    restarts: int = 0

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http}/metrics"

    def metrics(self) -> MetricSamples:
        return MetricSamples(_get(self.metrics_url).decode())

    def server(self) -> dict[str, str]:
        return {
            "grpc_listen": f"127.0.0.1:{self.grpc}",
            "http_listen": f"127.0.0.1:{self.http}",
            "admin_listen": f"127.0.0.1:{self.admin}",
        }


@dataclass
class EnvoyProc:
    name: str
    listen: int
    admin: int
    guarded: bool
    proc: ManagedProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen}"


class Rig:
    """The run's processes: simulators, kvgate processes, Envoys."""

    def __init__(self, work_dir: Path, model_dir: Path) -> None:
        self.work_dir = work_dir
        self.log_dir = work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = model_dir
        self._taken: set[int] = set()
        self.sims: dict[str, int] = {}  # name -> port
        self.sim_procs: dict[str, ManagedProcess] = {}
        self.kvgates: dict[str, Kvgate] = {}
        self.envoys: dict[str, EnvoyProc] = {}
        self.notes: list[str] = []

    def port(self) -> int:
        port = free_port()
        while port in self._taken:
            port = free_port()
        self._taken.add(port)
        return port

    # ---- simulators

    def _sim_argv(self, name: str, args: Sequence[str]) -> list[str]:
        return [
            _bin("vllm-sim"),
            "--model-dir",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--port",
            str(self.sims[name]),
            "--log-level",
            "warning",
            *args,
        ]

    def start_sims(self, names: Sequence[str], args: Sequence[str]) -> None:
        for name in names:
            self.sims[name] = self.port()
            proc = ManagedProcess(f"sim-{name}", self._sim_argv(name, args), log_dir=self.log_dir)
            self.sim_procs[name] = proc.start()

    def sim_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.sims[name]}"

    def endpoints(self, names: Sequence[str] = SIM_NAMES) -> list[str]:
        return [f"127.0.0.1:{self.sims[n]}" for n in names]

    def sim_stats(self, name: str) -> dict[str, Any]:
        stats: dict[str, Any] = _get_json(f"{self.sim_url(name)}/sim/stats")
        return stats

    def reset_sims(self, names: Sequence[str] = SIM_NAMES) -> bool:
        """POST /sim/reset on each; True when every prefix cache is empty afterwards, else the
        simulators are restarted with the same flags and False is returned."""
        for name in names:
            _post(f"{self.sim_url(name)}/sim/reset")
        stats = [self.sim_stats(n) for n in names]
        if all(s.get("prefix_cache_blocks", 0) == 0 for s in stats):
            return True
        self.notes.append("POST /sim/reset left prefix-cache blocks: simulators restarted")
        for name in names:
            self.sim_procs[name].restart()
            self.sim_procs[name].wait_http(f"{self.sim_url(name)}/health", 180)
        return False

    def wait_sims_idle(self, names: Sequence[str] = SIM_NAMES, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = [self.sim_stats(n) for n in names]
            if all(not s["running"] and not s["waiting"] for s in stats):
                return
            time.sleep(0.1)

    # ---- kvgate

    def kvgate(self, name: str, config: dict[str, Any]) -> Kvgate:
        k = Kvgate(name, self.port(), self.port(), self.port(), self.work_dir / f"{name}.yaml")
        self._write(k, config)
        argv = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(k.config_path)]
        k.proc = ManagedProcess(f"kvgate-{name}", argv, log_dir=self.log_dir).start()
        self.kvgates[name] = k
        return k

    def _write(self, k: Kvgate, config: dict[str, Any]) -> None:
        config = {"server": k.server(), **config}
        k.config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    def reconfigure(self, k: Kvgate, config: dict[str, Any], timeout: float = 20.0) -> str:
        """Apply `config` by hot reload (SIGHUP) and wait until kvgate counts it a success;
        a failed or missing reload restarts kvgate with the new config instead.
        Returns "reload" or "restart"."""
        before = k.metrics()
        ok0 = before.value("kvgate_config_reloads_total", result="success")
        bad0 = before.value("kvgate_config_reloads_total", result="failure")
        self._write(k, config)
        assert k.proc is not None and k.proc.pid is not None
        os.kill(k.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = k.metrics()
            if now.value("kvgate_config_reloads_total", result="failure") > bad0:
                break
            if now.value("kvgate_config_reloads_total", result="success") > ok0:
                # The file watcher (every 2 s) may reload the same file once more: harmless.
                return "reload"
        self.notes.append(f"kvgate {k.name}: reload failed or timed out; restarted instead")
        k.restarts += 1
        k.proc.restart(timeout=15)
        k.proc.wait_http(f"http://127.0.0.1:{k.http}/readyz", 180)
        for e in self.envoys.values():
            if e.guarded:
                wait_extproc_healthy(e.admin, f"envoy-{e.name}")
        return "restart"

    # ---- Envoy

    def envoy(
        self,
        name: str,
        *,
        kvgate: Kvgate | None,
        backends: dict[str, int],
        pools: Sequence[str] = (),
        round_robin: dict[str, list[int]] | None = None,
    ) -> EnvoyProc:
        """kvgate=None: plain Envoy (no ext_proc, one route to `vllm-local`)."""
        e = EnvoyProc(name, self.port(), self.port(), guarded=kvgate is not None)
        dst = self.work_dir / f"envoy-{name}.yaml"
        render_envoy_config(
            ENVOY_CONFIG,
            dst,
            listen_port=e.listen,
            admin_port=e.admin,
            extproc_port=kvgate.grpc if kvgate is not None else self.port(),
            backends=backends,
            pools=list(pools),
        )
        if round_robin:
            _round_robin_clusters(dst, round_robin)
        if kvgate is None:
            envoy_without_extproc(dst, dst)
            envoy_unguarded(dst)
        argv = envoy_argv(dst, "--drain-time-s", "1", "--parent-shutdown-time-s", "2")
        e.proc = ManagedProcess(f"envoy-{name}", argv, log_dir=self.log_dir).start()
        self.envoys[name] = e
        return e

    # ---- lifecycle

    def wait_ready(self) -> None:
        for name, proc in self.sim_procs.items():
            proc.wait_http(f"{self.sim_url(name)}/health", 180)
        for k in self.kvgates.values():
            assert k.proc is not None
            k.proc.wait_http(f"http://127.0.0.1:{k.http}/readyz", 180)
        for e in self.envoys.values():
            assert e.proc is not None
            e.proc.wait_http(f"http://127.0.0.1:{e.admin}/ready", 60)
            if e.guarded:
                wait_extproc_healthy(e.admin, f"envoy-{e.name}")

    def pids(self) -> list[int]:
        procs = [*self.sim_procs.values()]
        procs += [k.proc for k in self.kvgates.values() if k.proc is not None]
        procs += [e.proc for e in self.envoys.values() if e.proc is not None]
        return [p.pid for p in procs if p.pid is not None and p.running]

    def quiet(
        self, timeout: float, max_cores: float = 0.5, window_s: float = 1.0
    ) -> dict[str, Any]:
        """Wait (at most `timeout` s) until the machine's busy CPU over one window is at most
        `max_cores` (our processes are idle then: the rest is other users')."""
        start = time.monotonic()
        busy = machine_busy_seconds()
        cores = math.nan
        while True:
            time.sleep(window_s)
            now = machine_busy_seconds()
            cores = (now - busy) / window_s
            busy = now
            if cores <= max_cores or time.monotonic() - start >= timeout:
                break
        return {"waited_s": round(time.monotonic() - start, 1), "busy_cores_before": cores}

    def stop(self) -> None:
        for e in self.envoys.values():
            if e.proc is not None:
                with contextlib.suppress(Exception):
                    e.proc.stop(timeout=10)
        for k in self.kvgates.values():
            if k.proc is not None:
                with contextlib.suppress(Exception):
                    k.proc.stop(timeout=15)
        for proc in self.sim_procs.values():
            with contextlib.suppress(Exception):
                proc.stop(timeout=10)


def _round_robin_clusters(path: Path, clusters: dict[str, list[int]]) -> None:
    """Give the named STATIC clusters several endpoints, lb_policy ROUND_ROBIN: the old way
    to serve one backend from several replicas."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for cluster in config["static_resources"]["clusters"]:
        ports = clusters.get(cluster["name"])
        if ports is None:
            continue
        cluster["lb_policy"] = "ROUND_ROBIN"
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {
                                "socket_address": {"address": "127.0.0.1", "port_value": port}
                            }
                        }
                    }
                    for port in ports
                ]
            }
        ]
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def sim_args(plans: Plans, *, cost: bool = False) -> list[str]:
    """Parts 1 and 2 share simulators with prefix caching (part 2 sets its own latencies and
    output per request with x-sim-* headers); part 3's answer at once, without caching."""
    if cost:
        return [
            "--num-gpu-blocks",
            "20000",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "32768",
            "--default-output-tokens",
            str(plans.cost.max_tokens),
        ]
    p = plans.affinity
    return [
        "--num-gpu-blocks",
        str(p.blocks),
        "--block-size",
        str(BLOCK),
        "--ttft-ms",
        str(p.ttft_ms),
        "--itl-ms",
        str(p.itl_ms),
        "--default-output-tokens",
        str(p.output_tokens),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--prefill-ms-per-1k-tokens",
        str(p.prefill_ms_per_1k),
        "--request-history",
        "50000",  # part 2 reads every admission's arrival back
    ]


def main_config(
    rig: Rig,
    *,
    model_backend: str,
    pool_budget: int,
    picking: dict[str, Any] | None = None,
    queue: dict[str, Any] | None = None,
    endpoints: Sequence[str] = SIM_NAMES,
) -> dict[str, Any]:
    """The main kvgate's config: one model on the pool (or on the round-robin backend)."""
    pool: dict[str, Any] = {
        "name": POOL,
        "kv_budget_tokens": pool_budget,
        "kv_block_size": BLOCK,
        "max_concurrent_requests": 256,
        "endpoints": rig.endpoints(endpoints),
    }
    if picking:
        pool["picking"] = picking
    if queue:
        pool["queue"] = queue
    return {
        "store": "memory",
        "tenants": ALL_TENANTS,
        "models": [_model(rig, model_backend)],
        "backends": [
            pool,
            {
                "name": RR,
                "kv_budget_tokens": pool_budget * REPLICAS,
                "kv_block_size": BLOCK,
                "max_concurrent_requests": 256,
            },
        ],
    }


def _model(rig: Rig, backend: str) -> dict[str, Any]:
    return {
        "name": MODEL,
        "tokenizer": str(rig.model_dir),
        "max_context": 32768,
        "default_max_new_tokens": 64,
        "backend": backend,
    }


# =========================================================================== CPU accounting


class CpuWindow:
    """The machine's busy CPU and ours (every started process + this one) over a window:
    what other users of this shared machine took meanwhile (foreign cores)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self._start = self._snap()

    def _snap(self) -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        ours = sum(process_cpu_seconds(p) for p in self._pids()) + own.ru_utime + own.ru_stime
        return time.monotonic(), machine_busy_seconds(), ours

    def close(self) -> dict[str, float]:
        t1, busy1, ours1 = self._snap()
        t0, busy0, ours0 = self._start
        wall = max(t1 - t0, 1e-9)
        return {
            "wall_s": round(wall, 2),
            "machine_busy_cores": round((busy1 - busy0) / wall, 2),
            "benchmark_cores": round((ours1 - ours0) / wall, 2),
            "foreign_cores": round(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall, 2),
        }


# =========================================================================== streamed client


@dataclass
class Rec:
    tenant: str
    bench_id: str
    t_send: float = math.nan  # perf_counter
    epoch_send: float = math.nan  # time.time(), to compare with the simulators' records
    t_first: float = math.nan
    t_end: float = math.nan
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    epoch_admitted: float = math.nan  # arrival at a simulator

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def wait_s(self) -> float:
        return self.epoch_admitted - self.epoch_send


def _usage(raw: bytes) -> dict[str, Any] | None:
    for event in reversed(raw.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") and b'"usage":{' in event:
            with contextlib.suppress(ValueError):
                usage = json.loads(event[6:]).get("usage")
                if usage:
                    return dict(usage)
    return None


async def stream_chat(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, rec: Rec
) -> None:
    clock = _StreamClock()
    raw = bytearray()
    rec.epoch_send = time.time()
    rec.t_send = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status == 200:
                async for chunk in resp.content.iter_any():
                    clock.feed(chunk, time.perf_counter())
                    raw += chunk
            else:
                raw += await resp.read()
        rec.t_end = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        rec.t_end = time.perf_counter()
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    if clock.first is not None:
        rec.t_first = clock.first
    if rec.status != 200:
        rec.error = f"http {rec.status}: {bytes(raw[:160]).decode(errors='replace')}"
        return
    usage = _usage(bytes(raw))
    if usage is None:
        rec.error = "no usage event"
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = int(details.get("cached_tokens") or 0)


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(SINGLE_TOKEN_WORDS, k=n))


def client_session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, use_dns_cache=False),
        timeout=aiohttp.ClientTimeout(total=120),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values if not math.isnan(v)]


def _headers(t: str, **extra: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {api_key(t)}", **extra}


class InFlightSampler:
    """kvgate's reserved KV per ledger (`kvgate_kv_tokens_in_flight`), polled at 10 Hz in a
    thread: the peak kvgate held on each endpoint (sampled, so at most the true peak)."""

    _LINE = re.compile(r'^kvgate_kv_tokens_in_flight\{backend="([^"]+)"\} ([0-9.e+]+)$', re.M)

    def __init__(self, url: str, interval_s: float = 0.1) -> None:
        self.url = url
        self.interval_s = interval_s
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InFlightSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                text = _get(self.url, 2).decode()
                for backend, value in self._LINE.findall(text):
                    v = float(value)
                    if v > self.peak.get(backend, 0.0):
                        self.peak[backend] = v


# Every measured request of parts 1 and 2, written to <stem>-requests.csv.gz.
RAW: list[dict[str, Any]] = []
RAW_FIELDS = (
    "part",
    "arm",
    "tenant",
    "bench_id",
    "status",
    "error",
    "ttft_ms",
    "latency_ms",
    "wait_ms",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "epoch_send",
    "epoch_admitted",
)


def keep_raw(part: str, arm: str, recs: list[Rec]) -> None:
    for r in recs:
        RAW.append(
            {
                "part": part,
                "arm": arm,
                "tenant": r.tenant,
                "bench_id": r.bench_id,
                "status": r.status,
                "error": r.error[:120],
                "ttft_ms": round((r.t_first - r.t_send) * 1e3, 2),
                "latency_ms": round((r.t_end - r.t_send) * 1e3, 2),
                "wait_ms": round(r.wait_s * 1e3, 2),
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "epoch_send": f"{r.epoch_send:.6f}",
                "epoch_admitted": f"{r.epoch_admitted:.6f}",
            }
        )


def write_raw(path: Path) -> None:
    import csv
    import gzip

    with gzip.open(path, "wt", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=RAW_FIELDS)
        writer.writeheader()
        for row in RAW:
            writer.writerow({k: ("" if v != v else v) for k, v in row.items()})  # NaN -> ""


def _delta(before: MetricSamples, after: MetricSamples, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


# =========================================================================== 1. affinity


def run_affinity(
    rig: Rig, kv: Kvgate, envoy: EnvoyProc, plan: AffinityPlan, quiet_s: float
) -> dict[str, Any]:
    budget = plan.blocks * BLOCK
    configs = {
        "pool-affinity": main_config(rig, model_backend=POOL, pool_budget=budget),
        "pool-load": main_config(
            rig, model_backend=POOL, pool_budget=budget, picking={"prefix_affinity": False}
        ),
        "round-robin": main_config(rig, model_backend=RR, pool_budget=budget),
        # Diagnostic: affinity counts until the request no longer fits (no load gate).
        "pool-affinity-gate1": main_config(
            rig, model_backend=POOL, pool_budget=budget, picking={"load_gate": 1.0}
        ),
    }
    # The request sequence, the same for every arm.
    rng = random.Random(plan.seed)
    systems = {}
    for t, size in zip(TENANTS_1, plan.system_tokens, strict=True):
        systems[t] = f"You are the assistant of {t}. " + words(random.Random(f"system/{t}"), size)
    sequence: list[tuple[str, bytes]] = []
    for i in range(plan.requests):
        t = rng.choice(TENANTS_1)
        user = f"[q{i}] " + words(rng, rng.randint(*plan.user_tokens))
        messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": user}]
        sequence.append((t, chat_body(messages, plan.output_tokens)))
    # Warm-up requests: other system prompts, so kvgate's prefix index learns nothing of the
    # measured tenants from them.
    warm_rng = random.Random(99)
    warmup = [
        (
            TENANTS_1[i % len(TENANTS_1)],
            chat_body(
                [
                    {"role": "system", "content": f"warm-up {i} " + words(warm_rng, 1500)},
                    {"role": "user", "content": "hello"},
                ],
                plan.output_tokens,
            ),
        )
        for i in range(plan.warmup)
    ]
    probe = _sim_cpu_probe(rig, systems[TENANTS_1[-1]], plan)
    # Rounds: the arms in order, then in reverse order, ... (a slow drift of this shared
    # machine falls on every arm alike); each round sends the whole sequence's next slice.
    per_round = -(-len(sequence) // plan.rounds)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in AFFINITY_ARMS}
    for k in range(plan.rounds):
        order = AFFINITY_ARMS if k % 2 == 0 else tuple(reversed(AFFINITY_ARMS))
        part = sequence[k * per_round : (k + 1) * per_round]
        for arm in order:
            how = rig.reconfigure(kv, configs[arm])
            asyncio.run(_closed_loop(envoy.base_url, warmup, plan.concurrency, []))
            print(
                f"  affinity: round {k + 1}/{plan.rounds} {arm} ({len(part)} requests, "
                f"{plan.concurrency} in flight)",
                flush=True,
            )
            run = _affinity_run(rig, kv, envoy, arm, part, plan, quiet_s)
            run["applied_by"] = how
            runs[arm].append(run)
    arms = {arm: _affinity_summary(runs[arm], plan, budget) for arm in AFFINITY_ARMS}
    return {
        "plan": asdict(plan),
        "kv_budget_per_pod": budget,
        "simulator_probe": probe,
        "arms": arms,
    }


def _sim_cpu_probe(rig: Rig, system: str, plan: AffinityPlan) -> dict[str, Any]:
    """TTFT of requests whose system prompt is cached, sent straight to one simulator: one
    at a time, and four at once (what piling onto one pod costs the simulator's own CPU)."""
    url = f"{rig.sim_url(SIM_NAMES[0])}/v1/chat/completions"
    rng = random.Random(5)

    def body() -> bytes:
        user = "[probe] " + words(rng, 50)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return chat_body(messages, plan.output_tokens)

    async def go() -> tuple[list[float], list[float]]:
        alone: list[float] = []
        together: list[float] = []
        async with client_session(4) as session:
            warm = Rec("probe", "warm")
            await stream_chat(session, url, _headers("acme"), body(), warm)
            for i in range(6):
                rec = Rec("probe", f"alone-{i}")
                await stream_chat(session, url, _headers("acme"), body(), rec)
                alone.append(rec.t_first - rec.t_send)
            for i in range(3):
                recs = [Rec("probe", f"together-{i}-{k}") for k in range(4)]
                await asyncio.gather(
                    *(stream_chat(session, url, _headers("acme"), body(), r) for r in recs)
                )
                together += [r.t_first - r.t_send for r in recs]
        return alone, together

    rig.reset_sims()
    alone, together = asyncio.run(go())
    rig.reset_sims()
    return {
        "ttft_ms_one_at_a_time_p50": percentile(_ms(alone), 50),
        "ttft_ms_four_at_once_p50": percentile(_ms(together), 50),
        "ttft_ms_four_at_once_max": max(_ms(together)),
    }


def _affinity_run(
    rig: Rig,
    kv: Kvgate,
    envoy: EnvoyProc,
    arm: str,
    sequence: list[tuple[str, bytes]],
    plan: AffinityPlan,
    quiet_s: float,
) -> dict[str, Any]:
    """One arm over one slice of the sequence, from reset simulators: the raw readings."""
    rig.wait_sims_idle()
    reset_ok = rig.reset_sims()
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    recs: list[Rec] = []
    cpu = CpuWindow(rig.pids)
    with InFlightSampler(kv.metrics_url) as sampler:
        wall = asyncio.run(_closed_loop(envoy.base_url, sequence, plan.concurrency, recs))
    rig.wait_sims_idle()
    cpu_info = cpu.close()
    after = kv.metrics()
    keep_raw("affinity", arm, recs)
    return {
        "recs": recs,
        "stats": {n: rig.sim_stats(n) for n in SIM_NAMES},
        "address": dict(zip(SIM_NAMES, rig.endpoints(), strict=True)),
        "peaks": dict(sampler.peak),
        "picks": {
            affinity: _delta(before, after, "kvgate_pool_picks_total", affinity=affinity)
            for affinity in ("hit", "miss")
        },
        "wall": wall,
        "cpu": cpu_info,
        "quiet": quiet,
        "reset_ok": reset_ok,
    }


def _pods_per_tenant(run: dict[str, Any], by_size: list[tuple[int, str]]) -> float:
    """How many pods served each tenant in one run, on average over the tenants."""
    pods: dict[str, set[str]] = {}
    for n, s in run["stats"].items():
        for served in s["served"]:
            owner = next(
                (t for size, t in reversed(by_size) if served["prompt_tokens"] >= size), ""
            )
            if owner:
                pods.setdefault(owner, set()).add(n)
    return sum(len(v) for v in pods.values()) / max(1, len(pods))


def _affinity_summary(
    runs: list[dict[str, Any]], plan: AffinityPlan, budget: int
) -> dict[str, Any]:
    recs: list[Rec] = [r for run in runs for r in run["recs"]]
    wall = sum(run["wall"] for run in runs)
    ok = [r for r in recs if r.ok]
    queries = sum(s["prefix_cache_queries_total"] for run in runs for s in run["stats"].values())
    hits = sum(s["prefix_cache_hits_total"] for run in runs for s in run["stats"].values())
    ttft = _ms([r.t_first - r.t_send for r in ok])
    lat = _ms([r.t_end - r.t_send for r in ok])
    # Which pods served which tenant: the system prompts' sizes are 400 tokens apart and a
    # user turn adds < 120, so a sequence's prompt size names its tenant.
    by_size = sorted(zip(plan.system_tokens, TENANTS_1, strict=True))
    tenant_pods: dict[str, list[int]] = {t: [0] * REPLICAS for t in TENANTS_1}
    pods = []
    for i, n in enumerate(SIM_NAMES):
        address = runs[0]["address"][n]
        key = f"{POOL}/{address}"
        sims = [run["stats"][n] for run in runs]
        for s in sims:
            for served in s["served"]:
                owner = next(
                    (t for size, t in reversed(by_size) if served["prompt_tokens"] >= size), ""
                )
                if owner:
                    tenant_pods[owner][i] += 1
        q = sum(s["prefix_cache_queries_total"] for s in sims)
        reserved = [run["peaks"][key] for run in runs if key in run["peaks"]]
        pods.append(
            {
                "endpoint": address,
                "served": sum(len(s["served"]) for s in sims),
                "preemptions": sum(s["preemptions"] for s in sims),
                "peak_kv_tokens_used": max(s["peak_kv_tokens_used"] for s in sims),
                "kv_capacity_tokens": sims[0]["kv_blocks_total"] * sims[0]["block_size"],
                "peak_running": max(s["peak_running"] for s in sims),
                "prefix_hit_rate": sum(s["prefix_cache_hits_total"] for s in sims) / q
                if q
                else None,
                "prefix_cache_evictions": sum(s["prefix_cache_evictions_total"] for s in sims),
                "kvgate_reserved_peak_sampled": max(reserved) if reserved else None,
            }
        )
    statuses: dict[str, int] = {}
    for r in recs:
        label = str(r.status) if r.status else r.error[:40]
        statuses[label] = statuses.get(label, 0) + 1
    peaks: dict[str, float] = {}
    for run in runs:
        for key, value in run["peaks"].items():
            peaks[key] = max(peaks.get(key, 0.0), value)
    cached = [r for r in ok if 2 * r.cached_tokens > r.prompt_tokens]
    uncached = [r for r in ok if 2 * r.cached_tokens <= r.prompt_tokens]
    return {
        "rounds": len(runs),
        "reset_cleared_prefix_cache": all(run["reset_ok"] for run in runs),
        "applied_by": sorted({run["applied_by"] for run in runs}),
        "quiet": [run["quiet"] for run in runs],
        "requests": len(recs),
        "ok": len(ok),
        "statuses": statuses,
        "errors": sorted({r.error for r in recs if r.error})[:5],
        "prefix_queries_tokens": queries,
        "prefix_hits_tokens": hits,
        "prefix_hit_rate": hits / queries if queries else None,
        "prefix_hit_rate_per_round": [
            sum(s["prefix_cache_hits_total"] for s in run["stats"].values())
            / max(1, sum(s["prefix_cache_queries_total"] for s in run["stats"].values()))
            for run in runs
        ],
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        "mean_cached_tokens": sum(r.cached_tokens for r in ok) / len(ok) if ok else None,
        "ttft_ms": {
            "p50": percentile(ttft, 50),
            "p95": percentile(ttft, 95),
            "mean": sum(ttft) / len(ttft) if ttft else math.nan,
            # Split by whether the prefix cache held the system prompt (cached > half).
            "p50_cache_hit": percentile(_ms([r.t_first - r.t_send for r in cached]), 50),
            "p50_cache_miss": percentile(_ms([r.t_first - r.t_send for r in uncached]), 50),
            "cache_hit_requests": len(cached),
        },
        "latency_ms": {"p50": percentile(lat, 50), "p95": percentile(lat, 95)},
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else None,
        "prompt_tokens_per_s": sum(r.prompt_tokens for r in ok) / wall if wall else None,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall if wall else None,
        "pods": pods,
        "tenant_requests_per_pod": tenant_pods,
        "pods_per_tenant_per_round": [_pods_per_tenant(run, by_size) for run in runs],
        "kvgate_reserved_peak_sampled": peaks,
        "kvgate_pool_picks": {
            affinity: sum(run["picks"][affinity] for run in runs) for affinity in ("hit", "miss")
        },
        "kv_budget_per_pod": budget,
        "cpu": {
            "foreign_cores": sum(run["cpu"]["foreign_cores"] for run in runs) / len(runs),
            "benchmark_cores": sum(run["cpu"]["benchmark_cores"] for run in runs) / len(runs),
        },
    }


async def _closed_loop(
    base_url: str, sequence: list[tuple[str, bytes]], concurrency: int, out: list[Rec]
) -> float:
    url = f"{base_url}/v1/chat/completions"
    todo = iter(enumerate(sequence))
    async with client_session(concurrency) as session:

        async def worker() -> None:
            for i, (t, body) in todo:
                rec = Rec(t, str(i))
                await stream_chat(session, url, _headers(t), body, rec)
                out.append(rec)
                if rec.status == 429:
                    await asyncio.sleep(0.1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


# =========================================================================== 2. fairness


def run_fairness(
    rig: Rig, kv: Kvgate, envoy: EnvoyProc, plan: FairnessPlan, quiet_s: float
) -> dict[str, Any]:
    budget = plan.blocks * BLOCK
    queue = {
        "max_wait_s": plan.max_wait_s,
        "poll_interval_s": 0.05,
        "input_weight": plan.input_weight,
        "output_weight": plan.output_weight,
    }
    configs = {
        "queue": main_config(rig, model_backend=POOL, pool_budget=budget, queue=queue),
        "no-queue": main_config(rig, model_backend=POOL, pool_budget=budget),
        "priority": main_config(rig, model_backend=POOL, pool_budget=budget, queue=queue),
    }
    loads = {
        "queue": {"heavy": plan.heavy_clients, "light": plan.light_clients},
        "no-queue": {"heavy": plan.heavy_clients, "light": plan.light_clients},
        "priority": {
            "heavy": plan.heavy_clients,
            "light": plan.light_clients,
            "vip": plan.vip_clients,
        },
    }
    phases: dict[str, Any] = {}
    for phase in FAIR_PHASES:
        how = rig.reconfigure(kv, configs[phase])
        # Warm-up after the reload: a few requests of every tenant, fewer than fit the pool.
        warm = FairnessPlan(**{**asdict(plan), "duration_s": 1.0})
        asyncio.run(_fair_load(envoy.base_url, dict.fromkeys(loads[phase], 1), warm, [], "warm"))
        print(f"  fairness: {phase} ({loads[phase]}, {plan.duration_s:g} s)")
        phases[phase] = _fair_phase(rig, kv, envoy, phase, loads[phase], plan, budget, quiet_s)
        phases[phase]["applied_by"] = how
    # The client-side wait includes the request's own way through Envoy and kvgate before it
    # can queue (and after, to the simulator). Without a queue that whole way is the wait of
    # an admitted request: its median, taken off the start of every wait, gives a second
    # reading of the VTC check closer to what kvgate's queue itself saw.
    recs = {phase: phases[phase].pop("_recs") for phase in phases}
    direct = [r.wait_s for r in recs["no-queue"] if r.ok and r.wait_s == r.wait_s]
    path_s = percentile(direct, 50) if direct else 0.0
    for phase in ("queue", "priority"):
        since = phases[phase]["vtc_after_first_admissions_since"]
        phases[phase]["vtc_after_first_admissions_path_discounted"] = vtc_check(
            recs[phase], ("heavy", "light"), plan, since=since, path_s=path_s
        )
    return {
        "plan": asdict(plan),
        "kv_budget_per_pod": budget,
        "path_s_without_queue_p50": path_s,
        "phases": phases,
    }


def _fair_phase(
    rig: Rig,
    kv: Kvgate,
    envoy: EnvoyProc,
    phase: str,
    load: dict[str, int],
    plan: FairnessPlan,
    budget: int,
    quiet_s: float,
) -> dict[str, Any]:
    rig.wait_sims_idle()
    rig.reset_sims()
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    cpu = CpuWindow(rig.pids)
    recs: list[Rec] = []
    t0, t_stop = asyncio.run(_fair_load(envoy.base_url, load, plan, recs, phase))
    rig.wait_sims_idle()
    cpu_info = cpu.close()
    after = kv.metrics()
    stats = {n: rig.sim_stats(n) for n in SIM_NAMES}
    # Admission = arrival at a simulator.
    arrivals: dict[str, float] = {}
    for n in SIM_NAMES:
        log = _get_json(f"{rig.sim_url(n)}/sim/requests")
        for entry in log["requests"]:
            bench_id = entry["headers"].get("x-bench-id")
            if bench_id:
                arrivals[bench_id] = float(entry["time"])
    for r in recs:
        if r.bench_id in arrivals:
            r.epoch_admitted = arrivals[r.bench_id]
    missing = sum(1 for r in recs if r.ok and math.isnan(r.epoch_admitted))
    keep_raw("fairness", phase, recs)
    duration = t_stop - t0
    epoch_stop = time.time() - (time.perf_counter() - t_stop)

    # The start-up burst: until every tenant has been admitted once (the pool filled first
    # come first served, outside the queue, before anybody waited).
    since = max(
        min(
            (r.epoch_admitted for r in recs if r.tenant == t and r.ok and r.wait_s == r.wait_s),
            default=math.nan,
        )
        for t in load
    )
    tenants_out: dict[str, Any] = {}
    for t in load:
        mine = [r for r in recs if r.tenant == t]
        ok = [r for r in mine if r.ok and not math.isnan(r.epoch_admitted)]
        waits = _ms([r.wait_s for r in ok])
        later = _ms([r.wait_s for r in ok if r.epoch_send >= since])
        # Service within the phase: admissions before its end (requests still waiting when
        # the clients stop are served afterwards, by then without competition).
        window = [r for r in ok if r.epoch_admitted <= epoch_stop]
        tokens = sum(r.prompt_tokens + r.max_tokens for r in window)
        weighted = sum(
            plan.input_weight * r.prompt_tokens + plan.output_weight * r.completion_tokens
            for r in window
        )
        n429 = sum(1 for r in mine if r.status == 429)
        tenants_out[t] = {
            "clients": load[t],
            "attempts": len(mine),
            "admitted": len(ok),
            "http_429": n429,
            "other_failures": sum(1 for r in mine if not r.ok and r.status != 429),
            "share_429": n429 / len(mine) if mine else None,
            "wait_ms": {
                "p50": percentile(waits, 50),
                "p95": percentile(waits, 95),
                "max": max(waits) if waits else math.nan,
            },
            "wait_ms_after_startup": {
                "n": len(later),
                "p50": percentile(later, 50),
                "p95": percentile(later, 95),
                "max": max(later) if later else math.nan,
            },
            "kvgate_queue_wait": _histogram(before, after, "kvgate_queue_wait_seconds", tenant=t),
            "admitted_per_s": len(window) / duration,
            "tokens_admitted_per_s": tokens / duration,
            "weighted_service_per_s": weighted / duration,
        }
    drops = {
        reason: d
        for reason in ("queue_full", "tenant_queue_full", "wait_expired", "disconnected", "error")
        if (d := _delta(before, after, "kvgate_queue_drops_total", reason=reason))
    }
    heavy, light = tenants_out["heavy"], tenants_out["light"]
    pods = [
        {
            "endpoint": address,
            "served": len(stats[n]["served"]),
            "preemptions": stats[n]["preemptions"],
            "peak_kv_tokens_used": stats[n]["peak_kv_tokens_used"],
            "kv_capacity_tokens": stats[n]["kv_blocks_total"] * stats[n]["block_size"],
            "peak_running": stats[n]["peak_running"],
        }
        for n, address in zip(SIM_NAMES, rig.endpoints(), strict=True)
    ]
    all_waits = [r.wait_s for r in recs if r.ok and not math.isnan(r.epoch_admitted)]
    out: dict[str, Any] = {
        "quiet": quiet,
        "duration_s": duration,
        "tenants": tenants_out,
        "service_ratio_heavy_over_light": (
            heavy["tokens_admitted_per_s"] / light["tokens_admitted_per_s"]
            if light["tokens_admitted_per_s"]
            else None
        ),
        "queue_drops": drops,
        "startup_burst_s": since - min(r.epoch_send for r in recs),
        "max_wait_s_seen": max(all_waits, default=math.nan),
        "max_wait_s": plan.max_wait_s,
        "admissions_not_found_at_a_simulator": missing,
        "pods": pods,
        "kv_budget_per_pod": budget,
        "cpu": cpu_info,
    }
    if phase != "no-queue":
        out["vtc"] = vtc_check(recs, ("heavy", "light"), plan)
        # From the moment both have been admitted once: the start-up burst, when the pool
        # filled first come first served outside the queue, left out.
        firsts = [
            min(
                (r.epoch_admitted for r in recs if r.tenant == t and r.ok and r.wait_s == r.wait_s),
                default=math.nan,
            )
            for t in ("heavy", "light")
        ]
        out["vtc_after_first_admissions"] = vtc_check(
            recs, ("heavy", "light"), plan, since=max(firsts)
        )
        out["vtc_after_first_admissions"]["since_s"] = max(firsts) - min(r.epoch_send for r in recs)
        out["vtc_after_first_admissions_since"] = max(firsts)
    out["_recs"] = recs
    return out


async def _fair_load(
    base_url: str, load: dict[str, int], plan: FairnessPlan, out: list[Rec], phase: str
) -> tuple[float, float]:
    """Closed loop per client until the phase's end; requests under way then finish."""
    url = f"{base_url}/v1/chat/completions"
    clients = sum(load.values())
    async with client_session(clients + 4) as session:
        t0 = time.perf_counter()
        t_stop = t0 + plan.duration_s

        async def client(t: str, c: int) -> None:
            rng = random.Random(f"{phase}/{t}/{c}")
            i = 0
            while time.perf_counter() < t_stop:
                bench_id = f"{phase}/{t}/{c}/{i}"
                text = f"[{bench_id}] " + words(rng, plan.prompt_words)
                body = chat_body([{"role": "user", "content": text}], plan.max_tokens)
                headers = _headers(
                    t,
                    **{
                        "x-bench-id": bench_id,
                        "x-sim-ttft-ms": str(plan.ttft_ms),
                        "x-sim-itl-ms": str(plan.itl_ms),
                        "x-sim-output-tokens": str(plan.max_tokens),
                        "x-sim-chunk-tokens": str(plan.chunk_tokens),
                    },
                )
                rec = Rec(t, bench_id, max_tokens=plan.max_tokens)
                await stream_chat(session, url, headers, body, rec)
                out.append(rec)
                i += 1
                if rec.status == 429:
                    await asyncio.sleep(plan.retry_429_s)
                elif not rec.ok:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(client(t, c) for t, n in load.items() for c in range(n)))
        return t0, t_stop


def _histogram(
    before: MetricSamples, after: MetricSamples, name: str, **labels: str
) -> dict[str, Any]:
    """count, mean and bucket-interpolated p50/p95 of a histogram's delta, and the upper
    bound of the bucket holding its largest value."""
    buckets: dict[float, float] = {}
    wanted = set(labels.items())
    for (sample, sample_labels), value in after.samples.items():
        if sample != f"{name}_bucket" or not wanted <= sample_labels:
            continue
        le = float(dict(sample_labels)["le"])
        old = before.samples.get((sample, sample_labels), 0.0)
        buckets[le] = buckets.get(le, 0.0) + value - old
    count = _delta(before, after, f"{name}_count", **labels)
    total = _delta(before, after, f"{name}_sum", **labels)
    ordered = sorted(buckets.items())

    def quantile(q: float) -> float:
        if not ordered or count <= 0:
            return math.nan
        rank = q * count
        prev_le, prev_n = 0.0, 0.0
        for le, n in ordered:
            if n >= rank:
                if math.isinf(le):
                    return prev_le
                width = n - prev_n
                return prev_le + (le - prev_le) * ((rank - prev_n) / width if width else 1.0)
            prev_le, prev_n = le, n
        return prev_le

    top = next((le for le, n in ordered if n >= count), math.nan) if count > 0 else math.nan
    return {
        "count": count,
        "mean_ms": total / count * 1e3 if count else math.nan,
        "p50_ms": quantile(0.5) * 1e3,
        "p95_ms": quantile(0.95) * 1e3,
        "max_bucket_le_s": top,
    }


def vtc_check(
    recs: list[Rec],
    pair: tuple[str, str],
    plan: FairnessPlan,
    since: float = -math.inf,
    path_s: float = 0.0,
) -> dict[str, Any]:
    """Largest difference of two tenants' weighted service over any interval in which both
    had a request waiting for admission, against 2·max(w_p·L_input + w_q·M).

    Waiting = from the client's send (+ `path_s`, the request's own way to kvgate's queue,
    when given) until the request reached a simulator (or was refused).
    Service = w_p·prompt + w_q·output of each admitted request at its admission (kvgate
    charges the VTC counter then). Over [t1, t2] inside one both-waiting interval
    W_a - W_b changes by D(t2) - D(t1), so the largest difference is max D - min D over the
    interval (admissions at its ends included: the conservative side).
    """
    a, b = pair
    spans: dict[str, list[tuple[float, float]]] = {a: [], b: []}
    admissions: list[tuple[float, str, float]] = []
    unit = 0.0
    for r in recs:
        if r.tenant not in spans:
            continue
        if r.ok and not math.isnan(r.epoch_admitted):
            if r.epoch_send + path_s < r.epoch_admitted:
                spans[r.tenant].append((r.epoch_send + path_s, r.epoch_admitted))
            w = plan.input_weight * r.prompt_tokens + plan.output_weight * r.completion_tokens
            admissions.append((r.epoch_admitted, r.tenant, w))
            unit = max(
                unit, plan.input_weight * r.prompt_tokens + plan.output_weight * r.max_tokens
            )
        elif not r.ok:
            spans[r.tenant].append(
                (r.epoch_send, r.epoch_send + (r.t_end - r.t_send))
            )  # refused: it waited until the answer
    both = [
        (max(s, since), e) for s, e in _intersect(_union(spans[a]), _union(spans[b])) if e > since
    ]
    admissions.sort()
    worst = 0.0
    worst_span = (0.0, 0.0)
    j = 0
    for start, end in both:
        while j < len(admissions) and admissions[j][0] < start:
            j += 1
        d = lo = hi = 0.0
        k = j
        while k < len(admissions) and admissions[k][0] <= end:
            _, who, w = admissions[k]
            d += w if who == a else -w
            lo, hi = min(lo, d), max(hi, d)
            k += 1
        if hi - lo > worst:
            worst, worst_span = hi - lo, (start, end)
    return {
        "pair": list(pair),
        "both_backlogged_intervals": len(both),
        "both_backlogged_s": sum(e - s for s, e in both),
        "longest_interval_s": max((e - s for s, e in both), default=0.0),
        "max_service_difference": worst,
        "worst_interval_s": worst_span[1] - worst_span[0],
        "bound": 2 * unit,
        "unit_request_cost": unit,
        "within_bound": worst <= 2 * unit,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersect(
    x: list[tuple[float, float]], y: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(x) and j < len(y):
        s, e = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if s < e:
            out.append((s, e))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


# =========================================================================== 3. cost


def run_cost(
    rig: Rig,
    kv: Kvgate,
    envoy: EnvoyProc,
    single: tuple[Kvgate, EnvoyProc],
    plain: EnvoyProc,
    plan: CostPlan,
    quiet_s: float,
) -> dict[str, Any]:
    how = rig.reconfigure(
        kv, main_config(rig, model_backend=POOL, pool_budget=BIG, endpoints=COST_SIMS)
    )
    kv_single, e_single = single
    key = api_key("bench")
    arms = {
        "envoy": Arm("envoy", plain.base_url, key, pids={"envoy": _pid(plain.proc)}),
        "kvgate": Arm(
            "kvgate",
            e_single.base_url,
            key,
            pids={"envoy": _pid(e_single.proc), "kvgate": _pid(kv_single.proc)},
        ),
        "kvgate-pool": Arm(
            "kvgate-pool",
            envoy.base_url,
            key,
            pids={"envoy": _pid(envoy.proc), "kvgate": _pid(kv.proc)},
        ),
    }
    rig.reset_sims(COST_SIMS)
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    print(f"  cost: interleaved, {plan.iterations} requests per arm")
    cpu = CpuWindow(rig.pids)
    samples = asyncio.run(_interleaved(arms, plan))
    cpu_info = cpu.close()
    after = kv.metrics()
    picks = {
        address: _delta(before, after, "kvgate_pool_picks_total", endpoint=address)
        for address in rig.endpoints(COST_SIMS)
    }
    print("  cost: in-process timeit of the picking pieces")
    return {
        "plan": asdict(plan),
        "applied_by": how,
        "quiet": quiet,
        "interleaved": _interleaved_stats(samples),
        "pool_picks_per_endpoint": picks,
        "cpu": cpu_info,
        "microbench": picking_microbench(plan),
    }


def _pid(proc: ManagedProcess | None) -> int:
    assert proc is not None and proc.pid is not None
    return proc.pid


async def _interleaved(arms: dict[str, Arm], plan: CostPlan) -> list[Sample]:
    text = prompt_text(plan.prompt_tokens)
    run_id = f"{os.getpid()}-{int(time.time())}"

    def request(arm: str, i: int) -> OneRequest:
        content = f"[{run_id} {COST_ARMS.index(arm)} {i}] {text}"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": plan.max_tokens,
        }
        return OneRequest(json.dumps(body, separators=(",", ":")).encode())

    pause = plan.pause_ms / 1e3
    sessions = {a: one_connection_session() for a in arms}
    samples: list[Sample] = []
    try:
        for i in range(-plan.warmup, 0):
            for arm in arms:
                s = Sample("1k", i, 0, arm, -1)
                await send(sessions[arm], arms[arm], request(arm, i), s, pause)
        for step in range(plan.iterations):
            for arm in rotated(list(arms), step):
                body = request(arm, step)
                s = Sample("1k", step, 0, arm, step)
                await send(sessions[arm], arms[arm], body, s, pause)
                if s.error:
                    print(f"    FAIL {arm} {step}: {s.error}")
                samples.append(s)
    finally:
        for session in sessions.values():
            await session.close()
    return samples


def _interleaved_stats(samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = {s.step: s.latency_s for s in samples if s.arm == "envoy" and s.ok}
    single = {s.step: s.latency_s for s in samples if s.arm == "kvgate" and s.ok}
    for arm in COST_ARMS:
        mine = [s for s in samples if s.arm == arm]
        ok = [s for s in mine if s.ok]
        lat = _ms([s.latency_s for s in ok])
        paired = _ms([s.latency_s - ref[s.step] for s in ok if s.step in ref])
        vs_single = _ms([s.latency_s - single[s.step] for s in ok if s.step in single])

        def cpu(role: str, mine: list[Sample] = mine) -> float:
            vals = [s.cpu_s[role] for s in mine if role in s.cpu_s]
            return sum(vals) / len(vals) * 1e3 if vals else math.nan

        out[arm] = {
            "n": len(ok),
            "failures": len(mine) - len(ok),
            "p50_ms": percentile(lat, 50),
            "p90_ms": percentile(lat, 90),
            "p99_ms": percentile(lat, 99),
            "paired_added_p50_ms": percentile(paired, 50),
            "paired_vs_single_p50_ms": percentile(vs_single, 50),
            "kvgate_cpu_ms": cpu("kvgate"),
            "envoy_cpu_ms": cpu("envoy"),
        }
    base = out["envoy"]["p50_ms"]
    for arm in COST_ARMS:
        out[arm]["added_p50_ms"] = out[arm]["p50_ms"] - base
    return out


def picking_microbench(plan: CostPlan) -> list[dict[str, Any]]:
    """timeit of each piece of PoolScheduler.place's picking path, best of `timeit_repeat`."""
    from kvgate.openai.requests import parse_request

    rows: list[dict[str, Any]] = []
    rng = random.Random(13)
    for prompt_tokens in (1_000, 16_000):
        system = f"You are the assistant of tenant-{prompt_tokens}. " + words(rng, prompt_tokens)
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 50)},
                ],
                "max_tokens": 64,
            }
        ).encode()
        parsed = parse_request("/v1/chat/completions", body)
        for n_endpoints in (3, 32):
            rows.append(_micro_case(parsed, prompt_tokens, n_endpoints, plan))
    return rows


def _micro_case(
    parsed: Any, prompt_tokens: int, n_endpoints: int, plan: CostPlan
) -> dict[str, Any]:
    from kvgate.lifecycle.scheduler import affinity_text
    from kvgate.policy.picking import (
        EndpointLoad,
        PickWeights,
        PrefixIndex,
        rank_endpoints,
        rendezvous_order,
    )

    block_chars, max_blocks = 64, 128  # PickingConfig's defaults
    limit = block_chars * max_blocks
    keys = [f"{POOL}/10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n_endpoints)]
    index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks)
    filler = random.Random(7)
    # Fill the index to its 100,000 entries with other prompts' chains of 128 blocks.
    while len(index) < 100_000:
        index.record([filler.getrandbits(63) for _ in range(max_blocks)], filler.choice(keys))
    text = affinity_text(parsed, limit)
    hashes = index.block_hashes(text)
    first_block = text[:block_chars]
    index.record(hashes, keys[0])  # the prompt's prefix is held by one endpoint
    miss = index.block_hashes("never seen " + text)
    loads = [
        EndpointLoad(
            key=k,
            kv_budget_tokens=48_000,
            kv_tokens_in_flight=filler.randrange(0, 40_000),
            requests_in_flight=filler.randrange(0, 20),
            max_concurrent_requests=256,
        )
        for k in keys
    ]
    weights = PickWeights()
    matched = index.matches(hashes)
    tie = rendezvous_order(first_block, keys)
    need = prompt_tokens + 64

    def whole() -> object:
        t = affinity_text(parsed, limit)
        h = index.block_hashes(t)
        m = index.matches(h)
        tie_break = rendezvous_order(t[:block_chars], keys)
        order = rank_endpoints(loads, need, m, len(h), weights, tie_break)
        index.record(h, order[0])
        return order

    pieces: dict[str, Callable[[], object]] = {
        "affinity_text": lambda: affinity_text(parsed, limit),
        "block_hashes": lambda: index.block_hashes(text),
        "matches (hit)": lambda: index.matches(hashes),
        "matches (miss)": lambda: index.matches(miss),
        "rendezvous_order": lambda: rendezvous_order(first_block, keys),
        "rank_endpoints": lambda: rank_endpoints(loads, need, matched, len(hashes), weights, tie),
        "record": lambda: index.record(hashes, keys[0]),
        "whole path (hit)": whole,
    }
    row: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "endpoints": n_endpoints,
        "affinity_chars": len(text),
        "blocks": len(hashes),
        "matched": max(matched.values(), default=0),
    }
    for label, fn in pieces.items():
        row[label] = _best_us(fn, plan)
    return row


def _best_us(fn: Callable[[], object], plan: CostPlan) -> float:
    """Best of `timeit_repeat` runs of about `timeit_budget_s` each, in µs per call."""
    timer = timeit.Timer(fn)
    number = 1
    while (elapsed := timer.timeit(number)) < 0.005:
        number *= 4
    number = max(1, int(number * plan.timeit_budget_s / elapsed))
    return min(timer.repeat(repeat=plan.timeit_repeat, number=number)) / number * 1e6


# =========================================================================== report


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# Pools: prefix affinity, fair queueing and the cost of picking"
        + (" (quick)" if meta["quick"] else ""),
        "",
        f"`python -m bench.pools{' --quick' if meta['quick'] else ''}` on commit "
        f"`{meta['commit']}`"
        + (f" (working tree differs in: {meta['dirty']})" if meta["dirty"] else "")
        + f", started {meta['started']}, {meta['duration_s']:.0f} s; {meta['machine']}.",
        "",
    ]
    for note in meta.get("notes", []):
        lines += [f"Note: {note}", ""]
    if "affinity" in results:
        lines += _md_affinity(results["affinity"])
    if "fairness" in results:
        lines += _md_fairness(results["fairness"])
    if "cost" in results:
        lines += _md_cost(results["cost"])
    return "\n".join(lines) + "\n"


def _md_affinity(r: dict[str, Any]) -> list[str]:
    p = r["plan"]
    arms = r["arms"]
    out = [
        "## 1. Prefix affinity vs load-only vs round-robin",
        "",
        f"{REPLICAS} replicas x {p['blocks'] * BLOCK:,} KV tokens, prefix caching, prefill "
        f"{p['prefill_ms_per_1k']:g} ms per 1k uncached tokens + {p['ttft_ms']:g} ms, "
        f"{p['itl_ms']:g} ms/token x {p['output_tokens']}; {len(p['system_tokens'])} tenants, "
        f"system prompts {min(p['system_tokens']):,}-{max(p['system_tokens']):,} tokens, user "
        f"turns {p['user_tokens'][0]}-{p['user_tokens'][1]} tokens; {p['requests']} streamed "
        f"requests per arm, {p['concurrency']} in flight, in {p['rounds']} round(s) (arm order "
        "reversed every round, simulators reset before every arm). Per-pod cells in endpoint "
        "order.",
        "",
        "| measure | " + " | ".join(AFFINITY_ARMS) + " |",
        "|---|" + "---|" * len(AFFINITY_ARMS),
    ]

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        out.append(f"| {label} | " + " | ".join(fn(arms[a]) for a in AFFINITY_ARMS) + " |")

    def per_pod(a: dict[str, Any], key: str) -> str:
        return " / ".join(_f(v[key], 0) for v in a["pods"])

    row("requests ok / sent", lambda a: f"{a['ok']} / {a['requests']}")
    row("prefix-cache hit rate (sims: hits / queries)", lambda a: _pct(a["prefix_hit_rate"]))
    if p["rounds"] > 1:
        row(
            "hit rate per round",
            lambda a: " / ".join(_pct(v) for v in a["prefix_hit_rate_per_round"]),
        )
    row(
        "mean cached_tokens (usage) of mean prompt",
        lambda a: f"{_f(a['mean_cached_tokens'], 0)} of {_f(a['mean_prompt_tokens'], 0)}",
    )
    row(
        "TTFT p50 / p95 / mean, ms",
        lambda a: (
            f"{_f(a['ttft_ms']['p50'])} / {_f(a['ttft_ms']['p95'])} / {_f(a['ttft_ms']['mean'])}"
        ),
    )
    row(
        "TTFT p50, system prompt cached / not, ms (requests cached)",
        lambda a: (
            f"{_f(a['ttft_ms']['p50_cache_hit'])} / {_f(a['ttft_ms']['p50_cache_miss'])}"
            f" ({a['ttft_ms']['cache_hit_requests']})"
        ),
    )
    row(
        "latency p50 / p95, ms",
        lambda a: f"{_f(a['latency_ms']['p50'])} / {_f(a['latency_ms']['p95'])}",
    )
    row("throughput, requests/s", lambda a: _f(a["requests_per_s"]))
    row("prompt tokens/s", lambda a: _f(a["prompt_tokens_per_s"], 0))
    row("requests served per pod", lambda a: per_pod(a, "served"))
    row("pods serving each tenant (of 3)", lambda a: _spread(a["tenant_requests_per_pod"]))
    if p["rounds"] > 1:
        row(
            "pods serving each tenant, per round",
            lambda a: " / ".join(f"{v:.1f}" for v in a["pods_per_tenant_per_round"]),
        )
    row("peak requests running per pod", lambda a: per_pod(a, "peak_running"))
    row("prefix-cache evictions per pod (blocks)", lambda a: per_pod(a, "prefix_cache_evictions"))
    row("preemptions per pod", lambda a: per_pod(a, "preemptions"))
    row(
        "peak KV held per pod (sim) / capacity",
        lambda a: (
            per_pod(a, "peak_kv_tokens_used") + f" of {_f(a['pods'][0]['kv_capacity_tokens'], 0)}"
        ),
    )
    row("kvgate's reserved peak per pod (sampled) / budget", _reserved_cell)
    row(
        "kvgate picks by affinity hit / miss",
        lambda a: (
            f"{a['kvgate_pool_picks']['hit']:.0f} / {a['kvgate_pool_picks']['miss']:.0f}"
            if sum(a["kvgate_pool_picks"].values())
            else "n/a (no pool)"
        ),
    )
    row(
        "other users' CPU during the arm, cores (of 2)",
        lambda a: _f(a["cpu"]["foreign_cores"], 2),
    )
    reset_ok = all(a["reset_cleared_prefix_cache"] for a in arms.values())
    probe = r.get("simulator_probe")
    out += [
        "",
        (
            "The simulator's own CPU per request (not the prefill model): a request whose "
            "system prompt is cached, sent straight to one simulator, has TTFT p50 "
            f"{_f(probe['ttft_ms_one_at_a_time_p50'])} ms one at a time and "
            f"{_f(probe['ttft_ms_four_at_once_p50'])} ms (max "
            f"{_f(probe['ttft_ms_four_at_once_max'])}) four at once (nominal: "
            f"{p['ttft_ms']:g} ms + {p['prefill_ms_per_1k']:g} ms per 1k uncached tokens)."
            if probe
            else ""
        ),
        "",
        "Peaks from each simulator's `/sim/stats` (KV held by running sequences, a shared "
        "prefix block counted once). "
        + (
            "`POST /sim/reset` emptied every prefix cache between arms (checked)."
            if reset_ok
            else "`POST /sim/reset` did NOT empty the prefix caches: simulators restarted."
        ),
        "",
        "Requests per pod by tenant (pods in endpoint order):",
        "",
        "| tenant | " + " | ".join(AFFINITY_ARMS) + " |",
        "|---|" + "---|" * len(AFFINITY_ARMS),
    ]
    for t in TENANTS_1:
        out.append(
            f"| {t} | "
            + " | ".join(
                " / ".join(str(n) for n in arms[a]["tenant_requests_per_pod"][t])
                for a in AFFINITY_ARMS
            )
            + " |"
        )
    out.append("")
    return out


def _spread(tenant_pods: dict[str, list[int]]) -> str:
    counts = [sum(1 for n in pods if n) for pods in tenant_pods.values()]
    return f"mean {sum(counts) / len(counts):.1f} (" + ", ".join(map(str, counts)) + ")"


def _reserved_cell(a: dict[str, Any]) -> str:
    peaks = [v["kvgate_reserved_peak_sampled"] for v in a["pods"]]
    if any(v is not None for v in peaks):
        return " / ".join(_f(v, 0) for v in peaks) + f" of {_f(a['kv_budget_per_pod'], 0)}"
    rr = a["kvgate_reserved_peak_sampled"].get(RR)
    return f"one ledger: {_f(rr, 0)} of {_f(a['kv_budget_per_pod'] * REPLICAS, 0)}"


def _md_fairness(r: dict[str, Any]) -> list[str]:
    p = r["plan"]
    ph = r["phases"]
    out = [
        "## 2. Fairness: a full pool with a queue",
        "",
        f"{REPLICAS} endpoints with kvgate's budget of {r['kv_budget_per_pod']:,} KV tokens each "
        f"(two requests); requests of ~{p['prompt_words'] + 20:,} prompt + {p['max_tokens']} "
        f"output tokens ({p['ttft_ms']:g} ms TTFT, {p['itl_ms']:g} ms/token), streamed; closed "
        f"loop, {p['duration_s']:g} s per phase; "
        f"queue `max_wait_s: {p['max_wait_s']:g}`, VTC weights w_p = {p['input_weight']:g}, "
        f"w_q = {p['output_weight']:g}; without a queue a 429 is retried after "
        f"{p['retry_429_s']:g} s. Wait = send to arrival at a simulator (client clock).",
        "",
        "| phase / tenant | clients | admitted/s | tokens admitted/s | 429s (share of attempts) "
        "| wait p50 / p95 / max, ms | the same for requests sent after the start-up burst "
        "| kvgate queue wait mean / p50 / p95, ms (n) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for phase in FAIR_PHASES:
        if phase not in ph:
            continue
        for t, v in ph[phase]["tenants"].items():
            w, k, w2 = v["wait_ms"], v["kvgate_queue_wait"], v["wait_ms_after_startup"]
            kv_cell = (
                f"{_f(k['mean_ms'])} / {_f(k['p50_ms'])} / {_f(k['p95_ms'])} ({k['count']:.0f})"
                if k["count"]
                else "none queued"
            )
            out.append(
                f"| {phase} / {t} | {v['clients']} | {_f(v['admitted_per_s'])} "
                f"| {_f(v['tokens_admitted_per_s'], 0)} | {v['http_429']} ({_pct(v['share_429'])}) "
                f"| {_f(w['p50'])} / {_f(w['p95'])} / {_f(w['max'])} "
                f"| {_f(w2['p50'])} / {_f(w2['p95'])} / {_f(w2['max'])} | {kv_cell} |"
            )
    out += [
        "",
        "| phase | heavy / light service | max abs(W_heavy - W_light) while both wait: "
        "whole phase / after both were first admitted / the same, path discounted "
        "| bound 2·max(w_p·L + w_q·M) "
        "| both waiting, s (intervals) | longest wait, s | queue drops | preemptions "
        "| peak KV held per pod (sim) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in FAIR_PHASES:
        if phase not in ph:
            continue
        v = ph[phase]
        vtc = v.get("vtc")
        steady = v.get("vtc_after_first_admissions")
        discounted = v.get("vtc_after_first_admissions_path_discounted")
        pods = v["pods"]
        diff = (
            f"{_f(vtc['max_service_difference'], 0)} / "
            f"{_f(steady['max_service_difference'], 0)} (from {_f(steady['since_s'], 2)} s) / "
            f"{_f(discounted['max_service_difference'], 0) if discounted else 'n/a'}"
            if vtc and steady
            else "n/a"
        )
        out.append(
            f"| {phase} | {_f(v['service_ratio_heavy_over_light'], 2)} "
            f"| {diff} "
            f"| {_f(vtc['bound'], 0) if vtc else 'n/a'} "
            f"| {_both(vtc)} "
            f"| {_f(v['max_wait_s_seen'], 2)} (max_wait_s {v['max_wait_s']:g}) "
            f"| {v['queue_drops'] or 'none'} "
            f"| {sum(x['preemptions'] for x in pods)} "
            f"| {' / '.join(_f(x['peak_kv_tokens_used'], 0) for x in pods)} |"
        )
    out += [
        "",
        "Path discounted: the median send-to-admission time of requests admitted without a "
        f"queue ({_f(r['path_s_without_queue_p50'] * 1e3, 1)} ms, the no-queue phase) taken "
        "off the start of every wait, as the client's clock starts before the request can "
        "reach kvgate's queue.",
        "",
    ]
    return out


def _both(vtc: dict[str, Any] | None) -> str:
    if not vtc:
        return "n/a"
    return f"{_f(vtc['both_backlogged_s'], 1)} ({vtc['both_backlogged_intervals']})"


def _md_cost(r: dict[str, Any]) -> list[str]:
    p = r["plan"]
    il = r["interleaved"]
    out = [
        "## 3. Decision cost of picking",
        "",
        f"One request in flight, arms interleaved request by request, {p['iterations']} "
        f"requests per arm, ~{p['prompt_tokens']:,}-token prompts (unique), {p['max_tokens']} "
        "output tokens, simulators answering at once. CPU per request from "
        f"/proc/<pid>/task/*/schedstat, from the send until {p['pause_ms']:g} ms after the "
        f"response. Other users' CPU meanwhile: {_f(r['cpu']['foreign_cores'], 2)} cores.",
        "",
        "| arm | n (fail) | p50 ms | p90 ms | added p50 vs Envoy, ms (paired) "
        "| vs kvgate single backend, paired p50, ms | kvgate CPU ms/request "
        "| Envoy CPU ms/request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in COST_ARMS:
        v = il[arm]
        vs = _f(v["paired_vs_single_p50_ms"], 2) if arm == "kvgate-pool" else ""
        out.append(
            f"| {arm} | {v['n']} ({v['failures']}) | {_f(v['p50_ms'], 2)} | {_f(v['p90_ms'], 2)} "
            f"| {_f(v['added_p50_ms'], 2)} ({_f(v['paired_added_p50_ms'], 2)}) | {vs} "
            f"| {_f(v['kvgate_cpu_ms'], 2)} | {_f(v['envoy_cpu_ms'], 2)} |"
        )
    picks = " / ".join(_f(v, 0) for v in r["pool_picks_per_endpoint"].values())
    out += [
        "",
        f"The pool arm's picks per endpoint: {picks} (unique prompts: no affinity, so load, "
        "ties by rendezvous hash of the first block).",
        "",
        f"In-process `timeit` (best of {p['timeit_repeat']}, microseconds per call) of the "
        "picking pieces of `PoolScheduler.place`; the prefix index holds 100,000 entries, the "
        "prompt's prefix is recorded on one endpoint (hit) or never seen (miss):",
        "",
    ]
    rows = r["microbench"]
    fixed = ("prompt_tokens", "endpoints", "affinity_chars", "blocks", "matched")
    pieces = [k for k in rows[0] if k not in fixed]
    out.append("| prompt tokens | endpoints | blocks hashed | " + " | ".join(pieces) + " |")
    out.append("|---|---|---|" + "---|" * len(pieces))
    for row in rows:
        out.append(
            f"| {row['prompt_tokens']:,} | {row['endpoints']} | {row['blocks']} | "
            + " | ".join(_f(row[k], 1) for k in pieces)
            + " |"
        )
    out.append("")
    return out


# =========================================================================== main


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} vCPUs ({model}), Python {platform.python_version()}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 4)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def run(parts: list[str], plans: Plans, work: Path, results: dict[str, Any]) -> None:
    from testbed.demo_model import demo_model_dir

    t0 = time.monotonic()

    def stage(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {text}", flush=True)

    rig = Rig(work, demo_model_dir())
    try:
        stage("starting the processes")
        rig.start_sims(SIM_NAMES, sim_args(plans))
        if "cost" in parts:
            rig.start_sims(COST_SIMS, sim_args(plans, cost=True))
        first = rig.sims[SIM_NAMES[0]]
        kv = rig.kvgate("main", main_config(rig, model_backend=POOL, pool_budget=BIG))
        envoy = rig.envoy(
            "main",
            kvgate=kv,
            backends={SINGLE: first, RR: first},
            pools=[POOL],
            round_robin={RR: [rig.sims[n] for n in SIM_NAMES]},
        )
        single: tuple[Kvgate, EnvoyProc] | None = None
        plain: EnvoyProc | None = None
        if "cost" in parts:
            c0 = rig.sims[COST_SIMS[0]]
            kv_single = rig.kvgate(
                "single",
                {
                    "store": "memory",
                    "tenants": ALL_TENANTS,
                    "models": [_model(rig, SINGLE)],
                    "backends": [
                        {
                            "name": SINGLE,
                            "kv_budget_tokens": BIG,
                            "kv_block_size": BLOCK,
                            "max_concurrent_requests": 100_000,
                        }
                    ],
                },
            )
            single = (kv_single, rig.envoy("single", kvgate=kv_single, backends={SINGLE: c0}))
            plain = rig.envoy("plain", kvgate=None, backends={SINGLE: c0})
        rig.wait_ready()
        for part in parts:
            if part == "affinity":
                stage("1. prefix affinity vs load-only vs round-robin")
                results["affinity"] = run_affinity(
                    rig, kv, envoy, plans.affinity, plans.quiet_timeout_s
                )
            elif part == "fairness":
                stage("2. fairness")
                results["fairness"] = run_fairness(
                    rig, kv, envoy, plans.fairness, plans.quiet_timeout_s
                )
            else:
                assert single is not None and plain is not None
                stage("3. decision cost")
                results["cost"] = run_cost(
                    rig, kv, envoy, single, plain, plans.cost, plans.quiet_timeout_s
                )
        stage("done")
    finally:
        results["meta"]["notes"] = rig.notes
        rig.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
            "machine": _machine(),
            "parts": parts,
        }
    }
    t0 = time.monotonic()
    try:
        run(parts, QUICK if args.quick else FULL, work, results)
    finally:
        results["meta"]["duration_s"] = time.monotonic() - t0
        clean = _jsonable(results)
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


if __name__ == "__main__":
    sys.exit(main())
