"""The reconciler's arithmetic: increases since the first reading, across engine restarts,
against the store's booked totals."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from kvgate.capacity.reconcile import Reconciler
from kvgate.capacity.vllm_metrics import VllmCapacity
from kvgate.metrics import Metrics
from kvgate.policy import UsageTotals
from kvgate.store import StoreUnavailable


def reading(prompt: int | None, generated: int | None) -> VllmCapacity:
    return VllmCapacity(
        model_name="m",
        num_gpu_blocks=None,
        block_size=None,
        kv_capacity_tokens=None,
        kv_cache_usage=None,
        num_requests_running=0,
        num_requests_waiting=0,
        num_preemptions_total=0,
        prompt_tokens_total=prompt,
        generation_tokens_total=generated,
    )


class Engines:
    """What the capacity registries hand the reconciler: the latest reading per ledger."""

    def __init__(self) -> None:
        self.now: dict[str, VllmCapacity] = {}

    def readings(self) -> Mapping[str, VllmCapacity]:
        return self.now


class Booked:
    """The store's per-ledger totals as the reconciler reads them."""

    def __init__(self) -> None:
        self.totals: dict[str, UsageTotals] = {}
        self.down = False

    async def backend_totals(self) -> dict[str, UsageTotals]:
        if self.down:
            raise StoreUnavailable("down", 1)
        return dict(self.totals)


def booked(prompt: int, output: int) -> UsageTotals:
    return UsageTotals(requests=1, prompt_tokens=prompt, output_tokens=output)


async def test_increases_since_the_first_reading_across_an_engine_restart() -> None:
    registry = CollectorRegistry()
    engines, store = Engines(), Booked()
    reconciler = Reconciler((engines,), store, Metrics(registry))
    # Before anything is watched: what the engine and the store held is the baseline.
    engines.now = {"gpu/10.0.0.1:8000": reading(1_000, 500)}
    store.totals = {"gpu/10.0.0.1:8000": booked(900, 450)}
    await reconciler.run_once()
    [row] = reconciler.rows()
    assert (row.engine_prompt_tokens, row.booked_prompt_tokens, row.unbooked_prompt_tokens) == (
        0,
        0,
        0,
    )
    engines.now = {"gpu/10.0.0.1:8000": reading(1_300, 560)}
    store.totals = {"gpu/10.0.0.1:8000": booked(1_150, 500)}
    await reconciler.run_once()
    [row] = reconciler.rows()
    assert (row.engine_prompt_tokens, row.booked_prompt_tokens) == (300, 250)
    assert (row.unbooked_prompt_tokens, row.unbooked_output_tokens) == (50, 10)
    # The engine restarted: its counters began again; what it counted since is added on.
    engines.now = {"gpu/10.0.0.1:8000": reading(40, 4)}
    await reconciler.run_once()
    [row] = reconciler.rows()
    assert (row.engine_prompt_tokens, row.engine_output_tokens, row.engine_restarts) == (
        340,
        64,
        1,
    )
    for kind, unbooked in (("prompt", 340 - 250), ("output", 64 - 50)):
        labels = {"backend": "gpu/10.0.0.1:8000", "kind": kind}
        assert registry.get_sample_value("kvgate_engine_unbooked_tokens", labels) == unbooked


async def test_a_store_that_does_not_answer_and_engines_without_counters() -> None:
    engines, store = Engines(), Booked()
    reconciler = Reconciler((engines,), store, Metrics())
    engines.now = {"a": reading(None, None)}  # an engine that does not expose them
    await reconciler.run_once()
    assert reconciler.rows() == []
    engines.now = {"b": reading(10, 1)}
    store.down = True
    await reconciler.run_once()
    assert reconciler.rows() == []  # no baseline without the booked side
    store.down = False
    await reconciler.run_once()
    assert [r.ledger for r in reconciler.rows()] == ["b"]
