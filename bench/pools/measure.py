"""What the pools benchmark's readings add up to: kvgate's reserved KV sampled during a run,
metric deltas and histogram quantiles, each part's summary (hit rates, per-pod peaks, waits
and service per tenant, the VTC check, the interleaved arms' latency and CPU)."""

from __future__ import annotations

import contextlib
import math
import re
import threading
import urllib.request
from collections.abc import Sequence
from typing import Any

from bench.interleaved import Sample
from bench.pools.load import Rec
from bench.pools.plans import (
    COST_ARMS,
    POOL,
    REPLICAS,
    SIM_NAMES,
    TENANTS_1,
    AffinityPlan,
    FairnessPlan,
)
from bench.stats import percentile
from testbed.harness import MetricSamples


def ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values if not math.isnan(v)]


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
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    text = resp.read().decode()
                for backend, value in self._LINE.findall(text):
                    v = float(value)
                    if v > self.peak.get(backend, 0.0):
                        self.peak[backend] = v


def delta(before: MetricSamples, after: MetricSamples, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


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


def affinity_summary(runs: list[dict[str, Any]], plan: AffinityPlan, budget: int) -> dict[str, Any]:
    recs: list[Rec] = [r for run in runs for r in run["recs"]]
    wall = sum(run["wall"] for run in runs)
    ok = [r for r in recs if r.ok]
    queries = sum(s["prefix_cache_queries_total"] for run in runs for s in run["stats"].values())
    hits = sum(s["prefix_cache_hits_total"] for run in runs for s in run["stats"].values())
    ttft = ms([r.t_first - r.t_send for r in ok])
    lat = ms([r.t_end - r.t_send for r in ok])
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
            "p50_cache_hit": percentile(ms([r.t_first - r.t_send for r in cached]), 50),
            "p50_cache_miss": percentile(ms([r.t_first - r.t_send for r in uncached]), 50),
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


def fairness_summary(
    run: dict[str, Any], load: dict[str, int], plan: FairnessPlan, budget: int, phase: str
) -> dict[str, Any]:
    """One phase of part 2 from its readings (`scenarios.fair_phase`'s): per tenant the
    attempts, 429s, waits (send to arrival at a simulator) and service; the queue's drops;
    per pod the peaks; the VTC check (queue phases)."""
    recs: list[Rec] = run["recs"]
    before: MetricSamples = run["before"]
    after: MetricSamples = run["after"]
    stats: dict[str, dict[str, Any]] = run["stats"]
    duration = run["duration"]
    epoch_stop = run["epoch_stop"]
    missing = sum(1 for r in recs if r.ok and math.isnan(r.epoch_admitted))

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
        waits = ms([r.wait_s for r in ok])
        later = ms([r.wait_s for r in ok if r.epoch_send >= since])
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
            "kvgate_queue_wait": histogram(before, after, "kvgate_queue_wait_seconds", tenant=t),
            "admitted_per_s": len(window) / duration,
            "tokens_admitted_per_s": tokens / duration,
            "weighted_service_per_s": weighted / duration,
        }
    drops = {
        reason: d
        for reason in ("queue_full", "tenant_queue_full", "wait_expired", "disconnected", "error")
        if (d := delta(before, after, "kvgate_queue_drops_total", reason=reason))
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
        for n, address in run["address"].items()
    ]
    all_waits = [r.wait_s for r in recs if r.ok and not math.isnan(r.epoch_admitted)]
    out: dict[str, Any] = {
        "quiet": run["quiet"],
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
        "cpu": run["cpu"],
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
    return out


def histogram(
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
    count = delta(before, after, f"{name}_count", **labels)
    total = delta(before, after, f"{name}_sum", **labels)
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


def interleaved_stats(samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = {s.step: s.latency_s for s in samples if s.arm == "envoy" and s.ok}
    single = {s.step: s.latency_s for s in samples if s.arm == "kvgate" and s.ok}
    for arm in COST_ARMS:
        mine = [s for s in samples if s.arm == arm]
        ok = [s for s in mine if s.ok]
        lat = ms([s.latency_s for s in ok])
        paired = ms([s.latency_s - ref[s.step] for s in ok if s.step in ref])
        vs_single = ms([s.latency_s - single[s.step] for s in ok if s.step in single])

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
