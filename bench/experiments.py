"""The benchmark procedure: which runs, in which order, and what each records.

Phases (the simulator answers at once for phases 1-7, then streams at a fixed pace):

1. warm-up: a few requests per arm and prompt size;
2. baseline: closed loop, one request in flight (the unloaded latency, and its p99 for the
   sustainability criterion);
3. peak: closed loop with wrk (2xx per second; plain Envoy's is the reference load);
4. load: open-loop Poisson at 25/50/75 % of plain Envoy's peak, latency from the intended
   send time, CPU of every process per run;
5. sustain: the highest open-loop rate with p99 < 2 x the arm's unloaded p99 and no error
   (bisection per arm, arms interleaved step by step);
6. reject: kvgate CPU per request for a 429 versus an admit, at the same rate;
7. sizes: unloaded latency at 1k / 10k / 100k-token prompts;
8. profile: py-spy on kvgate under the 50 % load;
9. stream: open-loop streamed requests (simulator at a fixed inter-token latency): time to
   first token and every inter-token gap, both Envoy configurations of kvgate;
10. profile of the streamed path.

Every measured phase runs in rounds; inside a round every arm runs once, in an order rotated
from round to round (ABC, BCA, CAB, ...), so slow drifts of the machine spread over all arms.
Results are rows (one per run) kept in memory and written as CSV by bench/report.py.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import prompts, wrk
from bench.cpu import machine_busy_seconds, tree_cpu_seconds
from bench.loadgen import Job
from bench.stack import API_KEY, LIMITED_KEY, MODEL, SHORT_KEY, Arm, BenchStack, SimSettings
from bench.stats import Spread, summarize

REFERENCE = "envoy"  # "added" latency is over plain Envoy


@dataclass
class Plan:
    name: str
    rounds: int
    baseline_s: float
    peak_s: float
    peak_connections: tuple[int, ...]
    level_s: float
    sustain_fractions: tuple[float, ...]  # of the arm's own closed-loop peak
    sustain_s: float
    reject_s: float
    size_requests: dict[int, int]
    stream_rates: tuple[float, ...]
    stream_s: float
    profile_s: float
    levels: tuple[float, ...] = (0.25, 0.5, 0.75)
    warmup_s: float = 1.0  # of every open-loop run, sent but not reported
    stream_tokens: int = 32
    stream_itl_ms: float = 10.0
    nonstream_max_tokens: int = 16
    drain_s: float = 15.0  # open loop: how long requests may run on after the last arrival
    # Load phase: an arm offered more than this times its own peak runs once, for 3 s.
    overload_factor: float = 1.2
    slo_p99_ms: float = 50.0  # the second sustainability criterion (absolute)
    # A shared machine: wait up to quiet_wait_s before a run for other users' work to stop
    # (quiet_budget_s in all), and repeat a run during which others used more than
    # foreign_limit_cores (retry_budget runs in all).
    quiet_wait_s: float = 10.0
    quiet_budget_s: float = 240.0
    foreign_limit_cores: float = 0.3
    retry_budget: int = 40
    quiesce_timeout_s: float = 60.0  # e.g. LiteLLM working off a backlog after an overload

    def describe(self) -> dict[str, Any]:
        return asdict(self)


QUICK = Plan(
    name="quick",
    rounds=2,
    baseline_s=2.5,
    peak_s=3.0,
    peak_connections=(16,),
    level_s=3.0,
    sustain_fractions=(0.1, 0.3, 0.6),
    sustain_s=3.0,
    reject_s=3.0,
    size_requests={1000: 10, 10000: 5, 100000: 2},
    stream_rates=(10.0,),
    stream_s=4.0,
    profile_s=6.0,
    drain_s=5.0,
    quiet_budget_s=20.0,
    retry_budget=4,
    quiesce_timeout_s=30.0,
)

FULL = Plan(
    name="full",
    rounds=3,
    baseline_s=5.0,
    peak_s=4.0,
    peak_connections=(8, 32),
    level_s=6.0,
    sustain_fractions=(0.1, 0.25, 0.4, 0.6, 0.8),
    sustain_s=5.0,
    reject_s=5.0,
    size_requests={1000: 40, 10000: 20, 100000: 5},
    stream_rates=(10.0, 30.0),
    stream_s=6.0,
    profile_s=15.0,
    quiet_budget_s=180.0,
    retry_budget=30,
)


class LoadGenClient:
    """The generator process (`python -m bench.loadgen --serve`), one JSON job at a time."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, job: Job) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(asdict(job)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited (rc {self.proc.poll()})")
        summary: dict[str, Any] = json.loads(line)
        if not summary.get("ok"):
            raise RuntimeError(f"load generator: {summary.get('error')}")
        with open(job.out_path, encoding="utf-8") as fh:
            result: dict[str, Any] = json.load(fh)
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def _children_cpu() -> float:
    """CPU of this process's finished children (wrk), for the foreign-CPU estimate."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rotated_pairs(items: list[tuple[str, str]], k: int) -> list[tuple[str, str]]:
    k %= len(items)
    return items[k:] + items[:k]


def rotated(items: list[str], k: int) -> list[str]:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def http_post_json(
    url: str, body: dict[str, Any], headers: dict[str, str], timeout: float = 60.0
) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read().decode() or "null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def kvgate_decisions(url: str | None) -> dict[str, tuple[float, float]]:
    """outcome -> (sum seconds, count) of kvgate_decision_seconds."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("kvgate_decision_seconds_"):
            continue
        name, _, value = line.rpartition(" ")
        kind = name.split("{", 1)[0].removeprefix("kvgate_decision_seconds_")
        if kind not in ("sum", "count"):
            continue
        outcome = name.split('outcome="', 1)[1].split('"', 1)[0] if "outcome=" in name else ""
        entry = out.setdefault(outcome, [0.0, 0.0])
        entry[0 if kind == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass
class Context:
    """What later phases need from earlier ones."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    baseline_p99_ms: dict[str, float] = field(default_factory=dict)
    peak_rps: dict[str, float] = field(default_factory=dict)
    sustainable_rps: dict[str, float] = field(default_factory=dict)


class Bench:
    def __init__(
        self,
        stack: BenchStack,
        plan: Plan,
        work_dir: Path,
        results_dir: Path,
        *,
        log: Callable[[str], None] = print,
        phases: Iterable[str] | None = None,
    ) -> None:
        self.stack = stack
        self.plan = plan
        self.work_dir = work_dir
        self.results_dir = results_dir
        self.runs_dir = work_dir / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.rows: list[dict[str, Any]] = []
        self.ctx = Context()
        self.phases = set(phases) if phases is not None else None
        self.lg = LoadGenClient(work_dir / "logs" / "loadgen.log")
        self._run_seq = 0
        self.quiet_budget_s = plan.quiet_budget_s
        self.retries_left = plan.retry_budget
        self.bodies: dict[tuple[int, bool], Path] = {}
        for size in plan.size_requests:
            self.bodies[(size, False)] = prompts.write_template(
                work_dir, MODEL, size, max_tokens=plan.nonstream_max_tokens
            )
        self.bodies[(1000, True)] = prompts.write_template(
            work_dir, MODEL, 1000, max_tokens=plan.stream_tokens, stream=True
        )
        self.started = time.monotonic()

    # ------------------------------------------------------------------ plumbing

    def wants(self, phase: str) -> bool:
        return self.phases is None or phase in self.phases

    @property
    def arm_names(self) -> list[str]:
        """Non-streamed phases: every arm except the split config (same request path as
        kvgate; it differs only on the response path, measured in the stream phase)."""
        return [a for a in self.stack.arms if a != "kvgate-split"]

    def close(self) -> None:
        self.lg.close()

    def _job(self, arm: Arm, body: Path, **kwargs: Any) -> Job:
        self._run_seq += 1
        api_key = kwargs.pop("api_key", None)
        return Job(
            url=arm.chat_url,
            body_path=str(body),
            headers=arm.headers(api_key),
            out_path=str(self.runs_dir / f"run-{self._run_seq:05d}.json"),
            id_prefix=f"{self._run_seq:x}-",
            seed=self._run_seq,
            **kwargs,
        )

    def _cpu(self, arm: Arm) -> dict[str, float]:
        pids = dict(arm.pids)
        pids["sim"] = self.stack.sim_pid
        pids["loadgen"] = self.lg.pid
        return {role: tree_cpu_seconds(pid) for role, pid in pids.items()}

    def measure(
        self, experiment: str, round_: int, arm_name: str, job: Job, **extra: Any
    ) -> dict[str, Any]:
        """One run; repeated once (within the retry budget) when another user's work took
        a sizeable share of the CPU during it. The row says how much (foreign_cpu_cores)."""
        row = self._measure_once(experiment, round_, arm_name, job, **extra)
        if self._contaminated(row) and self.retries_left > 0:
            self.retries_left -= 1
            self.log(
                f"  ~ {experiment}/{arm_name}: {row['foreign_cpu_cores']:.2f} cores used by "
                "others during the run; running it again"
            )
            self.rows.remove(row)
            self._run_seq += 1
            # New request ids too: a repeated prompt would hit kvgate's tokenizer cache.
            job = Job(
                **{
                    **asdict(job),
                    "out_path": str(self.runs_dir / f"run-{self._run_seq:05d}.json"),
                    "id_prefix": f"{self._run_seq:x}-",
                    "seed": self._run_seq,
                }
            )
            row = self._measure_once(experiment, round_, arm_name, job, **extra)
            row["retried"] = True
        return row

    def _measure_once(
        self, experiment: str, round_: int, arm_name: str, job: Job, **extra: Any
    ) -> dict[str, Any]:
        arm = self.stack.arms[arm_name]
        self.settle(f"{experiment}/{arm_name}")
        metrics_url = self.stack.kvgate_metrics_url(arm_name)
        dec0 = kvgate_decisions(metrics_url)
        cpu0 = self._cpu(arm)
        own0 = self.stack.stack_cpu_seconds() + tree_cpu_seconds(self.lg.pid)
        busy0 = machine_busy_seconds()
        res = self.lg.run(job)
        busy1 = machine_busy_seconds()
        own1 = self.stack.stack_cpu_seconds() + tree_cpu_seconds(self.lg.pid)
        cpu1 = self._cpu(arm)
        dec1 = kvgate_decisions(metrics_url)
        n = len(res["latency"])
        ok = sum(1 for s in res["status"] if 200 <= s < 300)
        row: dict[str, Any] = {
            "experiment": experiment,
            "round": round_,
            "arm": arm_name,
            "mode": job.mode,
            "stream": job.stream,
            "rate": job.rate if job.mode == "open" else math.nan,
            "concurrency": job.concurrency if job.mode == "closed" else math.nan,
            **extra,
            "sent": res["sent"],
            "reported": n,
            "ok": ok,
            "errors": sum(res["errors"].values()),
            "error_kinds": json.dumps(res["errors"], sort_keys=True),
            "measured_s": res["measured_s"],
            "achieved_rps": ok / res["measured_s"] if res["measured_s"] else math.nan,
        }
        row.update(summarize(res["latency"], "lat"))
        row.update(summarize(res["service"], "svc"))
        row.update(summarize(res["lag"], "lag"))
        if job.stream:
            row.update(summarize(res["ttft"], "ttft"))
            row.update(summarize(res["gaps"], "itl"))
            row["tokens_mean"] = sum(res["tokens"]) / len(res["tokens"]) if res["tokens"] else 0
        # CPU used on this machine by anything but this benchmark (other sessions' tests):
        # a run with a lot of it is suspect.
        row["foreign_cpu_cores"] = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(
            1e-9, res["wall_s"]
        )
        wall_requests = max(1, res["sent"])
        for role in cpu0:
            used = cpu1[role] - cpu0[role]
            row[f"cpu_{role}_s"] = used
            row[f"cpu_{role}_ms_per_req"] = used / wall_requests * 1e3
        for outcome, (s1, c1) in dec1.items():
            s0, c0 = dec0.get(outcome, (0.0, 0.0))
            if c1 > c0:
                row[f"decision_{outcome}_mean_ms"] = (s1 - s0) / (c1 - c0) * 1e3
        self.rows.append(row)
        return row

    def settle(self, what: str) -> None:
        """Before a run: the simulator idle, the whole stack quiet, and (within a bounded
        budget for the whole benchmark) the machine quiet too: this machine may be shared,
        and another user's test run would otherwise land in the middle of a measurement."""
        if not self.stack.sim_idle(30):
            self.log(f"  ! simulator still busy before {what}")
        budget = max(0.0, min(self.plan.quiet_wait_s, self.quiet_budget_s))
        quiet, waited = self.stack.quiesce(
            timeout=self.plan.quiesce_timeout_s, machine_max_cores=0.25, machine_timeout=budget
        )
        self.quiet_budget_s -= waited
        if not quiet:
            self.log(f"  ! stack still busy before {what}")

    def _contaminated(self, row: dict[str, Any]) -> bool:
        return bool(row.get("foreign_cpu_cores", 0.0) > self.plan.foreign_limit_cores)

    def _say(self, row: dict[str, Any]) -> None:
        parts = [
            f"{row['experiment']:8s} r{row['round']} {row['arm']:13s}",
            f"rate {row['rate']:.0f}"
            if not math.isnan(row["rate"])
            else f"c={row['concurrency']:.0f}",
            f"ok {row['ok']}/{row['reported']}",
            f"p50 {row['lat_p50']:.2f} p99 {row['lat_p99']:.2f} ms",
        ]
        if row.get("stream"):
            parts.append(
                f"ttft50 {row['ttft_p50']:.2f} itl50 {row['itl_p50']:.2f} "
                f"itl99 {row['itl_p99']:.2f}"
            )
        if row["errors"]:
            parts.append(f"errors {row['error_kinds']}")
        if row.get("foreign_cpu_cores", 0) > 0.2:
            parts.append(f"(foreign CPU {row['foreign_cpu_cores']:.2f} cores)")
        self.log("  " + "  ".join(parts))

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.0f}s"

    # ------------------------------------------------------------------ phases

    def run(self) -> None:
        fast = SimSettings(ttft_ms=0.0, itl_ms=0.0)
        if self.stack.sim_settings != fast:
            self.stack.restart_sim(fast)
        self.phase_warmup()
        if self.wants("baseline") or self.wants("sustain"):
            self.phase_baseline()
        if self.wants("peak") or self.wants("load") or self.wants("sustain"):
            self.phase_peak()
        if self.wants("load"):
            self.phase_load()
        if self.wants("sustain"):
            self.phase_sustain()
        if self.wants("reject"):
            self.phase_reject()
        if self.wants("sizes"):
            self.phase_sizes()
        if self.wants("profile"):
            self.phase_profile(stream=False)
        if self.wants("stream") or self.wants("profile"):
            self.stack.restart_sim(SimSettings(ttft_ms=0.0, itl_ms=self.plan.stream_itl_ms))
            self.phase_warmup(stream=True)
            if self.wants("stream"):
                self.phase_stream()
            if self.wants("profile"):
                self.phase_profile(stream=True)

    def phase_warmup(self, stream: bool = False) -> None:
        self.log(f"[{self.elapsed()}] warm-up{' (streams)' if stream else ''}")
        arms = list(self.stack.arms) if stream else self.arm_names
        for name in arms:
            arm = self.stack.arms[name]
            body = self.bodies[(1000, True)] if stream else self.bodies[(1000, False)]
            self.lg.run(
                self._job(arm, body, mode="closed", concurrency=4, duration_s=1.5, warmup_s=99)
            )
        if stream:
            return
        direct = self.stack.arms.get("direct") or next(iter(self.stack.arms.values()))
        for size in self.plan.size_requests:
            status, resp = http_post_json(
                direct.chat_url, prompts.sample_body(self.bodies[(size, False)]), direct.headers()
            )
            if status == 200 and isinstance(resp, dict):
                self.ctx.prompt_tokens[size] = int(resp["usage"]["prompt_tokens"])
        self.log(f"  prompt tokens by size: {self.ctx.prompt_tokens}")

    def phase_baseline(self) -> None:
        self.log(f"[{self.elapsed()}] baseline: closed loop, 1 in flight, {self.plan.baseline_s}s")
        p99s: dict[str, list[float]] = {}
        for r in range(self.plan.rounds):
            for name in rotated(self.arm_names, r):
                job = self._job(
                    self.stack.arms[name],
                    self.bodies[(1000, False)],
                    mode="closed",
                    concurrency=1,
                    duration_s=self.plan.baseline_s + 0.5,
                    warmup_s=0.5,
                )
                row = self.measure("baseline", r, name, job, level=0.0)
                p99s.setdefault(name, []).append(row["lat_p99"])
                self._say(row)
        self.ctx.baseline_p99_ms = {k: Spread.of(v).median for k, v in p99s.items()}

    def phase_peak(self) -> None:
        self.log(
            f"[{self.elapsed()}] peak: wrk closed loop, {self.plan.peak_connections} connections"
        )
        if not wrk.available():
            raise RuntimeError("wrk is not installed (apt-get install wrk)")
        best: dict[str, list[float]] = {}
        for r in range(self.plan.rounds):
            for name in rotated(self.arm_names, r):
                arm = self.stack.arms[name]
                per_round = 0.0
                for conns in self.plan.peak_connections:
                    for attempt in range(2):
                        row, result = self._peak_once(r, name, arm, conns)
                        if not self._contaminated(row) or self.retries_left <= 0 or attempt:
                            break
                        self.retries_left -= 1
                        self.log(
                            f"  ~ peak/{name}: {row['foreign_cpu_cores']:.2f} cores used by "
                            "others during the run; running it again"
                        )
                    row["retried"] = attempt > 0
                    self.rows.append(row)
                    per_round = max(per_round, result.ok_rps)
                    self.log(
                        f"  peak     r{r} {name:13s} c={conns:<3d} {result.ok_rps:8.1f} rps "
                        f"(non-2xx {result.non_2xx}, socket errors {result.socket_errors})"
                    )
                best.setdefault(name, []).append(per_round)
        self.ctx.peak_rps = {k: Spread.of(v).median for k, v in best.items()}
        self.log(f"  peak medians: { {k: round(v, 1) for k, v in self.ctx.peak_rps.items()} }")

    def _peak_once(
        self, r: int, name: str, arm: Arm, conns: int
    ) -> tuple[dict[str, Any], wrk.WrkResult]:
        self.settle(f"peak/{name}")
        cpu0 = self._cpu(arm)
        own0 = self.stack.stack_cpu_seconds() + _children_cpu()
        busy0 = machine_busy_seconds()
        self._run_seq += 1
        result = wrk.run_wrk(
            arm.chat_url,
            self.bodies[(1000, False)],
            arm.headers(),
            connections=conns,
            duration_s=self.plan.peak_s,
            script_path=self.work_dir / f"wrk-{self._run_seq}.lua",
            id_prefix=f"w{self._run_seq:x}-",
        )
        busy1 = machine_busy_seconds()
        own1 = self.stack.stack_cpu_seconds() + _children_cpu()
        cpu1 = self._cpu(arm)
        row: dict[str, Any] = {
            "experiment": "peak",
            "round": r,
            "arm": name,
            "mode": "wrk",
            "concurrency": conns,
            "rate": math.nan,
            "sent": result.requests,
            "ok": result.requests - result.non_2xx,
            "errors": result.non_2xx + result.socket_errors,
            "measured_s": result.duration_s,
            "achieved_rps": result.ok_rps,
            "foreign_cpu_cores": max(0.0, (busy1 - busy0) - (own1 - own0))
            / max(1e-9, result.duration_s),
        }
        for role in cpu0:
            used = cpu1[role] - cpu0[role]
            row[f"cpu_{role}_s"] = used
            row[f"cpu_{role}_ms_per_req"] = used / max(1, result.requests) * 1e3
        return row, result

    def reference_peak(self) -> float:
        peak = self.ctx.peak_rps.get(REFERENCE)
        if not peak:
            raise RuntimeError("no plain-Envoy peak: the envoy arm is needed as the reference")
        return peak

    def phase_load(self) -> None:
        peak = self.reference_peak()
        self.log(
            f"[{self.elapsed()}] load: open-loop Poisson at {self.plan.levels} of plain Envoy's "
            f"peak ({peak:.0f} rps), {self.plan.level_s}s each"
        )
        for r in range(self.plan.rounds):
            for level in self.plan.levels:
                rate = level * peak
                for name in rotated(self.arm_names, r):
                    # An arm offered well over its own closed-loop peak only builds a queue
                    # (and then takes long to drain): measure that once, briefly, in round 0.
                    own_peak = self.ctx.peak_rps.get(name, 0.0)
                    overloaded = bool(own_peak) and rate > self.plan.overload_factor * own_peak
                    if overloaded and r > 0:
                        continue
                    job = self._job(
                        self.stack.arms[name],
                        self.bodies[(1000, False)],
                        mode="open",
                        rate=rate,
                        duration_s=min(self.plan.level_s, 3.0) if overloaded else self.plan.level_s,
                        warmup_s=self.plan.warmup_s,
                        timeout_s=30.0,
                        drain_s=self.plan.drain_s,
                    )
                    row = self.measure("load", r, name, job, level=level, overloaded=overloaded)
                    self._say(row)

    def phase_sustain(self) -> None:
        fractions = self.plan.sustain_fractions
        self.log(
            f"[{self.elapsed()}] sustain: open loop at {fractions} of each arm's own peak; "
            f"criteria: p99 < 2x unloaded p99 and no error; p99 < {self.plan.slo_p99_ms} ms "
            "and no error"
        )
        best_strict: dict[str, float] = dict.fromkeys(self.arm_names, 0.0)
        best_slo: dict[str, float] = dict.fromkeys(self.arm_names, 0.0)
        for i, fraction in enumerate(fractions):
            for name in rotated(self.arm_names, i):
                rate = fraction * self.ctx.peak_rps.get(name, 0.0)
                if rate <= 0:
                    continue
                job = self._job(
                    self.stack.arms[name],
                    self.bodies[(1000, False)],
                    mode="open",
                    rate=rate,
                    duration_s=self.plan.sustain_s,
                    warmup_s=self.plan.warmup_s,
                    timeout_s=30.0,
                    drain_s=self.plan.drain_s,
                )
                row = self.measure("sustain", i, name, job, level=fraction)
                limit = 2 * self.ctx.baseline_p99_ms.get(name, math.inf)
                clean = row["errors"] == 0 and row["ok"] >= 0.99 * max(1, row["reported"])
                strict = clean and row["lat_p99"] < limit
                slo = clean and row["lat_p99"] < self.plan.slo_p99_ms
                row.update(sustain_limit_ms=limit, sustain_strict=strict, sustain_slo=slo)
                if strict:
                    best_strict[name] = max(best_strict[name], rate)
                if slo:
                    best_slo[name] = max(best_slo[name], rate)
                self._say(row)
                self.log(
                    f"    -> 2x-unloaded ({limit:.1f} ms): {'pass' if strict else 'fail'}; "
                    f"{self.plan.slo_p99_ms:.0f} ms: {'pass' if slo else 'fail'}"
                )
        self.ctx.sustainable_rps = best_strict
        for name in self.arm_names:
            self.rows.append(
                {
                    "experiment": "sustain_result",
                    "round": -1,
                    "arm": name,
                    "achieved_rps": best_strict[name],
                    "slo_rps": best_slo[name],
                    "lowest_tried_rps": fractions[0] * self.ctx.peak_rps.get(name, 0.0),
                }
            )

    def phase_reject(self) -> None:
        arms = [a for a in ("kvgate", "kvgate-redis") if a in self.stack.arms]
        if not arms:
            return
        kv_peak = self.ctx.peak_rps.get("kvgate") or 100.0
        rate = max(10.0, 0.25 * kv_peak)
        self.log(f"[{self.elapsed()}] reject: 429 vs admit at {rate:.0f} rps, kvgate CPU")
        # Drain the limited tenants' TPM buckets (one admit each, then every request is a 429).
        sample = prompts.sample_body(self.bodies[(1000, False)])
        for name in arms:
            arm = self.stack.arms[name]
            for key in (LIMITED_KEY, SHORT_KEY):
                for _ in range(3):
                    http_post_json(arm.chat_url, sample, arm.headers(key))
        variants = [("admit", API_KEY), ("reject", LIMITED_KEY), ("reject-short", SHORT_KEY)]
        for r in range(self.plan.rounds):
            for name in rotated(arms, r):
                for outcome, key in rotated_pairs(variants, r):
                    job = self._job(
                        self.stack.arms[name],
                        self.bodies[(1000, False)],
                        api_key=key,
                        mode="open",
                        rate=rate,
                        duration_s=self.plan.reject_s,
                        warmup_s=0.5,
                    )
                    row = self.measure("reject", r, name, job, outcome=outcome)
                    kinds: dict[str, int] = json.loads(row["error_kinds"])
                    row["rejected_429"] = kinds.get("http_429", 0)
                    if outcome != "admit":  # a 429 is the expected answer here
                        row["errors"] = sum(v for k, v in kinds.items() if k != "http_429")
                    self._say(row)

    def phase_sizes(self) -> None:
        self.log(
            f"[{self.elapsed()}] sizes: closed loop, 1 in flight, "
            f"prompts {list(self.plan.size_requests)}"
        )
        for size, count in self.plan.size_requests.items():
            body = self.bodies[(size, False)]
            for name in self.arm_names:  # one unmeasured request per arm and size
                arm = self.stack.arms[name]
                self.lg.run(
                    self._job(
                        arm,
                        body,
                        mode="closed",
                        concurrency=1,
                        max_requests=1,
                        duration_s=60,
                        warmup_s=99,
                    )
                )
            for r in range(self.plan.rounds):
                for name in rotated(self.arm_names, r):
                    job = self._job(
                        self.stack.arms[name],
                        body,
                        mode="closed",
                        concurrency=1,
                        max_requests=count,
                        duration_s=120.0,
                        warmup_s=0.0,
                        timeout_s=60.0,
                    )
                    row = self.measure(
                        "size",
                        r,
                        name,
                        job,
                        prompt_size=size,
                        prompt_tokens=self.ctx.prompt_tokens.get(size, size),
                    )
                    self._say(row)

    def phase_stream(self) -> None:
        self.log(
            f"[{self.elapsed()}] stream: {self.plan.stream_tokens} tokens at "
            f"{self.plan.stream_itl_ms} ms/token, open loop at {self.plan.stream_rates} rps"
        )
        arms = list(self.stack.arms)
        for r in range(self.plan.rounds):
            for rate in self.plan.stream_rates:
                for name in rotated(arms, r):
                    job = self._job(
                        self.stack.arms[name],
                        self.bodies[(1000, True)],
                        stream=True,
                        mode="open",
                        rate=rate,
                        duration_s=self.plan.stream_s,
                        warmup_s=self.plan.warmup_s,
                        timeout_s=30.0,
                        drain_s=self.plan.drain_s,
                    )
                    self._say(self.measure("stream", r, name, job, level=rate))

    def phase_profile(self, *, stream: bool) -> None:
        if "kvgate" not in self.stack.arms:
            return
        from bench import profile

        arm = self.stack.arms["kvgate"]
        pid = arm.pids["kvgate"]
        if stream:
            rate = max(self.plan.stream_rates)
            body = self.bodies[(1000, True)]
        else:
            # Half of kvgate's own peak: loaded, but not queueing without bound.
            rate = 0.5 * (self.ctx.peak_rps.get("kvgate") or self.reference_peak())
            body = self.bodies[(1000, False)]
        label = "stream" if stream else "request"
        self.log(f"[{self.elapsed()}] profile ({label} path): py-spy on kvgate at {rate:.0f} rps")
        out = self.results_dir / "profiles"
        out.mkdir(parents=True, exist_ok=True)
        job = self._job(
            arm,
            body,
            stream=stream,
            mode="open",
            rate=rate,
            duration_s=self.plan.profile_s + 2,
            warmup_s=1.0,
        )
        # Non-blocking Python-level sampling: a --native profile stops the process at every
        # sample and, in our A/B checks, misattributed time (e.g. to the per-request log line,
        # whose removal changed nothing measurable); native time shows up as the event loop's
        # own frame here.
        with profile.PySpy(pid, out / f"kvgate-{label}", duration_s=self.plan.profile_s):
            row = self.measure("profile", 0, "kvgate", job, level=rate, profiled=label)
        self._say(row)
        summary = profile.summarize(out / f"kvgate-{label}.txt")
        (out / f"kvgate-{label}-summary.txt").write_text(summary + "\n", encoding="utf-8")
        self.log(summary)
