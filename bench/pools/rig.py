"""The pools benchmark's processes (testbed/rig.py) and kvgate's config for each arm.

Simulators r0-r2 (prefix caching on; parts 1 and 2) and, for part 3, c0-c2 (answering at
once); the main kvgate, whose arms are hot reloads of its config, behind an Envoy with the
pool's ORIGINAL_DST cluster and a STATIC round-robin cluster of r0-r2; for part 3 a kvgate
with one plain backend (c0) behind its own Envoy, and a plain Envoy without ext_proc.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.cpu import wait_machine_quiet
from bench.pools.plans import (
    ALL_TENANTS,
    BIG,
    BLOCK,
    COST_SIMS,
    MODEL,
    POOL,
    REPLICAS,
    RR,
    SIM_NAMES,
    SINGLE,
    Plans,
)
from testbed.harness import SimOptions
from testbed.rig import EnvoyProcess, KvgateProcess, Rig, SimProcess


def sim_options(plans: Plans, *, cost: bool = False) -> SimOptions:
    """Parts 1 and 2 share simulators with prefix caching (part 2 sets its own latencies and
    output per request with x-sim-* headers); part 3's answer at once, without caching."""
    if cost:
        return SimOptions(
            num_gpu_blocks=20000,
            block_size=BLOCK,
            max_model_len=32768,
            default_output_tokens=plans.cost.max_tokens,
            log_level="warning",
        )
    p = plans.affinity
    return SimOptions(
        num_gpu_blocks=p.blocks,
        block_size=BLOCK,
        ttft_ms=p.ttft_ms,
        itl_ms=p.itl_ms,
        default_output_tokens=p.output_tokens,
        log_level="warning",
        extra_args=[
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--prefill-ms-per-1k-tokens",
            str(p.prefill_ms_per_1k),
            "--request-history",
            "50000",  # part 2 reads every admission's arrival back
        ],
    )


class PoolRig:
    """The run's processes, started once by `start`; `notes` says what did not go as
    planned (a reset that left prefix-cache blocks, a reload that failed)."""

    def __init__(self, work_dir: Path) -> None:
        self.rig = Rig(work_dir)
        self.model_dir = self.rig.model_dir
        self.notes: list[str] = []
        self._main: tuple[KvgateProcess, EnvoyProcess] | None = None
        self.single: tuple[KvgateProcess, EnvoyProcess] | None = None
        self.plain: EnvoyProcess | None = None

    def start(self, parts: Sequence[str], plans: Plans) -> None:
        rig = self.rig
        for name in SIM_NAMES:
            rig.sim(name, sim_options(plans))
        if "cost" in parts:
            for name in COST_SIMS:
                rig.sim(name, sim_options(plans, cost=True))
        first = rig.sims[SIM_NAMES[0]].port
        kv = rig.kvgate("kvgate-main", main_config(self, model_backend=POOL, pool_budget=BIG))
        envoy = self._envoy(
            "main",
            kv,
            backends={SINGLE: first, RR: first},
            pools=[POOL],
            round_robin={RR: [rig.sims[n].port for n in SIM_NAMES]},
        )
        self._main = (kv, envoy)
        if "cost" in parts:
            c0 = rig.sims[COST_SIMS[0]].port
            kv_single = rig.kvgate(
                "kvgate-single",
                {
                    "store": "memory",
                    "tenants": ALL_TENANTS,
                    "models": [model_config(self, SINGLE)],
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
            self.single = (kv_single, self._envoy("single", kv_single, backends={SINGLE: c0}))
            self.plain = self._envoy("plain", None, backends={SINGLE: c0})
        rig.wait_ready(timeout=180)

    def _envoy(self, name: str, kvgate: KvgateProcess | None, **options: Any) -> EnvoyProcess:
        """kvgate=None: plain Envoy (no ext_proc, one route to `vllm-local`)."""
        return self.rig.envoy(
            f"envoy-{name}",
            extproc=[kvgate.grpc_port] if kvgate is not None else [],
            route_all_to=SINGLE if kvgate is None else None,
            access_log_flush_ms=None,
            **options,
        )

    @property
    def main(self) -> tuple[KvgateProcess, EnvoyProcess]:
        """The main kvgate and its Envoy."""
        if self._main is None:
            raise RuntimeError("the rig is not started")
        return self._main

    # ---- simulators

    def sim(self, name: str) -> SimProcess:
        return self.rig.sims[name]

    def endpoints(self, names: Sequence[str] = SIM_NAMES) -> list[str]:
        return [self.rig.sims[n].endpoint for n in names]

    def sim_stats(self, name: str) -> dict[str, Any]:
        return self.rig.sims[name].stats()

    def reset_sims(self, names: Sequence[str] = SIM_NAMES) -> bool:
        """POST /sim/reset on each; True when every prefix cache is empty afterwards, else the
        simulators are restarted with the same flags and False is returned."""
        sims = [self.rig.sims[n] for n in names]
        for sim in sims:
            sim.reset()
        if all(sim.stats().get("prefix_cache_blocks", 0) == 0 for sim in sims):
            return True
        self.notes.append("POST /sim/reset left prefix-cache blocks: simulators restarted")
        for sim in sims:
            sim.restart(timeout=180)
        return False

    def wait_sims_idle(self, names: Sequence[str] = SIM_NAMES, timeout: float = 60.0) -> None:
        for name in names:
            self.rig.sims[name].wait_idle(timeout)

    # ---- kvgate

    def reconfigure(self, k: KvgateProcess, config: dict[str, Any]) -> str:
        """Apply `config` by hot reload (SIGHUP) and wait until kvgate counts it a success;
        a failed or missing reload restarts kvgate with the new config instead.
        Returns "reload" or "restart"."""
        if k.reload(config):
            return "reload"
        name = k.name.removeprefix("kvgate-")
        self.notes.append(f"kvgate {name}: reload failed or timed out; restarted instead")
        k.restart(timeout=180)
        for envoy in self.rig.envoys.values():
            if envoy.extproc_ports:
                envoy.wait_extproc_healthy()
        return "restart"

    # ---- the machine

    def pids(self) -> list[int]:
        return self.rig.pids()

    def quiet(
        self, timeout: float, max_cores: float = 0.5, window_s: float = 1.0
    ) -> dict[str, Any]:
        """Wait (at most `timeout` s) until the machine's busy CPU over one window is at most
        `max_cores` (our processes are idle then: the rest is other users')."""
        waited, cores = wait_machine_quiet(timeout, max_cores, window_s)
        return {"waited_s": round(waited, 1), "busy_cores_before": cores}

    def stop(self) -> None:
        self.rig.stop()


def main_config(
    rig: PoolRig,
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
        "models": [model_config(rig, model_backend)],
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


def model_config(rig: PoolRig, backend: str) -> dict[str, Any]:
    return {
        "name": MODEL,
        "tokenizer": str(rig.model_dir),
        "max_context": 32768,
        "default_max_new_tokens": 64,
        "backend": backend,
    }
