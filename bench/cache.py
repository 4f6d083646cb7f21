"""A response-cache hit's latency and kvgate CPU against a miss, one request in flight.

    .venv/bin/python -m bench.cache            # 160 steps (~3.5 min)
    .venv/bin/python -m bench.cache --quick    # 30 steps (~1 min)
    .venv/bin/python -m bench.cache --iterations 100 --no-stream --no-semantic --out /tmp/cache

One stack (bench/stack.py): the simulator with small fixed latencies (TTFT 20 ms, 5 ms per
token, 32 output tokens), kvgate with `response_cache: {enabled: true}` and
`semantic_cache: {enabled: true}` (memory store, WordLlama with the strict guard at its default
threshold, Idempotency-Key on as by default) behind its Envoy, and a plain Envoy without
ext_proc in front of the same simulator. The model opts in to the semantic cache; of the two
tenants only "bench-semantic" (the sem-* arms' key) does, so the other arms run as before
with the exact cache alone. The sem-* arms' tenant follows `response_cache.enabled` too: the
exact lookup (a miss) runs before the semantic one, as when both caches are on. ONE request
in flight; every step sends one request of each arm, the arm order rotated at every step
(bench/interleaved.py's method), each arm on its own keep-alive connection:

| arm         | request (chat, ~1k-token prompt, max_tokens 32)                | expected        |
|-------------|----------------------------------------------------------------|-----------------|
| envoy       | unique, temperature 0, plain Envoy (no kvgate): the baseline   | sim +1          |
| miss        | unique, temperature 0: runs on the backend, answer stored      | miss, sim +1    |
| hit         | the miss of two steps before, byte for byte                    | hit, sim 0      |
| bypass      | unique, temperature 0.7: not cacheable, the lookup is skipped  | bypass, sim +1  |
| replay      | the Idempotency-Key (and body) of the previous step's seed     | replayed, sim 0 |
| stream-miss | unique, temperature 0, `stream: true` (32 token events)        | miss, sim +1    |
| stream-hit  | the stream-miss of two steps before                            | hit, sim 0      |
| sem-miss    | ~1k-token system prompt (the same every step), then a unique   | miss, sim +1    |
|             | question "What is the capital of country N?", temperature 0    |                 |
| sem-hit     | "Hello! what is the capital of country N, please?" for the N   | semantic-hit,   |
|             | of the sem-miss of two steps before (the strict guard's kind   | sim 0           |
|             | of paraphrase: greeting, politeness, case, punctuation)        |                 |

N is distinct per step, and no two N have the same digits in another order: WordLlama embeds
a question as the mean of its tokens' vectors and splits numbers into digits, so "country 17"
and "country 71" get the same vector and the source of a paraphrase might not be among the
candidates the guard checks. With digit-sorted numbers (1..9, 11, 12, ..., 19, 22, ...) the
source is the most similar stored question, always. Every other stored question of the same
context is above the threshold too (~0.98: only the number differs), so a sem-miss has the
guard refuse the MAX_CANDIDATES best of them (4) before it misses: the lookup's dearer case,
a near miss on every request.

Before the arms, each step sends one unmeasured "seed": a unique temperature-0.7 request with a
new Idempotency-Key, which the replay arm resends one step later (so the cache plays no part
in the replay: the key is answered from the idempotency store). A request whose status, cache
header, replay header or token count is not the expected one counts as failed and is printed.

Per request: latency from the send to the last byte at the client; the CPU of kvgate and of
the arm's Envoy as the sum of their threads' /proc/<pid>/task/*/schedstat run time from just
before the send until `--pause-ms` after the response (work after the response, e.g. storing
the answer at settlement, is counted); the simulator's `generation_requests_total` delta,
read after each request (hits and replays must be 0). kvgate's CPU during the envoy arm's
requests is its idle background (health checks, timers): the floor of the column. The kvgate
metrics kvgate_response_cache_total, kvgate_semantic_cache_total,
kvgate_semantic_cache_guard_refusals_total and kvgate_idempotent_requests_total are read before
and after the measured steps as a cross-check. Ratios are against the arm's own miss: the
stream arms' is stream-miss, sem-hit's is sem-miss, and sem-miss's is the exact-only miss
(what the semantic lookup adds to a miss).

Writes `cache.md` and `cache.json` (the tables, settings, every request) to `--out` (default
bench/results/caches); the processes' logs stay in var/bench/cache-<date>/stack/logs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import math
import os
import re
import shlex
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.cpu import threads_cpu_seconds
from bench.interleaved import read_answer, rotated
from bench.loadgen import _StreamClock
from bench.prompts import prompt_text
from bench.provenance import git_output
from bench.stack import MODEL, REPO_ROOT, TENANT_RPM, TENANT_TPM, Arm, BenchStack, SimSettings
from bench.stats import percentile
from kvgate.lifecycle.semantic_cache import MAX_CANDIDATES
from testbed.harness import MetricSamples, sha256_hex

TTFT_MS = 20.0
ITL_MS = 5.0
OUT_TOKENS = 32
PROMPT_TOKENS = 1000
LAG = 2  # a hit resends the miss of LAG steps before (stored at its settlement long since)
SAMPLED_TEMPERATURE = 0.7
# The sem-* arms' tenant: the only one that opts in to the semantic cache.
SEMANTIC_TENANT = "bench-semantic"
SEMANTIC_KEY = "sk-bench-semantic"
QUESTION = "What is the capital of country {n}?"
PARAPHRASE = "Hello! what is the capital of country {n}, please?"

ARMS = (
    "envoy",
    "miss",
    "hit",
    "bypass",
    "replay",
    "stream-miss",
    "stream-hit",
    "sem-miss",
    "sem-hit",
)
STREAM_ARMS = ("stream-miss", "stream-hit")
SEMANTIC_ARMS = ("sem-miss", "sem-hit")
HIT_OF = {"hit": "miss", "stream-hit": "stream-miss", "sem-hit": "sem-miss"}
# arm -> the arm it is compared with (its own miss)
BASE = {
    "envoy": "miss",
    "miss": "miss",
    "hit": "miss",
    "bypass": "miss",
    "replay": "miss",
    "stream-miss": "stream-miss",
    "stream-hit": "stream-miss",
    # against the exact-only miss: what the semantic lookup (and indexing) adds to a miss
    "sem-miss": "miss",
    "sem-hit": "sem-miss",
}
# arm -> (x-kvgate-cache, idempotent-replayed, simulator requests) expected
EXPECT: dict[str, tuple[str | None, str | None, int]] = {
    "envoy": (None, None, 1),
    "miss": ("miss", None, 1),
    "hit": ("hit", None, 0),
    "bypass": ("bypass", None, 1),
    "replay": (None, "true", 0),
    "stream-miss": ("miss", None, 1),
    "stream-hit": ("hit", None, 0),
    "sem-miss": ("miss", None, 1),
    "sem-hit": ("semantic-hit", None, 0),
    "seed": ("bypass", None, 1),
}
WHAT = {
    "envoy": "plain Envoy, no kvgate, unique request",
    "miss": "unique, temperature 0: backend, stored",
    "hit": "the same request as an earlier miss",
    "bypass": "unique, temperature 0.7: not cacheable",
    "replay": "Idempotency-Key reused after completion",
    "stream-miss": "unique, temperature 0, stream",
    "stream-hit": "the same stream as an earlier miss",
    "sem-miss": "fixed 1k system prompt, unique question",
    "sem-hit": "a paraphrase of an earlier sem-miss",
}


class CacheStack(BenchStack):
    """bench/stack.py's stack with kvgate's response cache (and Idempotency-Key) on, and the
    semantic cache on for one more tenant only."""

    def kvgate_config(self, store: str, *, key_prefix: str = "") -> dict[str, Any]:
        config = super().kvgate_config(store, key_prefix=key_prefix)
        config["response_cache"] = {"enabled": True}
        config["idempotency"] = {"enabled": True}
        config["semantic_cache"] = {"enabled": True}
        # The model's opt-in serves only tenants that opt in too: "bench" does not.
        for model in config["models"]:
            model["semantic_cache"] = True
        config["tenants"].append(
            {
                "name": SEMANTIC_TENANT,
                "api_key_sha256": sha256_hex(SEMANTIC_KEY),
                "limits": {"rpm": TENANT_RPM, "tpm": TENANT_TPM},
                "semantic_cache": True,
            }
        )
        return config


def _digit_sorted() -> Iterator[int]:
    """1..9, 11..19, 22..29, ...: numbers whose digits never decrease, so no two of them
    have the same digits (WordLlama's mean of digit tokens cannot tell "17" from "71")."""
    for length in itertools.count(1):
        for digits in itertools.combinations_with_replacement("0123456789", length):
            if digits[0] != "0":
                yield int("".join(digits))


def step_number(step: int) -> int:
    """A distinct country number per step (warm-up steps are negative)."""
    index = 2 * step if step >= 0 else -2 * step - 1  # zigzag: every int -> a distinct index
    return next(itertools.islice(_digit_sorted(), index, None))


# --------------------------------------------------------------------------- requests


@dataclass
class Request:
    body: bytes
    stream: bool = False
    key: str | None = None  # Idempotency-Key


@dataclass
class Sample:
    arm: str
    step: int
    latency_s: float = math.nan
    ttft_s: float = math.nan
    status: int = 0
    cache: str = ""
    replayed: str = ""
    tokens: int = 0
    similarity: float = math.nan  # x-kvgate-cache-similarity (semantic hits)
    sim_delta: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> seconds
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class Bodies:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.text = prompt_text(PROMPT_TOKENS)

    def make(self, kind: str, step: int, *, temperature: float, stream: bool) -> bytes:
        # The unique marker leads the message (a unique prefix); the same length in every arm.
        content = f"[{self.run_id} {kind:>6s} {step:+05d}] {self.text}"
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": OUT_TOKENS,
            "temperature": temperature,
        }
        if stream:
            body["stream"] = True
        return json.dumps(body, separators=(",", ":")).encode()

    def request(self, arm: str, step: int) -> Request:
        if arm == "envoy":
            return Request(self.make("envoy", step, temperature=0, stream=False))
        if arm in ("miss", "hit"):
            source = step if arm == "miss" else step - LAG
            return Request(self.make("miss", source, temperature=0, stream=False))
        if arm == "bypass":
            return Request(self.make("bypass", step, temperature=SAMPLED_TEMPERATURE, stream=False))
        if arm in ("seed", "replay"):
            source = step if arm == "seed" else step - 1
            body = self.make("seed", source, temperature=SAMPLED_TEMPERATURE, stream=False)
            return Request(body, key=f"{self.run_id}-{source}")
        if arm in STREAM_ARMS:
            source = step if arm == "stream-miss" else step - LAG
            return Request(self.make("stream", source, temperature=0, stream=True), stream=True)
        if arm in SEMANTIC_ARMS:
            if arm == "sem-miss":
                question = QUESTION.format(n=step_number(step))
            else:
                question = PARAPHRASE.format(n=step_number(step - LAG))
            return Request(self.semantic(question))
        raise ValueError(arm)

    def semantic(self, question: str) -> bytes:
        # Everything but the question is the same every step: one semantic context. kvgate's
        # memory store starts empty every run, so no run id is needed in it.
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": self.text},
                {"role": "user", "content": question},
            ],
            "max_tokens": OUT_TOKENS,
            "temperature": 0,
        }
        return json.dumps(body, separators=(",", ":")).encode()


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1, use_dns_cache=False),
        timeout=aiohttp.ClientTimeout(total=120),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


class Runner:
    def __init__(self, stack: BenchStack, arms: list[str], pause_s: float) -> None:
        self.stack = stack
        self.arms = arms
        self.pause_s = pause_s
        self.kvgate = stack.arms["kvgate"]
        self.kvgate_pid = self.kvgate.pids["kvgate"]
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.sim_total = 0

    def target(self, arm: str) -> Arm:
        return self.stack.arms["envoy"] if arm == "envoy" else self.kvgate

    def cpu(self, target: Arm) -> dict[str, float]:
        return {
            "kvgate": threads_cpu_seconds(self.kvgate_pid),
            "envoy": threads_cpu_seconds(target.pids["envoy"]),
        }

    async def sim_requests(self) -> int:
        url = f"{self.stack.sim.url}/sim/stats"
        async with self.sessions["sim"].get(url) as resp:
            return int((await resp.json())["generation_requests_total"])

    async def open(self) -> None:
        for name in (*self.arms, "seed", "sim"):
            self.sessions[name] = _session()
        self.sim_total = await self.sim_requests()

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()

    async def send(self, arm: str, request: Request, step: int) -> Sample:
        sample = Sample(arm, step)
        target = self.target(arm)
        headers = target.headers(SEMANTIC_KEY if arm in SEMANTIC_ARMS else None)
        if request.key is not None:
            headers["idempotency-key"] = request.key
        clock = _StreamClock() if request.stream else None
        raw = b""
        before = self.cpu(target)
        start = time.perf_counter()
        try:
            async with self.sessions[arm].post(
                target.chat_url, data=request.body, headers=headers
            ) as resp:
                sample.status = resp.status
                sample.cache = resp.headers.get("x-kvgate-cache", "")
                sample.replayed = resp.headers.get("idempotent-replayed", "")
                similarity = resp.headers.get("x-kvgate-cache-similarity")
                if similarity is not None:
                    sample.similarity = float(similarity)
                raw = await read_answer(resp, clock)
            sample.latency_s = time.perf_counter() - start
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(self.pause_s)  # settlement (storing the answer) belongs to it
        after = self.cpu(target)
        sample.cpu_s = {role: after[role] - before[role] for role in after}
        total = await self.sim_requests()
        sample.sim_delta, self.sim_total = total - self.sim_total, total
        if clock is not None:
            sample.tokens = clock.n
            if clock.first is not None:
                sample.ttft_s = clock.first - start
        elif sample.status == 200:
            try:
                usage = json.loads(raw)["usage"]
                sample.tokens = int(usage["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                sample.error = sample.error or f"unreadable answer: {raw[:120]!r}"
        if not sample.error:
            sample.error = self._check(sample, raw)
        return sample

    @staticmethod
    def _check(sample: Sample, raw: bytes) -> str:
        cache, replayed, sim = EXPECT[sample.arm]
        problems = []
        if sample.status != 200:
            problems.append(f"http {sample.status}: {raw[:200].decode(errors='replace')}")
        if cache is not None and sample.cache != cache:
            problems.append(f"x-kvgate-cache {sample.cache or '(none)'} != {cache}")
        if replayed is not None and sample.replayed != replayed:
            problems.append(f"idempotent-replayed {sample.replayed or '(none)'} != {replayed}")
        if sample.sim_delta != sim:
            problems.append(f"simulator requests +{sample.sim_delta} != +{sim}")
        if sample.status == 200 and sample.tokens != OUT_TOKENS:
            problems.append(f"{sample.tokens} of {OUT_TOKENS} tokens")
        if sample.arm == "sem-hit" and math.isnan(sample.similarity):
            problems.append("no x-kvgate-cache-similarity")
        return "; ".join(problems)

    async def run(
        self,
        bodies: Bodies,
        first: int,
        steps: int,
        samples: list[Sample],
        seeds: list[Sample],
        on_measured: Callable[[], None],
    ) -> float:
        """Steps first..steps-1; those < 0 warm up (not kept). Returns the measured wall s."""
        wall0 = time.perf_counter()
        for step in range(first, steps):
            if step == 0:
                on_measured()
                wall0 = time.perf_counter()
            seed = await self.send("seed", bodies.request("seed", step), step)
            if step >= 0:
                seeds.append(seed)
            if seed.error:
                print(f"  FAIL step {step} seed: {seed.error}", flush=True)
            for arm in rotated(self.arms, step):
                needs = 1 if arm == "replay" else LAG if arm in HIT_OF else 0
                if step - needs < first:
                    continue  # what it resends is not there yet (first warm-up steps)
                if arm in HIT_OF and HIT_OF[arm] not in self.arms:
                    continue
                request = bodies.request(arm, step)  # built before the clock starts
                sample = await self.send(arm, request, step)
                if sample.error:
                    print(f"  FAIL step {step} {arm}: {sample.error}", flush=True)
                if step >= 0:
                    samples.append(sample)
        return time.perf_counter() - wall0


# --------------------------------------------------------------------------- statistics


def _ms(values: list[float]) -> list[float]:
    return [v * 1e3 for v in values]


def arm_stats(samples: list[Sample], arm: str) -> dict[str, Any]:
    mine = [s for s in samples if s.arm == arm]
    ok = [s for s in mine if s.ok]
    lat = _ms([s.latency_s for s in ok])
    kv = _ms([s.cpu_s.get("kvgate", math.nan) for s in mine])
    env = _ms([s.cpu_s.get("envoy", math.nan) for s in mine])
    sims = [s.similarity for s in ok if not math.isnan(s.similarity)]
    return {
        "n": len(mine),
        "fail": len(mine) - len(ok),
        "p50_ms": percentile(lat, 50),
        "p90_ms": percentile(lat, 90),
        "p99_ms": percentile(lat, 99),
        "ttft_p50_ms": percentile(_ms([s.ttft_s for s in ok]), 50),
        "similarity_min": min(sims, default=math.nan),
        "similarity_p50": percentile(sims, 50),
        "kvgate_cpu_ms": float(np.mean(kv)) if kv else math.nan,
        "kvgate_cpu_p50_ms": percentile(kv, 50),
        "envoy_cpu_ms": float(np.mean(env)) if env else math.nan,
        "envoy_cpu_p50_ms": percentile(env, 50),
        "sim_requests": sum(s.sim_delta for s in mine),
    }


def paired_ratio(samples: list[Sample], arm: str, base: str) -> float:
    """Median over steps of this arm's latency / its base arm's latency in the same step."""
    ref = {s.step: s.latency_s for s in samples if s.arm == base and s.ok}
    ratios = [s.latency_s / ref[s.step] for s in samples if s.arm == arm and s.ok and s.step in ref]
    return percentile(ratios, 50)


def fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def table(stats: dict[str, dict[str, Any]], samples: list[Sample]) -> str:
    lines = [
        "| arm | request | n | fail | p50 ms | p90 ms | p50 ÷ its miss (paired) "
        "| kvgate CPU ms/req | kvgate CPU ÷ its miss | Envoy CPU ms/req | simulator requests |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, st in stats.items():
        base = stats.get(BASE[arm])
        lat_ratio = st["p50_ms"] / base["p50_ms"] if base else math.nan
        paired = paired_ratio(samples, arm, BASE[arm]) if base else math.nan
        cpu_ratio = st["kvgate_cpu_ms"] / base["kvgate_cpu_ms"] if base else math.nan
        kv = fmt(st["kvgate_cpu_ms"], 3)
        if arm == "envoy":
            kv, cpu_ratio = f"({kv} idle)", math.nan
        p50 = fmt(st["p50_ms"])
        if arm in STREAM_ARMS:
            p50 += f" (TTFT {fmt(st['ttft_p50_ms'])})"
        lines.append(
            f"| {arm} | {WHAT[arm]} | {st['n']} | {st['fail']} | {p50} | {fmt(st['p90_ms'])} "
            f"| {fmt(lat_ratio, 3)} ({fmt(paired, 3)}) | {kv} | {fmt(cpu_ratio, 3)} "
            f"| {fmt(st['envoy_cpu_ms'], 3)} | {st['sim_requests']} |"
        )
    return "\n".join(lines)


def semantic_notes(stats: dict[str, dict[str, Any]]) -> list[str]:
    """What the semantic cache adds to the exact cache's miss and hit, as markdown lines."""
    if not all(a in stats for a in ("miss", "hit", *SEMANTIC_ARMS)):
        return []

    def delta(arm: str, base: str) -> str:
        a, b = stats[arm], stats[base]
        return (
            f"kvgate CPU {a['kvgate_cpu_ms'] - b['kvgate_cpu_ms']:+.3f} ms/req, "
            f"p50 {a['p50_ms'] - b['p50_ms']:+.2f} ms, Envoy CPU "
            f"{a['envoy_cpu_ms'] - b['envoy_cpu_ms']:+.3f} ms/req"
        )

    hit = stats["sem-hit"]
    return [
        f"Semantic arms (`{QUESTION}` then `{PARAPHRASE}` {LAG} steps later, after a "
        f"~{PROMPT_TOKENS:,}-token system prompt that is the same every step): sem-miss - "
        f"miss: {delta('sem-miss', 'miss')} (the semantic lookup, with up to {MAX_CANDIDATES} "
        f"guard refusals, and indexing the answer); sem-hit - hit: {delta('sem-hit', 'hit')}. "
        f"sem-hit similarity: min {fmt(hit['similarity_min'], 4)}, p50 "
        f"{fmt(hit['similarity_p50'], 4)}.\n",
    ]


# --------------------------------------------------------------------------- metrics


def scrape(url: str | None) -> MetricSamples | None:
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return MetricSamples(resp.read().decode())
    except OSError:
        return None


def metric_deltas(before: MetricSamples | None, after: MetricSamples | None) -> dict[str, float]:
    if before is None or after is None:
        return {}
    out: dict[str, float] = {}
    for name, label, values in (
        ("kvgate_response_cache_total", "result", ("hit", "miss", "bypass")),
        (
            "kvgate_semantic_cache_total",
            "result",
            ("semantic-hit", "miss", "bypass", "unavailable"),
        ),
        ("kvgate_idempotent_requests_total", "result", ("started", "replayed")),
    ):
        for value in values:
            key = f"{name}{{{label}={value}}}"
            out[key] = after.total(name, **{label: value}) - before.total(name, **{label: value})
    name = "kvgate_semantic_cache_guard_refusals_total"
    out[name] = after.total(name) - before.total(name)
    return out


def expected_counters(
    stats: dict[str, dict[str, Any]], seeds: int, samples: list[Sample], first: int
) -> dict[str, int]:
    def n(*arms: str) -> int:
        return sum(stats[a]["n"] for a in arms if a in stats)

    # A sem-miss at step s meets the s - first questions stored before it, all above the
    # threshold (only the number differs); the guard checks the best MAX_CANDIDATES and
    # refuses them. A sem-hit's source is its best candidate: no refusal.
    refusals = sum(min(MAX_CANDIDATES, s.step - first) for s in samples if s.arm == "sem-miss")

    return {
        "kvgate_response_cache_total{result=hit}": n("hit", "stream-hit"),
        # the sem-* arms' exact lookup runs first and misses (a paraphrase is another body)
        "kvgate_response_cache_total{result=miss}": n("miss", "stream-miss", *SEMANTIC_ARMS),
        "kvgate_response_cache_total{result=bypass}": n("bypass") + seeds,
        "kvgate_semantic_cache_total{result=semantic-hit}": n("sem-hit"),
        "kvgate_semantic_cache_total{result=miss}": n("sem-miss"),
        "kvgate_semantic_cache_guard_refusals_total": refusals,
        "kvgate_idempotent_requests_total{result=started}": seeds,
        "kvgate_idempotent_requests_total{result=replayed}": n("replay"),
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps instead of 160")
    parser.add_argument("--iterations", type=int, default=None, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded steps (after priming)")
    parser.add_argument("--no-stream", action="store_true", help="without the stream arms")
    parser.add_argument("--no-envoy", action="store_true", help="without the plain-Envoy arm")
    parser.add_argument("--no-semantic", action="store_true", help="without the sem-* arms")
    parser.add_argument("--pause-ms", type=float, default=2.0, help="after each response")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "caches")
    args = parser.parse_args(argv)
    steps = args.iterations or (30 if args.quick else 160)
    arms = [
        a
        for a in ARMS
        if not (args.no_stream and a in STREAM_ARMS)
        and not (args.no_envoy and a == "envoy")
        and not (args.no_semantic and a in SEMANTIC_ARMS)
    ]
    first = -(args.warmup + LAG)

    # The code kvgate runs is the tree at its start (others may commit during the run).
    commit = git_output("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted src/ changes" if git_output("status", "--porcelain", "src") else ""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    work = REPO_ROOT / "var" / "bench" / f"cache-{stamp}"
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "-m", "bench.cache", *given])
    stack = CacheStack(
        work / "stack",
        arms=("envoy", "kvgate") if "envoy" in arms else ("kvgate",),
        sim=SimSettings(ttft_ms=TTFT_MS, itl_ms=ITL_MS),
    )
    bodies = Bodies(f"{os.getpid():x}{int(time.time()) % 100000:x}")
    samples: list[Sample] = []
    seeds: list[Sample] = []
    metrics: dict[str, MetricSamples | None] = {}
    wall = 0.0
    started = time.time()
    try:
        print(f"starting the stack in {work / 'stack'} ...", flush=True)
        stack.start()
        for line in stack.describe():
            print("  " + line, flush=True)
        stack.quiesce(timeout=15.0)
        url = stack.kvgate_metrics_url("kvgate")
        print(f"[{time.time() - started:.0f}s] {steps} steps (+{-first} warm-up) x {arms}")

        def measured() -> None:
            metrics["before"] = scrape(url)

        async def go() -> float:
            runner = Runner(stack, arms, args.pause_ms / 1e3)
            await runner.open()
            try:
                return await runner.run(bodies, first, steps, samples, seeds, measured)
            finally:
                await runner.close()

        try:
            import uvloop

            wall = uvloop.run(go())
        except ImportError:
            wall = asyncio.run(go())
        metrics["after"] = scrape(url)
        print(f"  {len(samples)} requests in {wall:.1f}s", flush=True)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    finally:
        stack.stop()

    stats = {a: arm_stats(samples, a) for a in arms}
    seed_stats = arm_stats(seeds, "seed")
    deltas = metric_deltas(metrics.get("before"), metrics.get("after"))
    when = dt.datetime.now().isoformat(timespec="seconds")
    expected = expected_counters(stats, seed_stats["n"], samples, first)
    checks = (
        ", ".join(f"`{k}` +{v:g} (expected {expected.get(k, 0)})" for k, v in deltas.items())
        or "not read"
    )
    md = "\n".join(
        [
            "# A response-cache hit against a miss (kvgate CPU and latency)\n",
            f"`{command}`\n",
            f"{when}; commit {commit}{dirty}; {os.cpu_count()} CPUs; {steps} steps "
            f"({len(samples)} measured requests in {wall:.0f} s, {time.time() - started:.0f} s "
            "in all).\n",
            f"Simulator: TTFT {TTFT_MS:g} ms, {ITL_MS:g} ms per token, {OUT_TOKENS} output "
            f"tokens; ~{PROMPT_TOKENS:,}-token prompts. kvgate: `response_cache: {{enabled: "
            "true}` (memory, scope tenant, hit_charge free), Idempotency-Key on, "
            "`semantic_cache: {enabled: true}` (WordLlama 256, guard strict, threshold 0.71 "
            f"by default) for the sem-* arms' tenant `{SEMANTIC_TENANT}` only (and the model); "
            "that tenant's requests go through the exact lookup first. One request "
            "in flight, arms interleaved request by request (order rotated every step), one "
            "keep-alive connection per arm. Latency: send to last byte at the client. CPU: "
            "schedstat run time of the process's threads from the send until "
            f"{args.pause_ms:g} ms after the response, mean per request. Simulator requests: "
            "the simulator's generation_requests_total delta over the arm's requests. "
            "Ratios against the arm's own miss (stream arms against stream-miss, sem-hit "
            "against sem-miss, sem-miss against the exact-only miss); paired: "
            "the median of per-step ratios. kvgate CPU in the envoy row is its idle "
            "background while plain Envoy served the request.\n",
            table(stats, samples),
            "",
            *semantic_notes(stats),
            f"Seeds (unmeasured, a unique temperature-0.7 request with a new Idempotency-Key "
            f"that the replay arm resends a step later): {seed_stats['n']}, "
            f"{seed_stats['fail']} failed, p50 {fmt(seed_stats['p50_ms'])} ms, kvgate CPU "
            f"{fmt(seed_stats['kvgate_cpu_ms'], 3)} ms/req, simulator requests "
            f"{seed_stats['sim_requests']}.\n",
            f"kvgate's counters over the measured steps: {checks}.\n",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.md").write_text(md, encoding="utf-8")
    result = {
        "command": command,
        "date": when,
        "commit": commit + dirty,
        "cpus": os.cpu_count(),
        "steps": steps,
        "wall_s": round(wall, 1),
        "settings": {
            "ttft_ms": TTFT_MS,
            "itl_ms": ITL_MS,
            "output_tokens": OUT_TOKENS,
            "prompt_tokens": PROMPT_TOKENS,
            "hit_lag_steps": LAG,
            "pause_ms": args.pause_ms,
            "response_cache": {"enabled": True},
            "semantic_cache": {"enabled": True, "tenant": SEMANTIC_TENANT},
            "semantic_question": QUESTION,
            "semantic_paraphrase": PARAPHRASE,
        },
        "arms": {a: {"request": WHAT[a], **_clean(st)} for a, st in stats.items()},
        "seed": _clean(seed_stats),
        "kvgate_metric_deltas": deltas,
        "columns": [
            "arm",
            "step",
            "latency_ms",
            "kvgate_cpu_ms",
            "envoy_cpu_ms",
            "sim_delta",
            "similarity",
        ],
        "requests": [
            [
                s.arm,
                s.step,
                round(s.latency_s * 1e3, 3) if s.ok else None,
                round(s.cpu_s.get("kvgate", 0.0) * 1e3, 4),
                round(s.cpu_s.get("envoy", 0.0) * 1e3, 4),
                s.sim_delta,
                None if math.isnan(s.similarity) else s.similarity,
            ]
            for s in samples
        ],
        "failures": [f"{s.arm} step {s.step}: {s.error}" for s in [*samples, *seeds] if s.error],
    }
    (args.out / "cache.json").write_text(dump_json(result), encoding="utf-8")
    print(md)
    print(f"results in {args.out}; logs in {work / 'stack' / 'logs'}")
    return 0


def dump_json(data: Any) -> str:
    """Indented, with every innermost list (a request's row) on one line."""
    text = json.dumps(data, indent=1)
    # Only whitespace between tokens holds a newline (a JSON string cannot), so this keeps
    # the JSON as it was.
    return (
        re.sub(
            r"\[\s+([^\[\]{}]*?)\s+\]",
            lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]",
            text,
        )
        + "\n"
    )


def _clean(st: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else round(v, 4))
        if isinstance(v, float)
        else v
        for k, v in st.items()
    }


if __name__ == "__main__":
    raise SystemExit(main())
