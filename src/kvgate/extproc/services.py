"""What a stream session needs from the rest of kvgate, gathered in one object."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from kvgate.config import SnapshotHolder
from kvgate.metrics import Metrics
from kvgate.policy import ActualUsage, Clock, Reservation, SettleCause
from kvgate.store import StateStore

log = logging.getLogger("kvgate.settle")


class PromptTokenizers(Protocol):
    async def count_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> int: ...

    async def count_completion(self, model: str, prompt: Any) -> int: ...

    async def count_text(self, model: str, text: str) -> int: ...


class GatewayServices:
    def __init__(
        self,
        *,
        snapshots: SnapshotHolder,
        store: StateStore,
        tokenizers: PromptTokenizers,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self.snapshots = snapshots
        self.store = store
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.clock = clock
        self.shutting_down = False
        self._background: set[asyncio.Task[None]] = set()

    @property
    def lease_renew_interval_s(self) -> float:
        # Renew well before expiry, but not on every chunk.
        return self.snapshots.current.config.server.lease_ttl_s / 3

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run work that must finish even though its stream is gone; shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        request_id: str = "",
    ) -> asyncio.Task[None]:
        return self.track(self._settle(reservation, cause, usage, request_id))

    async def _settle(
        self, reservation: Reservation, cause: SettleCause, usage: ActualUsage, request_id: str
    ) -> None:
        request = reservation.request
        try:
            settlement = await self.store.settle(reservation, cause, usage)
        except Exception:
            # The lease still expires on its own; say loudly that this one was not recorded.
            log.exception("settlement failed", extra={"request_id": request_id})
            return
        if not settlement.applied:
            return
        m = self.metrics
        m.settlements.labels(request.backend, cause.value).inc()
        m.prompt_tokens.labels(request.tenant, request.model).inc(usage.prompt_tokens)
        m.output_tokens.labels(request.tenant, request.model).inc(usage.output_tokens)
        if usage.cached_tokens:
            m.cached_tokens.labels(request.tenant, request.model).inc(usage.cached_tokens)
        used = usage.prompt_tokens + usage.output_tokens
        m.reserved_unused_tokens.labels(request.backend).inc(max(0, reservation.kv_tokens - used))
        self.refresh_backend_gauges(request.backend)
        log.info(
            "settled",
            extra={
                "request_id": request_id,
                "tenant": request.tenant,
                "model": request.model,
                "cause": cause.value,
                "prompt_tokens": usage.prompt_tokens,
                "output_tokens": usage.output_tokens,
                "reserved_tokens": reservation.kv_tokens,
            },
        )

    def refresh_backend_gauges(self, backend: str) -> None:
        self.track(self._refresh_backend_gauges(backend))

    async def _refresh_backend_gauges(self, backend: str) -> None:
        for status in await self.store.backend_status():
            if status.name == backend:
                self.metrics.kv_tokens_in_flight.labels(backend).set(status.kv_tokens_in_flight)
                self.metrics.requests_in_flight.labels(backend).set(status.requests_in_flight)

    async def drain(self, timeout_s: float) -> None:
        """Wait for settlements still running (shutdown)."""
        pending = set(self._background)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
