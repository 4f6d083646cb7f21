"""The collaborators a stream session works with, built once by the composition root."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import SnapshotHolder
from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.extproc.handoff import HandoffRegistry
from kvgate.keys import KeyDirectory
from kvgate.lifecycle import (
    Admission,
    BackgroundTasks,
    LeaseKeeper,
    ResponseReading,
    Settler,
    Ticket,
)
from kvgate.lifecycle.answer_run import AnswerRun
from kvgate.lifecycle.answer_sources import AnswerSource
from kvgate.lifecycle.exchange import FairTokenizers
from kvgate.lifecycle.scheduler import PoolScheduler
from kvgate.metrics import Metrics
from kvgate.policy import Clock, Decision, SettleCause
from kvgate.store import StateStore

log = logging.getLogger("kvgate.services")


class GatewayServices:
    """What a stream session works with. Built by the composition root (app.py), which
    creates every concrete part; this only holds them and offers the session's helpers."""

    def __init__(
        self,
        *,
        snapshots: SnapshotHolder,
        store: StateStore,
        tokenizers: FairTokenizers,
        metrics: Metrics,
        clock: Clock,
        capacity: CapacityRegistry,
        handoffs: HandoffRegistry,
        tasks: BackgroundTasks,
        leases: LeaseKeeper,
        settler: Settler,
        scheduler: PoolScheduler | None = None,
        answer_sources: Sequence[AnswerSource] = (),
        keys: KeyDirectory | None = None,
    ) -> None:
        # API keys as data (None: keys.store is off; only the config's keys authenticate).
        self.keys = keys
        self.scheduler = scheduler
        # What may answer a request instead of a backend, in the order asked (app.py).
        self.answer_sources = tuple(answer_sources)
        self.snapshots = snapshots
        self.store = store
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.clock = clock
        self.capacity = capacity
        self.handoffs = handoffs
        self.tasks = tasks
        self.leases = leases
        self.settler = settler
        self.shutting_down = False

    def admission(self, snapshot: RuntimeSnapshot) -> Admission:
        return Admission(
            snapshot=snapshot,
            store=self.store,
            tokenizers=self.tokenizers,
            capacity=self.capacity,
            record_violations=self.record_violations,
            track=self.track,
            scheduler=self.scheduler,
        )

    def answer_run(self, sources: Sequence[AnswerSource]) -> AnswerRun:
        """One request's walk through ``sources`` (those of ``answer_sources`` that apply)."""
        return AnswerRun(
            sources,
            self.store,
            self.clock,
            self.metrics,
            self.track,
            usage_records=self.settler.usage_records,
        )

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run work that must finish even though its stream is gone; shutdown waits for it."""
        return self.tasks.track(coro)

    def settle_unclaimed(self, ticket: Ticket) -> None:
        """A split-layout hand-off no observing stream claimed. Envoy opens that stream with
        the request, so nothing of the answer was seen: the billing rule decides from that."""
        self.metrics.stream_disconnects.labels("unclaimed_handoff").inc()
        reading = ResponseReading(streamed=ticket.request.stream)
        self.settler.settle(ticket, SettleCause.DISCONNECTED, reading)

    def record_violations(self, tenant: str, decision: Decision) -> None:
        for violation in decision.violations:
            if violation.shadow:
                self.metrics.shadow_rejections.labels(tenant, violation.limit).inc()
        view = decision.rate_limits
        if view is not None:
            if view.remaining_tokens is not None:
                self.metrics.tenant_remaining_tokens.labels(tenant).set(view.remaining_tokens)
            if view.remaining_requests is not None:
                self.metrics.tenant_remaining_requests.labels(tenant).set(view.remaining_requests)

    async def refresh_backend_gauges(self) -> None:
        """Read in-flight work from the store when /metrics is scraped, not per request:
        with a shared store that would be one more round trip on every admit and settle."""
        try:
            statuses = await self.store.backend_status()
        except Exception:
            log.warning("backend status unavailable; gauges keep their last values")
            return
        for status in statuses:
            self.metrics.kv_tokens_in_flight.labels(status.name).set(status.kv_tokens_in_flight)
            self.metrics.requests_in_flight.labels(status.name).set(status.requests_in_flight)
        if self.scheduler is not None:
            self._refresh_pool_gauges(self.scheduler)

    def _refresh_pool_gauges(self, scheduler: PoolScheduler) -> None:
        m = self.metrics
        for view in scheduler.pool_views():
            states = {
                "pickable": len(view.pickable),
                "unhealthy": view.unhealthy,
                "shedding": len(view.shedding),
                "capacity_unknown": view.capacity_unknown,
            }
            for state, count in states.items():
                m.pool_endpoints.labels(view.pool, state).set(count)
            queue = scheduler.queue(view.pool)
            if queue is not None:
                for priority, waiting in queue.waiting_by_priority().items():
                    m.queue_length.labels(view.pool, str(priority)).set(waiting)
            for endpoint in view.pickable:
                m.kv_budget_tokens.labels(endpoint.key).set(endpoint.limits.kv_budget_tokens)
                # An endpoint with nothing in flight has no ledger in the store yet.
                m.kv_tokens_in_flight.labels(endpoint.key)

    async def drain(self, timeout_s: float) -> None:
        """Wait for settlements still running (shutdown)."""
        self.leases.close()
        await self.tasks.drain(timeout_s)
