"""The three parts of the pools benchmark: for each arm or phase, kvgate's config applied,
the simulators reset, the machine quiet, the load driven, the readings taken (and then
summed up by `measure`)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict
from typing import Any

from bench.cpu import CpuWindow
from bench.pools import load as loads
from bench.pools.load import Rec, chat_body, client_session, headers_for, stream_chat, words
from bench.pools.measure import (
    InFlightSampler,
    affinity_summary,
    delta,
    fairness_summary,
    interleaved_stats,
    ms,
    vtc_check,
)
from bench.pools.microbench import picking_microbench
from bench.pools.plans import (
    AFFINITY_ARMS,
    BIG,
    BLOCK,
    COST_SIMS,
    FAIR_PHASES,
    POOL,
    RR,
    SIM_NAMES,
    TENANTS_1,
    AffinityPlan,
    CostPlan,
    FairnessPlan,
    api_key,
)
from bench.pools.report import keep_raw
from bench.pools.rig import PoolRig, main_config
from bench.stack import Arm
from bench.stats import percentile

# =========================================================================== 1. affinity


def run_affinity(rig: PoolRig, plan: AffinityPlan, quiet_s: float) -> dict[str, Any]:
    kv, envoy = rig.main
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
            asyncio.run(loads.closed_loop(envoy.base_url, warmup, plan.concurrency, []))
            print(
                f"  affinity: round {k + 1}/{plan.rounds} {arm} ({len(part)} requests, "
                f"{plan.concurrency} in flight)",
                flush=True,
            )
            run = _affinity_run(rig, arm, part, plan, quiet_s)
            run["applied_by"] = how
            runs[arm].append(run)
    arms = {arm: affinity_summary(runs[arm], plan, budget) for arm in AFFINITY_ARMS}
    return {
        "plan": asdict(plan),
        "kv_budget_per_pod": budget,
        "simulator_probe": probe,
        "arms": arms,
    }


def _sim_cpu_probe(rig: PoolRig, system: str, plan: AffinityPlan) -> dict[str, Any]:
    """TTFT of requests whose system prompt is cached, sent straight to one simulator: one
    at a time, and four at once (what piling onto one pod costs the simulator's own CPU)."""
    url = f"{rig.sim(SIM_NAMES[0]).url}/v1/chat/completions"
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
            await stream_chat(session, url, headers_for("acme"), body(), warm)
            for i in range(6):
                rec = Rec("probe", f"alone-{i}")
                await stream_chat(session, url, headers_for("acme"), body(), rec)
                alone.append(rec.t_first - rec.t_send)
            for i in range(3):
                recs = [Rec("probe", f"together-{i}-{k}") for k in range(4)]
                await asyncio.gather(
                    *(stream_chat(session, url, headers_for("acme"), body(), r) for r in recs)
                )
                together += [r.t_first - r.t_send for r in recs]
        return alone, together

    rig.reset_sims()
    alone, together = asyncio.run(go())
    rig.reset_sims()
    return {
        "ttft_ms_one_at_a_time_p50": percentile(ms(alone), 50),
        "ttft_ms_four_at_once_p50": percentile(ms(together), 50),
        "ttft_ms_four_at_once_max": max(ms(together)),
    }


def _affinity_run(
    rig: PoolRig,
    arm: str,
    sequence: list[tuple[str, bytes]],
    plan: AffinityPlan,
    quiet_s: float,
) -> dict[str, Any]:
    """One arm over one slice of the sequence, from reset simulators: the raw readings."""
    kv, envoy = rig.main
    rig.wait_sims_idle()
    reset_ok = rig.reset_sims()
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    recs: list[Rec] = []
    cpu = CpuWindow(rig.pids)
    with InFlightSampler(kv.metrics_url) as sampler:
        wall = asyncio.run(loads.closed_loop(envoy.base_url, sequence, plan.concurrency, recs))
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
            affinity: delta(before, after, "kvgate_pool_picks_total", affinity=affinity)
            for affinity in ("hit", "miss")
        },
        "wall": wall,
        "cpu": cpu_info,
        "quiet": quiet,
        "reset_ok": reset_ok,
    }


# =========================================================================== 2. fairness


def run_fairness(rig: PoolRig, plan: FairnessPlan, quiet_s: float) -> dict[str, Any]:
    kv, envoy = rig.main
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
    load = {
        "queue": {"heavy": plan.heavy_clients, "light": plan.light_clients},
        "no-queue": {"heavy": plan.heavy_clients, "light": plan.light_clients},
        "priority": {
            "heavy": plan.heavy_clients,
            "light": plan.light_clients,
            "vip": plan.vip_clients,
        },
    }
    phases: dict[str, Any] = {}
    recs: dict[str, list[Rec]] = {}
    for phase in FAIR_PHASES:
        how = rig.reconfigure(kv, configs[phase])
        # Warm-up after the reload: a few requests of every tenant, fewer than fit the pool.
        warm = FairnessPlan(**{**asdict(plan), "duration_s": 1.0})
        asyncio.run(
            loads.fair_load(envoy.base_url, dict.fromkeys(load[phase], 1), warm, [], "warm")
        )
        print(f"  fairness: {phase} ({load[phase]}, {plan.duration_s:g} s)")
        run = fair_phase(rig, phase, load[phase], plan, quiet_s)
        recs[phase] = run["recs"]
        phases[phase] = fairness_summary(run, load[phase], plan, budget, phase)
        phases[phase]["applied_by"] = how
    # The client-side wait includes the request's own way through Envoy and kvgate before it
    # can queue (and after, to the simulator). Without a queue that whole way is the wait of
    # an admitted request: its median, taken off the start of every wait, gives a second
    # reading of the VTC check closer to what kvgate's queue itself saw.
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


def fair_phase(
    rig: PoolRig, phase: str, load: dict[str, int], plan: FairnessPlan, quiet_s: float
) -> dict[str, Any]:
    """One phase from reset simulators: the raw readings, each request's admission (its
    arrival at a simulator) filled in."""
    kv, envoy = rig.main
    rig.wait_sims_idle()
    rig.reset_sims()
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    cpu = CpuWindow(rig.pids)
    recs: list[Rec] = []
    t0, t_stop = asyncio.run(loads.fair_load(envoy.base_url, load, plan, recs, phase))
    rig.wait_sims_idle()
    cpu_info = cpu.close()
    after = kv.metrics()
    stats = {n: rig.sim_stats(n) for n in SIM_NAMES}
    # Admission = arrival at a simulator.
    arrivals: dict[str, float] = {}
    for n in SIM_NAMES:
        for entry in rig.sim(n).requests()["requests"]:
            bench_id = entry["headers"].get("x-bench-id")
            if bench_id:
                arrivals[bench_id] = float(entry["time"])
    for r in recs:
        if r.bench_id in arrivals:
            r.epoch_admitted = arrivals[r.bench_id]
    keep_raw("fairness", phase, recs)
    return {
        "recs": recs,
        "stats": stats,
        "address": dict(zip(SIM_NAMES, rig.endpoints(), strict=True)),
        "before": before,
        "after": after,
        "duration": t_stop - t0,
        "epoch_stop": time.time() - (time.perf_counter() - t_stop),
        "quiet": quiet,
        "cpu": cpu_info,
    }


# =========================================================================== 3. cost


def run_cost(rig: PoolRig, plan: CostPlan, quiet_s: float) -> dict[str, Any]:
    kv, envoy = rig.main
    if rig.single is None or rig.plain is None:
        raise RuntimeError("part 3 needs the rig started with the cost part")
    how = rig.reconfigure(
        kv, main_config(rig, model_backend=POOL, pool_budget=BIG, endpoints=COST_SIMS)
    )
    kv_single, e_single = rig.single
    key = api_key("bench")
    arms = {
        "envoy": Arm("envoy", rig.plain.base_url, key, pids={"envoy": rig.plain.pid}),
        "kvgate": Arm(
            "kvgate",
            e_single.base_url,
            key,
            pids={"envoy": e_single.pid, "kvgate": kv_single.pid},
        ),
        "kvgate-pool": Arm(
            "kvgate-pool",
            envoy.base_url,
            key,
            pids={"envoy": envoy.pid, "kvgate": kv.pid},
        ),
    }
    rig.reset_sims(COST_SIMS)
    quiet = rig.quiet(quiet_s)
    before = kv.metrics()
    print(f"  cost: interleaved, {plan.iterations} requests per arm")
    cpu = CpuWindow(rig.pids)
    samples = asyncio.run(loads.interleaved(arms, plan))
    cpu_info = cpu.close()
    after = kv.metrics()
    picks = {
        address: delta(before, after, "kvgate_pool_picks_total", endpoint=address)
        for address in rig.endpoints(COST_SIMS)
    }
    print("  cost: in-process timeit of the picking pieces")
    return {
        "plan": asdict(plan),
        "applied_by": how,
        "quiet": quiet,
        "interleaved": interleaved_stats(samples),
        "pool_picks_per_endpoint": picks,
        "cpu": cpu_info,
        "microbench": picking_microbench(plan),
    }
