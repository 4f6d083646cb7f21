"""Thin delegating wrappers around a running kvgate's store and tokenizers that pause one
chosen call of the admission path, so a test can cancel the stream exactly there."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvgate.extproc.services import GatewayServices
from kvgate.policy import AdmissionRequest, BackendLimits, Decision, TenantPolicy

T = TypeVar("T")


class ReserveMode(enum.Enum):
    BEFORE = "before"  # paused before the store saw the reserve
    COMMITTED = "committed"  # the reserve committed; its reply is lost while paused
    LANDS_LATE = "lands_late"  # the reserve is in flight and commits after the cancel


@dataclass
class Gate:
    """Pauses the `occurrence`-th call of `target.method` (once; later calls pass)."""

    target: str  # "store" or "tokenizers"
    method: str
    occurrence: int = 1
    reserve_mode: ReserveMode = ReserveMode.COMMITTED
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # The reserve's own outcome: what it committed (COMMITTED) or its late task.
    committed: Decision | None = None
    late_task: asyncio.Task[Decision] | None = None
    _calls: Counter[str] = field(default_factory=Counter)
    _armed: bool = True

    def hit(self, target: str, method: str) -> bool:
        if not self._armed or target != self.target:
            return False
        self._calls[method] += 1
        if method == self.method and self._calls[method] == self.occurrence:
            self._armed = False
            return True
        return False

    async def pause(self) -> None:
        self.reached.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def wait_reached(self, within_s: float = 10.0) -> None:
        await asyncio.wait_for(self.reached.wait(), within_s)

    async def wait_cancelled(self, within_s: float = 10.0) -> None:
        await asyncio.wait_for(self.cancelled.wait(), within_s)


class PausingStore:
    """Delegates every call to the real store; pauses at the gate's call."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def precheck(
        self,
        lower_bound: AdmissionRequest,
        backend: BackendLimits,
        tenant: TenantPolicy,
        **kwargs: Any,
    ) -> Decision | None:
        if self._gate.hit("store", "precheck"):
            await self._gate.pause()
        result: Decision | None = await self._inner.precheck(lower_bound, backend, tenant, **kwargs)
        return result

    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy, **kw: Any
    ) -> Decision:
        gate = self._gate
        if not gate.hit("store", "reserve"):
            decision: Decision = await self._inner.reserve(request, backend, tenant, **kw)
            return decision
        if gate.reserve_mode is ReserveMode.BEFORE:
            await gate.pause()
            decision = await self._inner.reserve(request, backend, tenant, **kw)
            return decision
        if gate.reserve_mode is ReserveMode.COMMITTED:
            decision = await self._inner.reserve(request, backend, tenant, **kw)
            gate.committed = decision
            await gate.pause()  # the reply is "lost" if the caller is cancelled here
            return decision

        # LANDS_LATE: as a Redis script the caller stopped waiting for, the reserve runs
        # to its end whatever happens to the caller, after the gate opens.
        async def late() -> Decision:
            await gate.release.wait()
            result: Decision = await self._inner.reserve(request, backend, tenant, **kw)
            return result

        gate.late_task = asyncio.get_running_loop().create_task(late())
        gate.reached.set()
        try:
            return await asyncio.shield(gate.late_task)
        except asyncio.CancelledError:
            gate.cancelled.set()
            raise


class PausingTokenizers:
    """Delegates every call to the real tokenizer service; pauses at the gate's call
    (before the work is handed to the service)."""

    def __init__(self, inner: Any, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _maybe_pause(self, method: str) -> None:
        if self._gate.hit("tokenizers", method):
            await self._gate.pause()

    async def run(self, tenant: str, work: Callable[[], T], *, cost: int = 1) -> T:
        await self._maybe_pause("run")
        result: T = await self._inner.run(tenant, work, cost=cost)
        return result

    async def count_chat(
        self, model: str, messages: list[dict[str, Any]], *a: Any, **k: Any
    ) -> int:
        await self._maybe_pause("count_chat")
        count: int = await self._inner.count_chat(model, messages, *a, **k)
        return count

    async def count_completion(self, model: str, prompt: Any, **kwargs: Any) -> int:
        await self._maybe_pause("count_completion")
        count: int = await self._inner.count_completion(model, prompt, **kwargs)
        return count

    async def count_text(self, model: str, text: str, **kwargs: Any) -> int:
        await self._maybe_pause("count_text")
        count: int = await self._inner.count_text(model, text, **kwargs)
        return count


def install(services: GatewayServices, gate: Gate) -> None:
    """Wrap the store and the tokenizers wherever the request path reads them: the
    services object (admission planner, session, settlement) and the lease keeper."""
    store = PausingStore(services.store, gate)
    services.store = store  # type: ignore[assignment]
    leases = getattr(services, "leases", None)  # (absent before leases had a keeper)
    if leases is not None:
        leases._store = store
    services.tokenizers = PausingTokenizers(services.tokenizers, gate)
