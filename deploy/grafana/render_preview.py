"""Render what the kvgate Grafana dashboard shows, from a real run, as one PNG.

Starts the local stack (vLLM simulator + kvgate + the real Envoy, testbed/harness.py),
drives a scripted mixed load for about 30 s (two tenants, a KV-budget squeeze, a tenant over
its TPM limit, bad keys, client disconnects), scrapes kvgate's /metrics and Envoy's
/stats/prometheus every second and
plots the series of the dashboard's panels (deploy/grafana/kvgate-dashboard.json) the way
Grafana computes them: rates over a sliding window, histogram quantiles with Prometheus'
interpolation.

    .venv/bin/python deploy/grafana/render_preview.py            # -> docs/img/dashboard-preview.png
    .venv/bin/python deploy/grafana/render_preview.py --seconds 45 --out /tmp/preview.png

Needs matplotlib (`pip install matplotlib`). Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir  # noqa: E402
from testbed.harness import MetricSamples, SimOptions, Stack  # noqa: E402

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"
DEFAULT_OUT = REPO_ROOT / "docs" / "img" / "dashboard-preview.png"

KEY_A = "sk-preview-team-a"
KEY_B = "sk-preview-team-b"
RATE_WINDOW_S = 4.0  # stands in for Grafana's $__rate_interval at 1 s scrapes

WORDS = [
    "the", "budget", "of", "a", "GPU", "is", "its", "KV", "cache", "and", "every", "token",
    "prompt", "output", "holds", "slot", "until", "request", "ends", "so", "admission",
    "must", "count", "tokens", "not", "requests",
]  # fmt: skip


# --------------------------------------------------------------------------- the stack


def make_stack() -> Stack:
    """Two tenants on one small backend, so a minute of load shows every panel move."""
    model_dir = demo_model_dir()
    return Stack(
        tenants=[
            {"name": "team-a", "api_key": KEY_A, "limits": {"tpm": {"capacity": 60000}}},
            # team-b's TPM bucket is small: its burst runs into 429 tpm_exceeded.
            {
                "name": "team-b",
                "api_key": KEY_B,
                "limits": {"tpm": {"capacity": 9000, "refill_per_s": 150}},
            },
        ],
        models=[
            {
                "name": DEMO_MODEL_NAME,
                "tokenizer": str(model_dir),
                "max_context": 8192,
                "default_max_new_tokens": 512,
                "backend": "vllm-local",
                "pricing": {
                    "input_per_million": "2.50",
                    "cached_input_per_million": "1.25",
                    "output_per_million": "10.00",
                },
            }
        ],
        # 8,000 KV tokens: a handful of large requests fill it (429 kv_budget_exhausted).
        backends=[
            {
                "name": "vllm-local",
                "kv_budget_tokens": 8000,
                "kv_block_size": 16,
                "max_concurrent_requests": 64,
            }
        ],
        sim=SimOptions(num_gpu_blocks=500, block_size=16, ttft_ms=60, itl_ms=12),
    )


# --------------------------------------------------------------------------- load


def prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class LoadStats:
    statuses: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    disconnects: int = 0


async def chat(
    client: httpx.AsyncClient,
    stats: LoadStats,
    key: str,
    *,
    words: int,
    max_tokens: int,
    output_tokens: int,
    stream: bool,
    rng: random.Random,
) -> float:
    """One chat request; returns the Retry-After of a 429 (0 otherwise)."""
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": [{"role": "user", "content": prompt(words, rng)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {key}", "x-sim-output-tokens": str(output_tokens)}
    try:
        if stream:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                async for _ in resp.aiter_bytes():
                    pass
        else:
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
    except httpx.HTTPError:
        stats.statuses[0] += 1
        return 0.0
    stats.statuses[resp.status_code] += 1
    if resp.status_code == 429:
        return float(resp.headers.get("retry-after", "1"))
    return 0.0


async def disconnect_midstream(client: httpx.AsyncClient, stats: LoadStats) -> None:
    """Start a long streamed answer, read its first bytes, hang up."""
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 600,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY_A}", "x-sim-output-tokens": "600"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        async for _ in resp.aiter_bytes():
            break
    stats.disconnects += 1


async def drive_load(base_url: str, seconds: float, seed: int = 7) -> LoadStats:
    """A scripted mix; every loop stops by itself at `seconds`."""
    rng = random.Random(seed)
    stats = LoadStats()
    start = time.monotonic()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    def t() -> float:
        return time.monotonic() - start

    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def steady_a(worker: int) -> None:
            # team-a all along: mid-size prompts, generous max_tokens, shorter answers.
            while t() < seconds:
                await chat(
                    client,
                    stats,
                    KEY_A,
                    words=rng.randint(60, 400),
                    max_tokens=rng.choice((256, 384, 512)),
                    output_tokens=rng.randint(40, 200),
                    stream=worker % 3 != 0,
                    rng=rng,
                )

        async def burst_b() -> None:
            # team-b from 30% to 75% of the run: big prompts and big max_tokens, 8 at a time,
            # honouring Retry-After (capped at 2 s) as OpenAI SDKs do.
            await asyncio.sleep(max(0.0, seconds * 0.3 - t()))
            while t() < seconds * 0.75:
                retry_after = await chat(
                    client,
                    stats,
                    KEY_B,
                    words=rng.randint(600, 1200),
                    max_tokens=1024,
                    output_tokens=rng.randint(100, 300),
                    stream=True,
                    rng=rng,
                )
                await asyncio.sleep(min(retry_after, 2.0) or 0.05)

        async def bad_keys() -> None:
            while t() < seconds:
                try:
                    resp = await client.post(
                        "/v1/chat/completions",
                        json={"model": DEMO_MODEL_NAME, "messages": []},
                        headers={"authorization": "Bearer sk-not-a-key"},
                    )
                    stats.statuses[resp.status_code] += 1
                except httpx.HTTPError:
                    stats.statuses[0] += 1
                await asyncio.sleep(1.5)

        async def disconnects() -> None:
            for at in (0.35, 0.55, 0.8):
                await asyncio.sleep(max(0.0, seconds * at - t()))
                await disconnect_midstream(client, stats)

        await asyncio.gather(
            *(steady_a(i) for i in range(4)),
            *(burst_b() for _ in range(8)),
            bad_keys(),
            disconnects(),
        )
    return stats


# --------------------------------------------------------------------------- scraping


@dataclass
class Scrape:
    t: float
    samples: MetricSamples


class Scraper:
    """GET /metrics (and `extra` pages: Envoy's stats) every `interval` s in a thread until
    stopped; one scrape holds the samples of every page."""

    def __init__(self, url: str, interval: float = 1.0, extra: Iterable[str] = ()) -> None:
        self.url = url
        self.extra = tuple(extra)
        self.interval = interval
        self.scrapes: list[Scrape] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            tick = time.monotonic()
            try:
                texts = []
                for url in (self.url, *self.extra):
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        texts.append(resp.read().decode())
            except OSError as exc:  # a missed scrape is a gap, as in Prometheus
                print(f"scrape failed: {exc!r}", file=sys.stderr)
            else:
                self.scrapes.append(Scrape(tick - self._t0, MetricSamples("\n".join(texts))))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - tick)))

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# --------------------------------------------------------------------------- PromQL-ish helpers

LabelKey = tuple[str, ...]


def grouped(samples: MetricSamples, name: str, by: Iterable[str], **match: str) -> dict:
    """sum by (`by`) (name{match}) for one scrape."""
    by = tuple(by)
    out: dict[LabelKey, float] = defaultdict(float)
    for (sample, labels), value in samples.samples.items():
        if sample != name:
            continue
        lab = dict(labels)
        if any(lab.get(k) != v for k, v in match.items()):
            continue
        out[tuple(lab.get(k, "") for k in by)] += value
    return out


def instant(
    scrapes: list[Scrape], name: str, by: Iterable[str], **match: str
) -> dict[LabelKey, tuple[list[float], list[float]]]:
    """A gauge (summed by `by`) over time: {labels: (times, values)}."""
    series: dict[LabelKey, tuple[list[float], list[float]]] = {}
    for scrape in scrapes:
        for key, value in grouped(scrape.samples, name, by, **match).items():
            times, values = series.setdefault(key, ([], []))
            times.append(scrape.t)
            values.append(value)
    return series


def rate(
    scrapes: list[Scrape], name: str, by: Iterable[str], window: float = RATE_WINDOW_S, **match: str
) -> dict[LabelKey, tuple[list[float], list[float]]]:
    """sum by (`by`) (rate(name{match}[window])) over time (counters only grow here)."""
    by = tuple(by)
    groups = [grouped(s.samples, name, by, **match) for s in scrapes]
    keys = sorted({k for g in groups for k in g})
    series: dict[LabelKey, tuple[list[float], list[float]]] = {}
    for key in keys:
        times, values = [], []
        j = 0
        for i, scrape in enumerate(scrapes):
            while scrapes[j].t < scrape.t - window:
                j += 1
            if i == j:
                continue
            dt = scrape.t - scrapes[j].t
            delta = groups[i].get(key, 0.0) - groups[j].get(key, 0.0)
            times.append(scrape.t)
            values.append(max(0.0, delta) / dt)
        series[key] = (times, values)
    return series


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative bucket counts {le: count}."""
    if not buckets:
        return math.nan
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if bound == bounds[0] and bound <= 0:
                return bound
            width = count - prev_count
            return (
                bound
                if width <= 0
                else prev_bound + (bound - prev_bound) * ((rank - prev_count) / width)
            )
        prev_bound, prev_count = bound, count
    return bounds[-1]


def quantile_series(
    scrapes: list[Scrape], name: str, q: float, window: float = RATE_WINDOW_S, **match: str
) -> tuple[list[float], list[float]]:
    """histogram_quantile(q, sum by (le) (rate(name_bucket{match}[window])))."""
    per_le = rate(scrapes, f"{name}_bucket", ["le"], window, **match)
    times = next(iter(per_le.values()))[0] if per_le else []
    out = []
    for i in range(len(times)):
        buckets = {float(le[0]): vals[1][i] for le, vals in per_le.items()}
        out.append(histogram_quantile(q, buckets))
    return times, out


def last_total(scrapes: list[Scrape], name: str, by: Iterable[str]) -> dict[LabelKey, float]:
    return dict(grouped(scrapes[-1].samples, name, by)) if scrapes else {}


# --------------------------------------------------------------------------- plotting


PanelFn = Callable[[Any, list[Scrape]], None]


def _lines(ax: Any, series: dict, label: Callable[[LabelKey], str], **kw: Any) -> None:
    for key, (times, values) in sorted(series.items()):
        if any(v for v in values):
            ax.plot(times, values, label=label(key), linewidth=1.4, **kw)


def _stacked(ax: Any, series: dict, label: Callable[[LabelKey], str]) -> None:
    items = [(k, v) for k, v in sorted(series.items()) if any(v[1])]
    if not items:
        return
    times = items[0][1][0]
    ax.stackplot(
        times,
        *[v[1][: len(times)] for _, v in items],
        labels=[label(k) for k, _ in items],
        alpha=0.75,
    )


def p_decisions(ax: Any, s: list[Scrape]) -> None:
    _stacked(ax, rate(s, "kvgate_requests_total", ["outcome", "reason"]), " · ".join)
    ax.set_ylabel("req/s")


def p_kv(ax: Any, s: list[Scrape]) -> None:
    _lines(ax, instant(s, "kvgate_kv_tokens_in_flight", ["backend"]), lambda k: f"{k[0]} in flight")
    for key, (times, values) in instant(s, "kvgate_kv_budget_tokens", ["backend"]).items():
        ax.plot(times, values, "--", color="red", label=f"{key[0]} budget", linewidth=1.4)
    ax.set_ylabel("KV tokens")


def p_tokens(ax: Any, s: list[Scrape]) -> None:
    _lines(ax, rate(s, "kvgate_prompt_tokens_total", ["tenant"]), lambda k: f"{k[0]} prompt")
    _lines(
        ax,
        rate(s, "kvgate_output_tokens_total", ["tenant"]),
        lambda k: f"{k[0]} output",
        linestyle="--",
    )
    ax.set_ylabel("tokens/s")


def p_cost(ax: Any, s: list[Scrape]) -> None:
    series = rate(s, "kvgate_cost_usd_total", ["tenant"])
    series = {k: (t, [v * 3600 for v in vals]) for k, (t, vals) in series.items()}
    _stacked(ax, series, lambda k: k[0])
    ax.set_ylabel("USD/h")


def p_remaining_tpm(ax: Any, s: list[Scrape]) -> None:
    _lines(ax, instant(s, "kvgate_tenant_remaining_tokens", ["tenant"]), lambda k: k[0])
    ax.set_ylabel("tokens")


def p_tenant_rejections(ax: Any, s: list[Scrape]) -> None:
    _stacked(ax, rate(s, "kvgate_tenant_rejections_total", ["tenant", "reason"]), " · ".join)
    ax.set_ylabel("req/s")


def p_unused(ax: Any, s: list[Scrape]) -> None:
    unused = rate(s, "kvgate_reserved_unused_tokens_total", [])
    prompt_r = rate(s, "kvgate_prompt_tokens_total", [])
    output_r = rate(s, "kvgate_output_tokens_total", [])
    if not unused:
        return
    times, u = unused[()]
    p = prompt_r.get((), (times, [0.0] * len(times)))[1]
    o = output_r.get((), (times, [0.0] * len(times)))[1]
    ratio = [
        (ui / (ui + pi + oi)) if (ui + pi + oi) > 0 else math.nan
        for ui, pi, oi in zip(u, p, o, strict=False)
    ]
    ax.plot(times, ratio, label="unused / reserved", linewidth=1.4)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")


def p_prompt_error(ax: Any, s: list[Scrape]) -> None:
    cumulative = last_total(s, "kvgate_prompt_count_error_tokens_bucket", ["le"])
    bounds = sorted(cumulative, key=lambda k: float(k[0]))
    counts, prev = [], 0.0
    for bound in bounds:
        counts.append(cumulative[bound] - prev)
        prev = cumulative[bound]
    labels = [f"≤ {b[0]}" for b in bounds]
    ax.barh(labels, counts, color="#73bf69")


def p_latency(ax: Any, s: list[Scrape]) -> None:
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        times, values = quantile_series(s, "kvgate_decision_seconds", q)
        ax.plot(times, [v * 1000 for v in values], label=name, linewidth=1.4)
    ax.set_ylabel("ms")


def p_stream_ends(ax: Any, s: list[Scrape]) -> None:
    _lines(
        ax,
        rate(s, "kvgate_stream_disconnects_total", ["phase"]),
        lambda k: f"disconnect in {k[0]}",
    )
    _lines(
        ax,
        rate(s, "kvgate_settlements_total", ["cause"]),
        lambda k: f"settled: {k[0]}",
        linestyle="--",
    )
    ax.set_ylabel("/s")


def p_in_flight(ax: Any, s: list[Scrape]) -> None:
    _lines(ax, instant(s, "kvgate_requests_in_flight", ["backend"]), lambda k: k[0])
    ax.set_ylabel("requests")


def p_utilization(ax: Any, s: list[Scrape]) -> None:
    # max by (backend) (in flight / budget): one kvgate here, so the max is its own ratio.
    in_flight = instant(s, "kvgate_kv_tokens_in_flight", ["backend"])
    budget = instant(s, "kvgate_kv_budget_tokens", ["backend"])
    for key, (times, values) in sorted(in_flight.items()):
        limits = budget.get(key, ([], []))[1]
        ratio = [v / b if b else math.nan for v, b in zip(values, limits, strict=False)]
        ax.plot(times[: len(ratio)], ratio, label=key[0], linewidth=1.4)
    ax.axhline(0.9, color="red", linestyle="--", linewidth=1.0, label="alert (90%)")
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")


def p_extproc(ax: Any, s: list[Scrape]) -> None:
    # Envoy's counters have no _total in its page; the Python parser adds it (Prometheus does
    # not). Drawn even when flat: zero failures is the news here.
    for name, label in (
        ("envoy_http_ext_proc_streams_failed_total", "streams failed (503)"),
        ("envoy_http_ext_proc_message_timeouts_total", "message timeouts"),
        ("envoy_http_ext_proc_rejected_header_mutations_total", "header mutations rejected"),
    ):
        for times, values in rate(s, name, []).values():
            ax.plot(times, values, label=label, linewidth=1.4)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("/s")


def p_store_up(ax: Any, s: list[Scrape]) -> None:
    for label, how in (("store up", sum), ("replicas", len)):
        times = [scrape.t for scrape in s]
        values = [
            float(how(list(grouped(scrape.samples, "kvgate_store_up", ["pod"]).values())))
            for scrape in s
        ]
        ax.plot(times, values, label=label, linewidth=1.4, linestyle="--" if how is len else "-")
    ax.set_ylim(0, 2)


def p_store_errors(ax: Any, s: list[Scrape]) -> None:
    _lines(ax, rate(s, "kvgate_store_errors_total", ["op"]), lambda k: f"errors: {k[0]}")
    _lines(
        ax,
        rate(s, "kvgate_store_fallback_decisions_total", ["outcome"]),
        lambda k: f"fallback: {k[0]}",
    )
    refused = rate(s, "kvgate_requests_total", [], outcome="rejected", reason="store_unavailable")
    _lines(ax, refused, lambda k: "refused: store_unavailable")
    _lines(ax, rate(s, "kvgate_store_dropped_settlements_total", []), lambda k: "dropped")
    if not ax.get_lines():
        ax.text(0.5, 0.5, "none (memory store)", ha="center", transform=ax.transAxes)
    ax.set_ylabel("/s")


def p_store_pending(ax: Any, s: list[Scrape]) -> None:
    for key, (times, values) in instant(s, "kvgate_store_pending_settlements", ["pod"]).items():
        ax.plot(times, values, label=f"waiting {key[0] or 'kvgate'}", linewidth=1.4)
    _lines(
        ax,
        rate(s, "kvgate_store_reconciled_settlements_total", ["kind"]),
        lambda k: f"delivered late: {k[0]}",
    )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("settlements")


def _no_pool(ax: Any) -> None:
    """The local stack's backend is no pool: these panels stay empty, and say why."""
    if not ax.get_lines() and not ax.collections:
        ax.text(0.5, 0.5, "none (no pool configured)", ha="center", transform=ax.transAxes)


def p_pool_endpoints(ax: Any, s: list[Scrape]) -> None:
    # max by (pool, state): one kvgate here, so its own counts.
    for key, (times, values) in sorted(
        instant(s, "kvgate_pool_endpoints", ["pool", "state"]).items()
    ):
        ax.plot(times, values, label=f"{key[0]} {key[1]}", linewidth=1.4)
    _no_pool(ax)
    ax.set_ylabel("endpoints")


def p_pool_picks(ax: Any, s: list[Scrape]) -> None:
    picks = rate(s, "kvgate_pool_picks_total", ["pool", "endpoint", "affinity"])
    _stacked(ax, picks, lambda k: f"{k[1]} affinity {k[2]}")
    _no_pool(ax)
    ax.set_ylabel("req/s")


def p_queue_length(ax: Any, s: list[Scrape]) -> None:
    waiting = instant(s, "kvgate_queue_length", ["pool", "priority"])
    _stacked(ax, waiting, lambda k: f"{k[0]} priority {k[1]}")
    _no_pool(ax)
    ax.set_ylabel("requests")


def p_queue_wait(ax: Any, s: list[Scrape]) -> None:
    for q in (0.5, 0.99):
        times, values = quantile_series(s, "kvgate_queue_wait_seconds", q)
        if any(not math.isnan(v) for v in values):
            ax.plot(times, values, label=f"p{round(q * 100)}", linewidth=1.4)
    _no_pool(ax)
    ax.set_ylabel("seconds")


def p_queue_drops(ax: Any, s: list[Scrape]) -> None:
    drops = rate(s, "kvgate_queue_drops_total", ["pool", "reason"])
    _lines(ax, drops, lambda k: f"{k[0]} {k[1]}")
    _no_pool(ax)
    ax.set_ylabel("/s")


def _stat(ax: Any, value: float, good: bool) -> None:
    ax.axis("off")
    ax.text(
        0.5,
        0.45,
        f"{value:g}",
        ha="center",
        va="center",
        fontsize=28,
        color="#73bf69" if good else "#ff9830",
        transform=ax.transAxes,
    )


def p_mismatches(ax: Any, s: list[Scrape]) -> None:
    v = sum(last_total(s, "kvgate_prompt_count_mismatches_total", []).values())
    _stat(ax, v, v == 0)


def p_leases(ax: Any, s: list[Scrape]) -> None:
    v = sum(last_total(s, "kvgate_expired_leases_total", []).values())
    _stat(ax, v, v == 0)


def p_internal(ax: Any, s: list[Scrape]) -> None:
    v = sum(last_total(s, "kvgate_internal_errors_total", []).values())
    _stat(ax, v, v == 0)


def p_reloads(ax: Any, s: list[Scrape]) -> None:
    totals = last_total(s, "kvgate_config_reloads_total", ["result"])
    ax.axis("off")
    text = "  ".join(f"{k[0]}: {v:g}" for k, v in sorted(totals.items())) or "none"
    ax.text(0.5, 0.45, text, ha="center", va="center", fontsize=16, transform=ax.transAxes)


# Dashboard panel title -> how to draw it. main() fails if a title is not in the dashboard.
PANELS: dict[str, PanelFn] = {
    "Decisions: admitted vs rejected, by reason": p_decisions,
    "KV tokens in flight vs budget, per backend": p_kv,
    "Tokens/s by tenant (prompt and output)": p_tokens,
    "Cost per hour by tenant": p_cost,
    "Remaining TPM tokens per tenant": p_remaining_tpm,
    "Rejections by tenant and reason": p_tenant_rejections,
    "Reservation unused ratio": p_unused,
    "Prompt count error (kvgate - backend), last range": p_prompt_error,
    "Admission decision latency": p_latency,
    "Stream ends: disconnects and settlements": p_stream_ends,
    "Requests in flight, per backend": p_in_flight,
    "Prompt count mismatches": p_mismatches,
    "Expired leases": p_leases,
    "Internal errors": p_internal,
    "Config reloads": p_reloads,
    "KV utilization per backend (worst replica)": p_utilization,
    "Envoy ext_proc: failed streams and message timeouts": p_extproc,
    "State store: replicas reaching it": p_store_up,
    "State store: errors, fallback decisions, refusals": p_store_errors,
    "State store: settlements waiting, per replica": p_store_pending,
    "Pools: endpoints by state": p_pool_endpoints,
    "Pools: placements per endpoint, by prefix affinity": p_pool_picks,
    "Pools: requests waiting in the queue, by priority": p_queue_length,
    "Pools: queue wait (p50, p99)": p_queue_wait,
    "Pools: requests leaving the queue unserved, by reason": p_queue_drops,
}


def dashboard_panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    return panels


def render(scrapes: list[Scrape], out: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard_panels()
    missing = [p["title"] for p in panels if p["title"] not in PANELS]
    unknown = sorted(set(PANELS) - {p["title"] for p in panels})
    if missing or unknown:
        raise SystemExit(f"dashboard and preview disagree: missing {missing}, unknown {unknown}")

    plt.style.use("dark_background")
    # Grafana's grid is 24 columns; rows of height h are scaled to the figure.
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24, rows * 0.42), dpi=90, facecolor="#111217")
    grid = fig.add_gridspec(
        rows, 24, hspace=1.2, wspace=1.2, left=0.04, right=0.99, top=0.95, bottom=0.02
    )
    fig.suptitle(f"kvgate — dashboard preview ({subtitle})", fontsize=18, x=0.02, ha="left")
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(
            grid[pos["y"] + 1 : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]],
            facecolor="#181b1f",
        )
        ax.set_title(panel["title"], loc="left", fontsize=12, color="#d8d9da")
        ax.tick_params(labelsize=9, colors="#9fa7b3")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        PANELS[panel["title"]](ax, scrapes)
        if panel["type"] == "timeseries":
            ax.set_xlim(0, scrapes[-1].t)
            ax.grid(color="#2c3235", linewidth=0.6)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="upper left", framealpha=0.4, ncol=2)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor=fig.get_facecolor())
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the load")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    with make_stack() as stack:
        envoy_stats = f"{stack.envoy_admin_url}/stats/prometheus"
        with Scraper(stack.kvgate_metrics_url, extra=[envoy_stats]) as scraper:
            time.sleep(2)  # a flat start
            stats = asyncio.run(drive_load(stack.base_url, args.seconds))
            time.sleep(4)  # settle and a flat end
    scrapes = scraper.scrapes
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(stats.statuses.items()))
    print(f"{len(scrapes)} scrapes; responses {statuses}; disconnects {stats.disconnects}")
    render(
        scrapes,
        args.out,
        f"{args.seconds:.0f} s scripted run against the local stack; x axis: seconds",
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
