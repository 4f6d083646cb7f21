"""From run rows to CSV, summary tables, targets and plots.

    python -m bench.report [--results bench/results] [--img docs/img]

re-reads `runs.csv` and regenerates `summary.csv`, `targets.csv`, `summary.md` and the PNG
plots, so tables and figures can be rebuilt without rerunning the load.

"Added" numbers are paired by round: in round r, arm X's percentile minus plain Envoy's
percentile at the same load (or prompt size, or stream rate) in the same round; the table
shows the median over rounds and, in brackets, the lowest and highest round.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.stack import ARM_ORDER
from bench.stats import Spread

REFERENCE = "envoy"
COLORS = {
    "direct": "#7f7f7f",
    "envoy": "#1f77b4",
    "noop": "#9467bd",
    "kvgate": "#2ca02c",
    "kvgate-redis": "#17becf",
    "kvgate-redis-2": "#8c564b",
    "kvgate-split": "#bcbd22",
    "litellm": "#d62728",
}

Row = dict[str, Any]


# --------------------------------------------------------------------------- CSV


def write_rows(path: Path, rows: Sequence[Row]) -> None:
    keys: list[str] = []
    for row in rows:
        for key in row:
            if key not in keys:
                keys.append(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt_cell(row.get(k)) for k in keys})


def _fmt_cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def read_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    with path.open(newline="", encoding="utf-8") as fh:
        for raw in csv.DictReader(fh):
            row: Row = {}
            for key, value in raw.items():
                if value is None or value == "":
                    row[key] = math.nan
                    continue
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = {"True": True, "False": False}.get(value, value)
            for key in ("round",):
                if isinstance(row.get(key), float) and not math.isnan(row[key]):
                    row[key] = int(row[key])
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- aggregation


def _num(row: Row, key: str) -> float:
    value = row.get(key, math.nan)
    return float(value) if isinstance(value, (int, float)) else math.nan


def arms_in(rows: Iterable[Row]) -> list[str]:
    present = {r["arm"] for r in rows}
    return [a for a in ARM_ORDER if a in present] + sorted(present - set(ARM_ORDER))


def by_key(rows: Iterable[Row], experiment: str, key: str) -> dict[tuple[Any, str], list[Row]]:
    """(key value, arm) -> rows of one experiment."""
    out: dict[tuple[Any, str], list[Row]] = defaultdict(list)
    for row in rows:
        if row.get("experiment") == experiment:
            out[(row.get(key), row["arm"])].append(row)
    return out


def spread(rows: Sequence[Row], metric: str) -> Spread:
    return Spread.of(_num(r, metric) for r in rows)


def added(
    rows: Sequence[Row], experiment: str, key: str, metric: str
) -> dict[tuple[Any, str], Spread]:
    """Per (key, arm): metric minus the reference arm's, paired by round."""
    ref: dict[tuple[Any, int], float] = {}
    for row in rows:
        if row.get("experiment") == experiment and row["arm"] == REFERENCE:
            ref[(row.get(key), row["round"])] = _num(row, metric)
    diffs: dict[tuple[Any, str], list[float]] = defaultdict(list)
    for row in rows:
        if row.get("experiment") != experiment:
            continue
        base = ref.get((row.get(key), row["round"]))
        if base is not None:
            diffs[(row.get(key), row["arm"])].append(_num(row, metric) - base)
    return {k: Spread.of(v) for k, v in diffs.items()}


def peak_per_arm(rows: Sequence[Row]) -> dict[str, Spread]:
    best: dict[tuple[str, int], float] = {}
    for row in rows:
        if row.get("experiment") == "peak":
            k = (row["arm"], row["round"])
            best[k] = max(best.get(k, 0.0), _num(row, "achieved_rps"))
    per_arm: dict[str, list[float]] = defaultdict(list)
    for (arm, _r), value in best.items():
        per_arm[arm].append(value)
    return {arm: Spread.of(v) for arm, v in per_arm.items()}


def sustainable(rows: Sequence[Row]) -> dict[str, Row]:
    return {r["arm"]: r for r in rows if r.get("experiment") == "sustain_result"}


def _rate_cell(value: float, lowest: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value <= 0:
        return f"< {lowest:.0f}" if lowest and not math.isnan(lowest) else "0"
    return f"{value:.0f}"


# --------------------------------------------------------------------------- tables


def _table(header: Sequence[str], body: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def summary_tables(rows: Sequence[Row], meta: dict[str, Any]) -> tuple[str, list[Row], list[Row]]:
    """Markdown tables, summary rows (CSV) and target rows (CSV)."""
    arms = arms_in(r for r in rows if r.get("experiment") in ("baseline", "load", "peak"))
    md: list[str] = []
    summary: list[Row] = []

    # baseline
    base = by_key(rows, "baseline", "level")
    if base:
        md.append("### Unloaded latency (1 request in flight, 1k-token prompt), ms\n")
        add50 = added(rows, "baseline", "level", "lat_p50")
        add99 = added(rows, "baseline", "level", "lat_p99")
        body = []
        for arm in arms:
            rs = base.get((0.0, arm), [])
            if not rs:
                continue
            p50, p99 = spread(rs, "lat_p50"), spread(rs, "lat_p99")
            a50 = add50.get((0.0, arm), Spread.of([]))
            a99 = add99.get((0.0, arm), Spread.of([]))
            body.append([arm, p50.fmt(), p99.fmt(), a50.fmt(), a99.fmt()])
            summary.append(
                {
                    "table": "baseline",
                    "arm": arm,
                    "p50_ms": p50.median,
                    "p99_ms": p99.median,
                    "added_p50_ms": a50.median,
                    "added_p99_ms": a99.median,
                }
            )
        md.append(_table(["arm", "p50", "p99", "added p50 vs Envoy", "added p99 vs Envoy"], body))

    # peak and sustainable
    peaks = peak_per_arm(rows)
    sus = sustainable(rows)
    if peaks:
        md.append("\n### Throughput (1k-token prompt, 16 output tokens), requests/s\n")
        body = []
        for arm in arms_in(r for r in rows if r.get("experiment") == "peak"):
            entry = sus.get(arm, {})
            strict = _num(entry, "achieved_rps") if entry else math.nan
            slo = _num(entry, "slo_rps") if entry else math.nan
            lowest = _num(entry, "lowest_tried_rps") if entry else math.nan
            body.append(
                [arm, peaks[arm].fmt(0), _rate_cell(strict, lowest), _rate_cell(slo, lowest)]
            )
            summary.append(
                {
                    "table": "throughput",
                    "arm": arm,
                    "peak_rps": peaks[arm].median,
                    "sustainable_rps": strict,
                    "slo_rps": slo,
                    "lowest_tried_rps": lowest,
                }
            )
        header = ["arm", "closed-loop peak (wrk), 2xx/s", "max sustainable: p99 < 2x unloaded"]
        md.append(_table([*header, "max sustainable: p99 < 50 ms"], body))
        md.append(
            "\nMax sustainable: the highest open-loop Poisson rate tried (fractions of the arm's "
            "own closed-loop peak) with no error and p99 under the limit; `< N`: even the lowest "
            "rate tried, N, missed it."
        )

    # load levels
    load = by_key(rows, "load", "level")
    if load:
        levels = sorted({k[0] for k in load})
        a50 = added(rows, "load", "level", "lat_p50")
        a99 = added(rows, "load", "level", "lat_p99")
        md.append(
            f"\n### Latency under open-loop load (fraction of plain Envoy's peak = "
            f"{meta.get('reference_peak_rps', 0):.0f} rps), ms, from the intended send time\n"
        )
        body = []
        for level in levels:
            for arm in arms:
                rs = load.get((level, arm), [])
                if not rs:
                    continue
                p50, p99 = spread(rs, "lat_p50"), spread(rs, "lat_p99")
                x50 = a50.get((level, arm), Spread.of([]))
                x99 = a99.get((level, arm), Spread.of([]))
                err = sum(_num(r, "errors") for r in rs)
                rps = spread(rs, "achieved_rps")
                over = any(r.get("overloaded") is True for r in rs)
                body.append(
                    [
                        f"{level:.0%}",
                        f"{arm} (over its peak: 1 round, 3 s)" if over else arm,
                        f"{rps.median:.0f}",
                        p50.fmt(),
                        p99.fmt(),
                        x50.fmt(),
                        x99.fmt(),
                        f"{err:.0f}",
                    ]
                )
                summary.append(
                    {
                        "table": "load",
                        "level": level,
                        "arm": arm,
                        "rps": rps.median,
                        "p50_ms": p50.median,
                        "p99_ms": p99.median,
                        "added_p50_ms": x50.median,
                        "added_p99_ms": x99.median,
                        "added_p50_lo": x50.low,
                        "added_p50_hi": x50.high,
                        "added_p99_lo": x99.low,
                        "added_p99_hi": x99.high,
                        "errors": err,
                    }
                )
        md.append(
            _table(
                ["load", "arm", "ok rps", "p50", "p99", "added p50", "added p99", "errors"], body
            )
        )

        # CPU per 1000 requests at 50 % (or the middle level)
        mid = min(levels, key=lambda x: abs(x - 0.5))
        roles = ("envoy", "kvgate", "extproc", "redis", "litellm", "sim", "loadgen")
        md.append(f"\n### CPU seconds per 1,000 requests at {mid:.0%} load (per process)\n")
        body = []
        for arm in arms:
            rs = load.get((mid, arm), [])
            if not rs:
                continue
            cells = [arm]
            entry: Row = {"table": "cpu", "level": mid, "arm": arm}
            for role in roles:
                s = spread(rs, f"cpu_{role}_ms_per_req")
                cells.append(s.fmt(2) if s.n else "")
                entry[f"{role}_cpu_s_per_1000"] = s.median
            body.append(cells)
            summary.append(entry)
        md.append(
            _table(
                [
                    "arm",
                    "Envoy",
                    "kvgate",
                    "no-op ext_proc",
                    "redis-server",
                    "LiteLLM",
                    "simulator",
                    "generator",
                ],
                body,
            )
        )

    # decision time
    dec_rows = [
        r
        for r in rows
        if r.get("experiment") in ("baseline", "load")
        and not math.isnan(_num(r, "decision_admitted_mean_ms"))
    ]
    if dec_rows:
        md.append("\n### kvgate decision time (body arrival -> admission reply), mean ms\n")
        body = []
        for exp, level in [("baseline", 0.0)] + [
            ("load", lv)
            for lv in sorted({_num(r, "level") for r in dec_rows if r["experiment"] == "load"})
        ]:
            for arm in ("kvgate", "kvgate-redis"):
                rs = [
                    r
                    for r in dec_rows
                    if r["experiment"] == exp and r["arm"] == arm and _num(r, "level") == level
                ]
                if rs:
                    s = spread(rs, "decision_admitted_mean_ms")
                    body.append([exp if exp == "baseline" else f"load {level:.0%}", arm, s.fmt(3)])
                    summary.append(
                        {
                            "table": "decision",
                            "experiment": exp,
                            "level": level,
                            "arm": arm,
                            "decision_mean_ms": s.median,
                        }
                    )
        md.append(_table(["run", "arm", "mean decision ms"], body))

    # reject vs admit
    rej = [r for r in rows if r.get("experiment") == "reject"]
    if rej:
        md.append(
            "\n### A 429 versus an admit (same open-loop rate, kvgate CPU per request)\n\n"
            "`429, empty bucket`: the tenant's TPM bucket holds less than any request could "
            "need; `429, short bucket`: it holds ~80 tokens, so only the exact count refuses "
            "the 1k-token request.\n"
        )
        body = []
        for arm in arms_in(rej):
            per_round: dict[int, dict[str, float]] = defaultdict(dict)
            for r in rej:
                if r["arm"] == arm:
                    per_round[r["round"]][str(r["outcome"])] = _num(r, "cpu_kvgate_ms_per_req")
            admit = Spread.of(v.get("admit", math.nan) for v in per_round.values())
            entry: Row = {"table": "reject", "arm": arm, "admit_cpu_ms": admit.median}
            for outcome, label in (
                ("reject", "429, empty bucket"),
                ("reject-short", "429, short bucket"),
            ):
                cpu = Spread.of(v.get(outcome, math.nan) for v in per_round.values())
                if not cpu.n:
                    continue
                ratio = Spread.of(
                    v[outcome] / v["admit"]
                    for v in per_round.values()
                    if v.get("admit") and outcome in v
                )
                lat = spread(
                    [r for r in rej if r["arm"] == arm and r["outcome"] == outcome], "lat_p50"
                )
                lat_admit = spread(
                    [r for r in rej if r["arm"] == arm and r["outcome"] == "admit"], "lat_p50"
                )
                body.append(
                    [arm, label, admit.fmt(3), cpu.fmt(3), ratio.fmt(2), lat_admit.fmt(), lat.fmt()]
                )
                suffix = "" if outcome == "reject" else "_short"
                entry[f"reject{suffix}_cpu_ms"] = cpu.median
                entry[f"ratio{suffix}"] = ratio.median
            summary.append(entry)
        md.append(
            _table(
                [
                    "arm",
                    "answer",
                    "admit CPU ms",
                    "429 CPU ms",
                    "429/admit",
                    "admit p50 ms",
                    "429 p50 ms",
                ],
                body,
            )
        )

    # prompt sizes
    size = by_key(rows, "size", "prompt_size")
    if size:
        sizes = sorted({k[0] for k in size})
        a50 = added(rows, "size", "prompt_size", "lat_p50")
        a99 = added(rows, "size", "prompt_size", "lat_p99")
        md.append("\n### Prompt size (1 request in flight), ms\n")
        body = []
        for s_ in sizes:
            for arm in arms:
                rs = size.get((s_, arm), [])
                if not rs:
                    continue
                p50, p99 = spread(rs, "lat_p50"), spread(rs, "lat_p99")
                x50 = a50.get((s_, arm), Spread.of([]))
                x99 = a99.get((s_, arm), Spread.of([]))
                toks = _num(rs[0], "prompt_tokens")
                body.append([f"{toks:.0f}", arm, p50.fmt(), p99.fmt(), x50.fmt(), x99.fmt()])
                summary.append(
                    {
                        "table": "size",
                        "prompt_tokens": toks,
                        "arm": arm,
                        "p50_ms": p50.median,
                        "p99_ms": p99.median,
                        "added_p50_ms": x50.median,
                        "added_p99_ms": x99.median,
                    }
                )
        md.append(_table(["prompt tokens", "arm", "p50", "p99", "added p50", "added p99"], body))

    # streams
    stream = by_key(rows, "stream", "level")
    if stream:
        rates = sorted({k[0] for k in stream})
        s_arms = arms_in(r for r in rows if r.get("experiment") == "stream")
        metrics = {
            m: added(rows, "stream", "level", m)
            for m in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_p999")
        }
        md.append(
            f"\n### Streamed responses ({meta.get('stream_tokens', '?')} tokens, simulator at "
            f"{meta.get('stream_itl_ms', '?')} ms/token), ms\n"
        )
        body = []
        for rate in rates:
            for arm in s_arms:
                rs = stream.get((rate, arm), [])
                if not rs:
                    continue
                cells = [
                    f"{rate:.0f}",
                    arm,
                    spread(rs, "ttft_p50").fmt(),
                    spread(rs, "itl_p50").fmt(),
                    spread(rs, "itl_p99").fmt(),
                ]
                entry: Row = {
                    "table": "stream",
                    "rate": rate,
                    "arm": arm,
                    "ttft_p50_ms": spread(rs, "ttft_p50").median,
                    "itl_p50_ms": spread(rs, "itl_p50").median,
                    "itl_p99_ms": spread(rs, "itl_p99").median,
                }
                for m in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                    s = metrics[m].get((rate, arm), Spread.of([]))
                    cells.append(s.fmt(3))
                    entry[f"added_{m}_ms"] = s.median
                    entry[f"added_{m}_lo"] = s.low
                    entry[f"added_{m}_hi"] = s.high
                cells.append(f"{sum(_num(r, 'errors') for r in rs):.0f}")
                body.append(cells)
                summary.append(entry)
        md.append(
            _table(
                [
                    "rps",
                    "arm",
                    "TTFT p50",
                    "gap p50",
                    "gap p99",
                    "added TTFT p50",
                    "added TTFT p99",
                    "added gap p50",
                    "added gap p99",
                    "errors",
                ],
                body,
            )
        )

    targets = target_rows(summary)
    if targets:
        md.append("\n### Performance targets\n")
        md.append(
            _table(
                ["target", "measured", "goal", "met", "by"],
                [
                    [
                        t["target"],
                        t["measured"],
                        t["goal"],
                        "yes" if t["met"] else "**no**",
                        t["margin"],
                    ]
                    for t in targets
                ],
            )
        )
    return "\n".join(md) + "\n", summary, targets


def _pick(summary: Sequence[Row], table: str, **where: Any) -> Row | None:
    for row in summary:
        if row.get("table") == table and all(row.get(k) == v for k, v in where.items()):
            return row
    return None


def target_rows(summary: Sequence[Row]) -> list[Row]:
    out: list[Row] = []

    def add(
        name: str,
        value: float,
        goal: float,
        unit: str,
        *,
        at_most: bool = True,
        fmt: str = "{:.2f}",
    ) -> None:
        if value is None or math.isnan(value):
            return
        met = value <= goal if at_most else value >= goal
        if at_most:
            margin = (
                f"{fmt.format(goal - value)} {unit} under"
                if met
                else f"{fmt.format(value - goal)} {unit} over ({value / goal:.1f}x the goal)"
                if goal
                else "-"
            )
        else:
            margin = f"{value / goal:.2f}x the goal" if goal else "-"
        out.append(
            {
                "target": name,
                "measured": f"{fmt.format(value)} {unit}",
                "goal": f"{'<=' if at_most else '>='} {fmt.format(goal)} {unit}",
                "met": met,
                "margin": margin,
                "value": value,
                "goal_value": goal,
            }
        )

    mid = _pick(summary, "load", level=0.5, arm="kvgate")
    if mid is not None:
        add("added p50 over plain Envoy at 50 % load (kvgate)", mid["added_p50_ms"], 1.0, "ms")
        add("added p99 over plain Envoy at 50 % load (kvgate)", mid["added_p99_ms"], 3.0, "ms")
    streams = [r for r in summary if r.get("table") == "stream" and r["arm"] == "kvgate"]
    for row in sorted(streams, key=lambda r: r["rate"]):
        add(
            f"added inter-token gap p99, default config, {row['rate']:.0f} streams/s",
            row["added_itl_p99_ms"],
            0.3,
            "ms",
            fmt="{:.3f}",
        )
    kv = _pick(summary, "throughput", arm="kvgate")
    ll = _pick(summary, "throughput", arm="litellm")
    if kv is not None and ll is not None and ll["peak_rps"]:
        add(
            "peak admitted RPS, kvgate / LiteLLM",
            kv["peak_rps"] / ll["peak_rps"],
            5.0,
            "x",
            at_most=False,
        )
    ll_mid = _pick(summary, "load", level=0.5, arm="litellm")
    if mid is not None and ll_mid is not None and ll_mid["added_p99_ms"]:
        add(
            "added p99 at 50 % load, kvgate / LiteLLM",
            mid["added_p99_ms"] / ll_mid["added_p99_ms"],
            0.1,
            "x",
            fmt="{:.3f}",
        )
    kv_base = _pick(summary, "baseline", arm="kvgate")
    ll_base = _pick(summary, "baseline", arm="litellm")
    if kv_base is not None and ll_base is not None and ll_base["added_p99_ms"]:
        add(
            "added p99 unloaded, kvgate / LiteLLM",
            kv_base["added_p99_ms"] / ll_base["added_p99_ms"],
            0.1,
            "x",
            fmt="{:.3f}",
        )
    rej = _pick(summary, "reject", arm="kvgate")
    if rej is not None:
        add(
            "kvgate CPU of a 429 / of an admit (empty bucket)",
            rej.get("ratio", math.nan),
            1 / 3,
            "x",
            fmt="{:.2f}",
        )
        add(
            "kvgate CPU of a 429 / of an admit (short bucket)",
            rej.get("ratio_short", math.nan),
            1 / 3,
            "x",
            fmt="{:.2f}",
        )
    red_base = _pick(summary, "baseline", arm="kvgate-redis")
    if kv_base is not None and red_base is not None:
        add(
            "Redis store, added p50 per request (unloaded, vs memory store)",
            red_base["p50_ms"] - kv_base["p50_ms"],
            0.3,
            "ms",
            fmt="{:.3f}",
        )
    red_dec = _pick(summary, "decision", experiment="baseline", arm="kvgate-redis")
    mem_dec = _pick(summary, "decision", experiment="baseline", arm="kvgate")
    if red_dec is not None and mem_dec is not None:
        add(
            "Redis store, added mean decision time (unloaded, vs memory store)",
            red_dec["decision_mean_ms"] - mem_dec["decision_mean_ms"],
            0.3,
            "ms",
            fmt="{:.3f}",
        )
    return out


# --------------------------------------------------------------------------- plots


def plots(rows: Sequence[Row], summary: Sequence[Row], img_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = img_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    load = [r for r in summary if r.get("table") == "load"]
    if load:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, metric, title in ((axes[0], "p50_ms", "p50"), (axes[1], "p99_ms", "p99")):
            for arm in arms_in(load):
                pts = sorted((r["level"], r[metric]) for r in load if r["arm"] == arm)
                ax.plot(
                    [p[0] * 100 for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=arm,
                    color=COLORS.get(arm),
                )
            ax.set_yscale("log")
            ax.set_xlabel("offered load, % of plain Envoy's peak")
            ax.set_ylabel(f"latency {title}, ms (log)")
            ax.set_title(f"{title} latency from intended send time, 1k-token prompt")
            ax.grid(True, which="both", alpha=0.3)
        axes[1].legend(fontsize=8)
        save(fig, "bench-load-latency.png")

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        levels = sorted({r["level"] for r in load})
        shown = [a for a in arms_in(load) if a not in ("envoy", "direct")]
        width = 0.8 / max(1, len(shown))
        for ax, metric, title in (
            (axes[0], "added_p50", "added p50"),
            (axes[1], "added_p99", "added p99"),
        ):
            for i, arm in enumerate(shown):
                vals, lo, hi = [], [], []
                for lv in levels:
                    r = _pick(load, "load", level=lv, arm=arm)
                    v = r[f"{metric}_ms"] if r else math.nan
                    vals.append(v)
                    lo.append(v - r[f"{metric}_lo"] if r else 0)
                    hi.append(r[f"{metric}_hi"] - v if r else 0)
                xs = [j + i * width for j in range(len(levels))]
                ax.bar(xs, vals, width, label=arm, color=COLORS.get(arm), yerr=[lo, hi], capsize=2)
            ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(levels))])
            ax.set_xticklabels([f"{lv:.0%}" for lv in levels])
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylabel(f"{title} over plain Envoy, ms (symlog)")
            ax.set_title(f"{title} vs plain Envoy (bars: median, whiskers: rounds)")
            ax.axhline(1.0 if metric == "added_p50" else 3.0, color="k", ls="--", lw=0.8)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
        save(fig, "bench-added-latency.png")

    thr = [r for r in summary if r.get("table") == "throughput"]
    if thr:
        fig, ax = plt.subplots(figsize=(8, 4))
        arms = arms_in(thr)
        xs = range(len(arms))
        ax.bar(
            [x - 0.2 for x in xs],
            [_pick(thr, "throughput", arm=a)["peak_rps"] for a in arms],
            0.4,
            label="closed-loop peak (wrk)",
            color=[COLORS.get(a) for a in arms],
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [_pick(thr, "throughput", arm=a)["slo_rps"] for a in arms],
            0.4,
            label="max sustainable, open loop (p99 < 50 ms, no error)",
            color=[COLORS.get(a) for a in arms],
            alpha=0.45,
            hatch="//",
        )
        ax.set_xticks(list(xs))
        ax.set_xticklabels(arms, rotation=15)
        ax.set_ylabel("requests/s (2xx)")
        ax.set_title("Throughput on 2 cores, 1k-token prompt, 16 output tokens")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        save(fig, "bench-throughput.png")

    st = [r for r in summary if r.get("table") == "stream"]
    if st:
        rates = sorted({r["rate"] for r in st})
        arms = [a for a in arms_in(st) if a not in ("envoy", "direct")]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        width = 0.8 / max(1, len(arms))
        for ax, metric, title in (
            (axes[0], "added_ttft_p50", "added TTFT p50"),
            (axes[1], "added_itl_p99", "added inter-token gap p99"),
        ):
            for i, arm in enumerate(arms):
                vals, lo, hi = [], [], []
                for rate in rates:
                    r = _pick(st, "stream", rate=rate, arm=arm)
                    v = r[f"{metric}_ms"] if r else math.nan
                    vals.append(v)
                    lo.append(v - r[f"{metric}_lo"] if r else 0)
                    hi.append(r[f"{metric}_hi"] - v if r else 0)
                ax.bar(
                    [j + i * width for j in range(len(rates))],
                    vals,
                    width,
                    label=arm,
                    color=COLORS.get(arm),
                    yerr=[lo, hi],
                    capsize=2,
                )
            ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(rates))])
            ax.set_xticklabels([f"{r:.0f} streams/s" for r in rates])
            ax.set_yscale("symlog", linthresh=0.1)
            ax.set_ylabel(f"{title} over plain Envoy, ms (symlog)")
            ax.set_title(title)
            ax.grid(True, axis="y", alpha=0.3)
        axes[1].axhline(0.3, color="k", ls="--", lw=0.8)
        axes[0].legend(fontsize=8)
        save(fig, "bench-stream.png")

    sz = [r for r in summary if r.get("table") == "size"]
    if sz:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for arm in [a for a in arms_in(sz) if a not in ("envoy", "direct")]:
            pts = sorted((r["prompt_tokens"], r["added_p50_ms"]) for r in sz if r["arm"] == arm)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=arm,
                color=COLORS.get(arm),
            )
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("prompt tokens (log)")
        ax.set_ylabel("added p50 over plain Envoy, ms (symlog)")
        ax.set_title("Added latency by prompt size, 1 request in flight")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "bench-prompt-size.png")

    cpu = [r for r in summary if r.get("table") == "cpu"]
    if cpu:
        roles = [
            ("envoy", "Envoy"),
            ("kvgate", "kvgate"),
            ("extproc", "no-op ext_proc"),
            ("redis", "redis-server"),
            ("litellm", "LiteLLM"),
            ("sim", "simulator"),
        ]
        arms = arms_in(cpu)
        fig, ax = plt.subplots(figsize=(8, 4))
        bottom = [0.0] * len(arms)
        for role, label in roles:
            vals = []
            for arm in arms:
                v = _pick(cpu, "cpu", arm=arm)
                x = v.get(f"{role}_cpu_s_per_1000", math.nan) if v else math.nan
                vals.append(0.0 if x is None or math.isnan(x) else x)
            if any(vals):
                ax.bar(arms, vals, bottom=bottom, label=label)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("CPU seconds per 1,000 requests")
        ax.set_title(f"CPU per request by process at {cpu[0]['level']:.0%} load")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        plt.setp(ax.get_xticklabels(), rotation=15)
        save(fig, "bench-cpu.png")
    return written


def write_all(rows: Sequence[Row], results_dir: Path, img_dir: Path, meta: dict[str, Any]) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    write_rows(results_dir / "runs.csv", rows)
    md, summary, targets = summary_tables(rows, meta)
    write_rows(results_dir / "summary.csv", summary)
    write_rows(results_dir / "targets.csv", targets)
    (results_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    header = f"# Benchmark summary ({meta.get('plan', '?')} run, {meta.get('finished', '')})\n\n"
    (results_dir / "summary.md").write_text(header + md, encoding="utf-8")
    plots(rows, summary, img_dir)
    return md


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="rebuild tables and plots from runs.csv")
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--img", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    rows = read_rows(args.results / "runs.csv")
    meta_path = args.results / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    print(write_all(rows, args.results, args.img, meta))


if __name__ == "__main__":
    main()
