"""Placing a request on one endpoint of a pool, or queueing it until one has room.

For a pool backend, admission asks the scheduler instead of reserving on the backend:

1. **Rank** the pool's pickable endpoints (healthy, budget known, not shedding) with
   `kvgate.policy.picking`: prefix affinity (hashes of the prompt's leading blocks, a
   bounded map from block hash to the endpoint that last served it) weighed against free
   KV, with a load gate so affinity never piles onto one pod; a rendezvous hash breaks ties
   the same way on every kvgate replica.
2. **Reserve** on the endpoints in that order, each an atomic all-or-nothing store step
   under the endpoint's own ledger (`pool/IP:PORT`). The store is the truth: the ranking
   is only a guess of where there is room (another replica may have taken it).
3. A tenant limit answers at once. When only the pool is full and the pool has a
   `queue`, the request **waits its turn** (`lifecycle.queue`: priority classes, then the
   Virtual Token Counter between tenants, work-conserving) and is tried again each time
   capacity frees up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from kvgate.capacity.pools import PoolEndpoint, PoolRegistry, PoolView
from kvgate.config.model import BackendConfig, KvgateConfig
from kvgate.lifecycle.queue import (
    NO_ROOM,
    NoRoom,
    PoolQueue,
    QueueObserver,
    QueueRejected,
    QueueSettings,
)
from kvgate.lifecycle.ticket import Ticket
from kvgate.metrics import Metrics
from kvgate.openai import ParsedRequest
from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Decision,
    Reason,
    TenantPolicy,
)
from kvgate.policy.picking import (
    EndpointLoad,
    PickWeights,
    PrefixIndex,
    rank_endpoints,
    rendezvous_order,
)

log = logging.getLogger("kvgate.scheduler")

# What a full endpoint answers: the next endpoint may have room.
_NO_ROOM_REASONS = frozenset(
    {Reason.KV_BUDGET_EXHAUSTED, Reason.BACKEND_CONCURRENCY_LIMIT, Reason.REQUEST_EXCEEDS_KV_BUDGET}
)
# With a shared store, how long one read of every endpoint's in-flight work steers picks
# (one round trip per request would double the store's load; the reserve itself is exact).
SHARED_STATUS_TTL_S = 0.25

ReserveOn = Callable[[AdmissionRequest, BackendLimits], Awaitable[Decision]]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pool request was placed (or why not)."""

    decision: Decision
    endpoint: PoolEndpoint | None = None
    # Set when the request cannot go anywhere for a reason of the pool itself.
    pool_reason: Reason | None = None
    retry_after_s: float | None = None
    detail: str = ""
    queued_s: float = 0.0
    affinity_blocks: int = 0


class QueueMetrics:
    """The queue's observer: Prometheus counters and histograms (queue lengths are read
    from the queues when /metrics is scraped)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_enqueue(self, pool: str, tenant: str, priority: int) -> None:
        return None

    def on_dispatch(self, pool: str, tenant: str, priority: int, waited_s: float) -> None:
        self._metrics.queue_wait_seconds.labels(pool, tenant, str(priority)).observe(waited_s)

    def on_drop(self, pool: str, tenant: str, priority: int, reason: str, waited_s: float) -> None:
        self._metrics.queue_drops.labels(pool, tenant, reason).inc()


class PoolUnavailable(Exception):
    """No endpoint of the pool can be tried now (none healthy, or no budget known)."""

    def __init__(self, reason: Reason, detail: str, retry_after_s: float) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s


class PoolScheduler:
    """Every pool's prefix index and queue; one per process, kept across reloads."""

    def __init__(
        self,
        pools: PoolRegistry,
        backend_status: Callable[[], Awaitable[list[BackendStatus]]],
        *,
        shared_store: bool,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        observer: QueueObserver | None = QueueMetrics(metrics) if metrics is not None else None
        self._pools = pools
        self._backend_status = backend_status
        self._status_ttl_s = SHARED_STATUS_TTL_S if shared_store else 0.0
        self._status: dict[str, BackendStatus] = {}
        self._status_at = float("-inf")
        self._observer = observer
        self._clock = clock
        self._indexes: dict[str, PrefixIndex] = {}
        self._queues: dict[str, PoolQueue] = {}
        self._settings: dict[str, BackendConfig] = {}

    def sync(self, config: KvgateConfig) -> None:
        """Follow a (re)loaded config: new indexes where the hashing changed, queues
        created, resized or dropped (a dropped queue's waiters finish under old settings)."""
        wanted = {b.name: b for b in config.backends if b.is_pool}
        for name in list(self._settings):
            if name not in wanted:
                self._settings.pop(name)
                self._indexes.pop(name, None)
                self._queues.pop(name, None)
        for name, settings in wanted.items():
            old = self._settings.get(name)
            picking = settings.picking
            if old is None or old.picking.model_dump(
                include={"block_chars", "max_blocks", "max_entries"}
            ) != picking.model_dump(include={"block_chars", "max_blocks", "max_entries"}):
                self._indexes[name] = PrefixIndex(
                    block_chars=picking.block_chars,
                    max_blocks=picking.max_blocks,
                    max_entries=picking.max_entries,
                )
            if settings.queue is None:
                self._queues.pop(name, None)
            else:
                queue_settings = QueueSettings(**settings.queue.model_dump())
                queue = self._queues.get(name)
                if queue is None or old is None or old.queue != settings.queue:
                    if queue is not None and queue.has_waiters():
                        queue.settings = queue_settings  # waiters stay; new limits apply
                    else:
                        self._queues[name] = PoolQueue(
                            name, queue_settings, clock=self._clock, observer=self._observer
                        )
            self._settings[name] = settings

    def is_pool(self, backend: str) -> bool:
        return backend in self._settings

    def queue(self, pool: str) -> PoolQueue | None:
        return self._queues.get(pool)

    def max_wait_s(self, pool: str) -> float | None:
        queue = self._settings[pool].queue
        return queue.max_wait_s if queue is not None else None

    def limits_for_precheck(self, pool: str) -> BackendLimits | None:
        """Limits for the pre-check, which only reads a backend to time a tenant's
        concurrency: the first pickable (or degraded) endpoint's, or None when there is none."""
        view = self._pools.view(pool)
        candidates = view.pickable or view.degraded
        return candidates[0].limits if candidates else None

    async def place(
        self,
        request: AdmissionRequest,
        parsed: ParsedRequest,
        tenant: TenantPolicy,
        *,
        priority: int,
        reserve_on: ReserveOn,
        on_queued: Callable[[float], None] | None = None,
    ) -> Placement:
        """Reserve `request` on one endpoint of its pool (`request.backend`), waiting in the
        pool's queue when it is full. Raises PoolUnavailable when nothing can be tried."""
        pool = request.backend
        settings = self._settings[pool]
        index = self._indexes[pool]
        hashes: list[int] = []
        first_block = ""
        if settings.picking.prefix_affinity:
            text = affinity_text(parsed, settings.picking.block_chars * settings.picking.max_blocks)
            hashes = index.block_hashes(text)
            first_block = text[: settings.picking.block_chars]

        async def attempt() -> Placement | NoRoom:
            placement = await self._try_endpoints(
                request, tenant, settings, index, hashes, first_block, reserve_on
            )
            if placement.decision.admitted or placement.pool_reason is None:
                return placement
            return NO_ROOM if placement.pool_reason in _NO_ROOM_REASONS else placement

        queue = self._queues.get(pool)
        tried = False
        if queue is None or not queue.has_waiters():
            tried = True
            first = await self._try_endpoints(
                request, tenant, settings, index, hashes, first_block, reserve_on
            )
            if queue is None or first.decision.admitted or first.pool_reason is None:
                return self._admitted(first, pool, tenant.name)
            if first.pool_reason is Reason.REQUEST_EXCEEDS_KV_BUDGET:
                return first  # no endpoint could ever hold it: waiting cannot help
        started = self._clock()
        if on_queued is not None:
            on_queued(queue.settings.max_wait_s)
        try:
            result = await queue.run(
                tenant=tenant.name,
                priority=priority,
                cost_tokens=request.cost_tokens,
                attempt=attempt,
                already_tried=tried,
            )
        except QueueRejected as rejected:
            reason = (
                Reason.QUEUE_WAIT_EXPIRED
                if rejected.reason == "wait_expired"
                else Reason.QUEUE_FULL
            )
            detail = (
                f"No endpoint of '{pool}' had room for this request within "
                f"{rejected.waited_s:.1f} s of waiting."
                if reason is Reason.QUEUE_WAIT_EXPIRED
                else f"Too many requests are waiting for '{pool}' ({rejected.reason})."
            )
            return Placement(
                decision=Decision(
                    admitted=False,
                    reason=reason,
                    detail=detail,
                    retry_after_s=rejected.retry_after_s,
                ),
                pool_reason=reason,
                retry_after_s=rejected.retry_after_s,
                detail=detail,
            )
        assert not isinstance(result, NoRoom)
        return self._admitted(replace(result, queued_s=self._clock() - started), pool, tenant.name)

    def _admitted(self, placement: Placement, pool: str, tenant: str) -> Placement:
        decision = placement.decision
        if decision.admitted and decision.reservation is not None:
            if self._metrics is not None and placement.endpoint is not None:
                self._metrics.pool_picks.labels(
                    pool,
                    placement.endpoint.address,
                    "hit" if placement.affinity_blocks else "miss",
                ).inc()
            queue = self._queues.get(pool)
            if queue is not None:
                request = decision.reservation.request
                queue.charge(tenant, request.prompt_tokens, request.reserved_output_tokens)
        return placement

    async def _try_endpoints(
        self,
        request: AdmissionRequest,
        tenant: TenantPolicy,
        settings: BackendConfig,
        index: PrefixIndex,
        hashes: list[int],
        first_block: str,
        reserve_on: ReserveOn,
    ) -> Placement:
        view = self._pools.view(settings.name)
        if not view.pickable:
            if not view.degraded or view.shedding:
                return self._nothing_pickable(view, settings)
            # Every endpoint fails its checks or is stale, but their budgets are known: admit
            # against kvgate's own reservations rather than halt the pool. A dead pod's
            # request fails upstream (nothing charged) and frees its reservation.
            view = replace(view, pickable=view.degraded)
            if self._metrics is not None:
                self._metrics.pool_degraded_picks.labels(settings.name).inc()
        by_key = {endpoint.key: endpoint for endpoint in view.pickable}
        remembered = index.endpoints()
        if len(remembered) > view.members:
            # Some endpoint left the pool (DNS): its cache went with it.
            members = {
                f"{settings.name}/{address}" for address in self._pools.members(settings.name)
            }
            for key in remembered:
                if key not in members:
                    index.forget(key)
        matched = index.matches(hashes) if hashes else {}
        loads = await self._loads(view)
        picking = settings.picking
        order = rank_endpoints(
            loads,
            need_kv_tokens=view.pickable[0].limits.round_to_blocks(request.cost_tokens),
            matched_blocks=matched,
            total_blocks=len(hashes),
            weights=PickWeights(
                affinity=picking.affinity_weight,
                load=1.0 - picking.affinity_weight,
                load_gate=picking.load_gate,
            ),
            tie_break=rendezvous_order(first_block, list(by_key)) if first_block else (),
        )
        refusals: list[Decision] = []
        for key in order:
            endpoint = by_key[key]
            decision = await reserve_on(replace(request, backend=key), endpoint.limits)
            if not decision.admitted:
                decision = _endpoint_unnamed(decision, key, settings.name)
            if decision.admitted:
                self._status.pop(key, None)  # our own view of it is stale now
                if hashes:
                    index.record(hashes, key)
                return Placement(
                    decision=decision, endpoint=endpoint, affinity_blocks=matched.get(key, 0)
                )
            if decision.reason not in _NO_ROOM_REASONS or any(
                not v.shadow for v in decision.violations
            ):
                # A tenant limit (or the store) refused: no other endpoint changes that.
                return Placement(decision=decision)
            refusals.append(decision)
        return _pool_full(refusals, settings.name)

    def _nothing_pickable(self, view: PoolView, settings: BackendConfig) -> Placement:
        if view.shedding:
            # The answer goes to the client: the pool's name, never an endpoint's address.
            _, verdict = view.shedding[0]
            retry = settings.backpressure.retry_after_s if settings.backpressure else 2.0
            detail = f"Every endpoint of '{settings.name}' is overloaded ({verdict.detail})."
            return Placement(
                decision=Decision(
                    admitted=False,
                    reason=Reason.BACKEND_OVERLOADED,
                    retry_after_s=retry,
                    detail=detail,
                ),
                pool_reason=Reason.KV_BUDGET_EXHAUSTED,  # queueable: the pool is busy
                retry_after_s=retry,
                detail=detail,
            )
        interval = settings.discovery.interval_s if settings.discovery else 2.0
        if view.capacity_unknown and not view.unhealthy:
            raise PoolUnavailable(
                Reason.CAPACITY_UNKNOWN,
                f"The KV capacity of the endpoints of '{settings.name}' is not known yet.",
                max(1.0, interval),
            )
        raise PoolUnavailable(
            Reason.NO_HEALTHY_ENDPOINT,
            f"No endpoint of '{settings.name}' is healthy "
            f"({view.members} known, {view.unhealthy} failing their checks).",
            max(1.0, interval),
        )

    async def _loads(self, view: PoolView) -> list[EndpointLoad]:
        now = self._clock()
        if now - self._status_at >= self._status_ttl_s or any(
            endpoint.key not in self._status for endpoint in view.pickable
        ):
            try:
                statuses = await self._backend_status()
                self._status = {status.name: status for status in statuses}
                self._status_at = now
            except Exception:
                # The ranking is a guess anyway; the reserve itself decides.
                log.debug("backend status unavailable for picking", exc_info=True)
        loads = []
        for endpoint in view.pickable:
            status = self._status.get(endpoint.key)
            loads.append(
                EndpointLoad(
                    key=endpoint.key,
                    kv_budget_tokens=endpoint.limits.kv_budget_tokens,
                    kv_tokens_in_flight=status.kv_tokens_in_flight if status else 0,
                    requests_in_flight=status.requests_in_flight if status else 0,
                    max_concurrent_requests=endpoint.limits.max_concurrent_requests,
                    waiting=endpoint.waiting,
                )
            )
        return loads

    def on_settled(self, ticket: Ticket, usage: ActualUsage) -> None:
        """A settlement freed `ticket`'s reservation (the settler's release hook). On a
        pool: the tenant's fair-share counter, charged the reserved output at admission, is
        corrected to the output it really got, and the queue gets a turn."""
        pool = ticket.cluster
        if not self.is_pool(pool):
            return
        output_correction = usage.output_tokens - ticket.reservation.request.reserved_output_tokens
        self._status.clear()
        queue = self._queues.get(pool)
        if queue is not None:
            if output_correction:
                queue.charge(ticket.tenant, 0, output_correction)
            queue.notify_capacity_freed()

    def any_endpoint(self, pool: str) -> str | None:
        """An endpoint's address for a request that holds no reservation (vLLM's
        /tokenize): the pickable one with the shortest engine queue, else a degraded one
        (its metrics are stale, not necessarily its engine), else None."""
        view = self._pools.view(pool)
        if view.pickable:
            return min(view.pickable, key=lambda e: e.waiting or 0).address
        if view.degraded:
            return view.degraded[0].address
        return None

    def pool_views(self) -> list[PoolView]:
        """Every pool's endpoints now (for the gauges, read when /metrics is scraped)."""
        return [self._pools.view(name) for name in self._settings]


def _endpoint_unnamed(decision: Decision, key: str, pool: str) -> Decision:
    """An endpoint's refusal as the client may read it: the store names the endpoint's
    ledger (`pool/IP:PORT`), an internal address the answer must not carry."""
    if key not in decision.detail:
        return decision
    detail = decision.detail.replace(f"'{key}'", f"'{pool}' (one endpoint)").replace(key, pool)
    return replace(decision, detail=detail)


def _pool_full(refusals: list[Decision], pool: str) -> Placement:
    """Every pickable endpoint refused for lack of room."""
    if refusals and all(d.reason is Reason.REQUEST_EXCEEDS_KV_BUDGET for d in refusals):
        decision = refusals[0]
        return Placement(
            decision=decision,
            pool_reason=Reason.REQUEST_EXCEEDS_KV_BUDGET,
            detail=decision.detail,
        )
    waits = [d.retry_after_s for d in refusals if d.retry_after_s is not None]
    soonest = min(waits) if waits else None
    full = [d for d in refusals if d.reason is not Reason.REQUEST_EXCEEDS_KV_BUDGET]
    decision = replace(full[0], retry_after_s=soonest) if full else refusals[0]
    return Placement(
        decision=decision,
        pool_reason=Reason.KV_BUDGET_EXHAUSTED,
        retry_after_s=soonest,
        detail=f"No endpoint of '{pool}' has room for this request now.",
    )


def affinity_text(request: ParsedRequest, limit_chars: int) -> str:
    """The leading text that decides which endpoint's prefix cache a request can reuse:
    the tools, then each message's role and content in order (a chat template renders them
    in this order, so a shared history is a shared prefix), or a completion's first prompt.
    Built only up to `limit_chars`."""
    parts: list[str] = []
    size = 0

    def add(piece: str) -> bool:
        nonlocal size
        parts.append(piece)
        size += len(piece)
        return size >= limit_chars

    if request.kind == "chat":
        if request.tools and add(repr(request.tools)):
            return "".join(parts)[:limit_chars]
        for message in request.messages or []:
            content = message.get("content")
            if add(f"\x1e{message.get('role', '')}\x1f"):
                break
            if isinstance(content, str):
                if add(content):
                    break
            elif content is not None and add(repr(content)):
                break
    else:
        prompts = request.prompts()
        if prompts:
            first = prompts[0]
            add(first if isinstance(first, str) else ",".join(map(str, first)))
    return "".join(parts)[:limit_chars]
