"""What each part of the pools benchmark runs: names, arms and phases, sizes and durations
(the full run and --quick), and the tenants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.harness import sha256_hex

MODEL = "qwen2.5-demo"
POOL = "vllm-pool"
RR = "vllm-rr"
SINGLE = "vllm-local"
BLOCK = 16
BIG = 200_000_000  # a budget nothing reaches
PARTS = ("affinity", "fairness", "cost")
REPLICAS = 3
# Simulators of parts 1 and 2 (prefix caching on), and of part 3 (answering at once).
SIM_NAMES = tuple(f"r{i}" for i in range(REPLICAS))
COST_SIMS = tuple(f"c{i}" for i in range(REPLICAS))
TENANTS_1 = ("acme", "globex", "initech", "umbrella", "hooli", "stark")
AFFINITY_ARMS = ("pool-affinity", "pool-load", "round-robin", "pool-affinity-gate1")
FAIR_PHASES = ("queue", "no-queue", "priority")
COST_ARMS = ("envoy", "kvgate", "kvgate-pool")


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
