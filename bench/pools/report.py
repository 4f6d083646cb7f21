"""The pools benchmark's outputs: pools.md (every table of the run), the raw request rows
(pools-requests.csv.gz) and pools.json's values (NaN and infinities as null)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.pools.load import Rec
from bench.pools.plans import AFFINITY_ARMS, BLOCK, COST_ARMS, FAIR_PHASES, REPLICAS, RR, TENANTS_1


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


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 4)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
