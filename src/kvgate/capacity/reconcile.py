"""What kvgate booked against what each engine says it processed.

Every engine kvgate scrapes (a backend with metrics discovery, each endpoint of a pool)
exposes its own token counters, ``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total``; the state store keeps what kvgate booked per ledger (the
backend, or the pool's endpoint ``pool/IP:PORT``), across replicas. From the moment this
replica first reads both, the two increases are compared: the difference is tokens the
engine processed that kvgate did not book (traffic that reached the engine around kvgate,
a cut answer billed below what was generated), or, when negative, tokens booked that the
engine did not process.

Both sides move at different moments (the engine counts a prompt at its first token and
each token as it is generated; kvgate books at settlement; the scrape and the store read
are a few seconds apart), so the difference is exact only when nothing is in flight; the
alert on it asks for a sustained difference. An engine restart resets its counters: the
increase is carried over the reset as Prometheus' ``increase()`` does (the tokens an engine
counted between its last scrape and its restart are not seen).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.capacity.vllm_metrics import VllmCapacity
from kvgate.metrics import Metrics
from kvgate.policy import UsageTotals
from kvgate.store import StoreUnavailable

log = logging.getLogger("kvgate.reconcile")

# How often the booked totals are read and compared (the engines are scraped on their own
# discovery interval).
RECONCILE_INTERVAL_S = 5.0


class EngineReadings(Protocol):
    def readings(self) -> Mapping[str, VllmCapacity]:
        """The latest fresh reading of each engine, by the ledger its requests hold."""
        ...


class BookedTotals(Protocol):
    async def backend_totals(self) -> dict[str, UsageTotals]: ...


@dataclass(frozen=True, slots=True)
class ReconcileRow:
    """One engine since this replica began watching it."""

    # The ledger: a backend, or a pool's endpoint (pool/IP:PORT).
    ledger: str
    engine_prompt_tokens: int
    engine_output_tokens: int
    booked_prompt_tokens: int
    booked_output_tokens: int
    engine_restarts: int
    watching_s: float

    @property
    def unbooked_prompt_tokens(self) -> int:
        return self.engine_prompt_tokens - self.booked_prompt_tokens

    @property
    def unbooked_output_tokens(self) -> int:
        return self.engine_output_tokens - self.booked_output_tokens


class _EngineCounter:
    """One engine counter's increase since the first reading, across restarts."""

    def __init__(self, value: int) -> None:
        self.last = value
        self.increase = 0
        self.resets = 0

    def observe(self, value: int) -> None:
        if value < self.last:
            # The engine restarted: its counter began again from zero.
            self.resets += 1
            self.increase += value
        else:
            self.increase += value - self.last
        self.last = value


@dataclass(slots=True)
class _Watch:
    started_at: float
    prompt: _EngineCounter
    output: _EngineCounter
    booked_prompt_base: int
    booked_output_base: int
    booked_prompt: int = 0
    booked_output: int = 0


class Reconciler:
    def __init__(
        self,
        engines: tuple[EngineReadings, ...],
        store: BookedTotals,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engines = engines
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._watches: dict[str, _Watch] = {}
        self._task: asyncio.Task[None] | None = None

    def rows(self) -> list[ReconcileRow]:
        now = self._clock()
        return [
            ReconcileRow(
                ledger=ledger,
                engine_prompt_tokens=watch.prompt.increase,
                engine_output_tokens=watch.output.increase,
                booked_prompt_tokens=watch.booked_prompt - watch.booked_prompt_base,
                booked_output_tokens=watch.booked_output - watch.booked_output_base,
                engine_restarts=max(watch.prompt.resets, watch.output.resets),
                watching_s=now - watch.started_at,
            )
            for ledger, watch in sorted(self._watches.items())
        ]

    async def run_once(self) -> None:
        readings: dict[str, VllmCapacity] = {}
        for source in self._engines:
            readings.update(source.readings())
        counted = {
            ledger: reading
            for ledger, reading in readings.items()
            if reading.prompt_tokens_total is not None
            and reading.generation_tokens_total is not None
        }
        if not counted:
            return
        try:
            booked = await self._store.backend_totals()
        except StoreUnavailable:
            return  # compared again once the store answers
        for ledger, reading in counted.items():
            assert reading.prompt_tokens_total is not None
            assert reading.generation_tokens_total is not None
            totals = booked.get(ledger, UsageTotals())
            watch = self._watches.get(ledger)
            if watch is None:
                self._watches[ledger] = _Watch(
                    started_at=self._clock(),
                    prompt=_EngineCounter(reading.prompt_tokens_total),
                    output=_EngineCounter(reading.generation_tokens_total),
                    booked_prompt_base=totals.prompt_tokens,
                    booked_output_base=totals.output_tokens,
                    booked_prompt=totals.prompt_tokens,
                    booked_output=totals.output_tokens,
                )
                continue
            watch.prompt.observe(reading.prompt_tokens_total)
            watch.output.observe(reading.generation_tokens_total)
            watch.booked_prompt = totals.prompt_tokens
            watch.booked_output = totals.output_tokens
        for row in self.rows():
            gauge = self._metrics.engine_unbooked_tokens
            gauge.labels(row.ledger, "prompt").set(row.unbooked_prompt_tokens)
            gauge.labels(row.ledger, "output").set(row.unbooked_output_tokens)

    async def start(self, interval_s: float = RECONCILE_INTERVAL_S) -> None:
        self._task = asyncio.create_task(self._run(interval_s), name="reconcile")

    async def _run(self, interval_s: float) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:
                log.exception("reconciling booked tokens with the engines failed")
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
