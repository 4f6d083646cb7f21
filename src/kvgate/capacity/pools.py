"""Pools: a backend served by several vLLM endpoints, each with its own KV budget.

Membership is a static list or comes from DNS (a Kubernetes headless Service resolves to one
address per ready pod), refreshed on an interval. Each endpoint is scraped on its own
(`discovery.metrics_url` with `{endpoint}`) for its KV budget (`kv_budget_tokens: auto`),
its back-pressure readings and its health. An endpoint whose last scrape failed, or whose
readings are older than `max_staleness_s`, is not picked; a pool without discovery trusts
its static list. Admission never halts on stale metrics: kvgate's own reservations are
what it admits against, the readings only steer which endpoint is tried.

Membership is a trust boundary: a discovered address outside `allowed_cidrs` never joins
(kvgate.capacity.membership), and an endpoint's own claim of its KV cache is capped at
`max_auto_kv_budget_tokens`. The static list is the operator's own word and is not filtered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.capacity.backpressure import BackpressurePolicy, BackpressureVerdict
from kvgate.capacity.discovery import CapacityMonitor, VllmCapacity
from kvgate.capacity.membership import AddressPolicy
from kvgate.config.model import BackendConfig, KvgateConfig, parse_endpoint_address
from kvgate.metrics import Metrics
from kvgate.policy import BackendLimits

log = logging.getLogger("kvgate.pools")


def endpoint_key(pool: str, address: str) -> str:
    """The store's name for one endpoint's KV ledger: unique across pools."""
    return f"{pool}/{address}"


@dataclass(frozen=True, slots=True)
class PoolEndpoint:
    pool: str
    # What Envoy's ORIGINAL_DST cluster connects to (x-kvgate-destination).
    address: str
    key: str
    limits: BackendLimits
    # The engine's own queue, when a fresh reading has it (the picker weighs it).
    waiting: int | None = None


@dataclass(frozen=True, slots=True)
class PoolView:
    """A pool's endpoints at one moment: those that may be picked, and why others may not."""

    pool: str
    pickable: tuple[PoolEndpoint, ...]
    members: int
    unhealthy: int
    # Failing or stale endpoints whose budget is known: tried only when none is pickable,
    # so the pool never halts because its metrics went stale (the store's reservations
    # still bound what each endpoint is given).
    degraded: tuple[PoolEndpoint, ...]
    shedding: tuple[tuple[str, BackpressureVerdict], ...]
    # Endpoints whose automatic KV budget was never read.
    capacity_unknown: int


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One pool endpoint as an operator sees it (``kvgate backends``, the admin API)."""

    address: str
    # Its KV ledger in the state store (``endpoint_key``).
    key: str
    # "ready", "degraded", "shedding", "unknown" or "down" (the admin API's PoolEndpoint).
    state: str
    # None while its automatic budget was never read.
    kv_budget_tokens: int | None
    # Seconds since its last good scrape; None: never scraped, or no metrics discovery.
    last_scrape_age_s: float | None
    engine_requests_waiting: int | None


class _Pool:
    """One pool's members and their monitors."""

    def __init__(
        self, settings: BackendConfig, clock: Callable[[], float], metrics: Metrics | None
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._metrics = metrics
        self.addresses: tuple[str, ...] = tuple(settings.endpoints or ())
        self.monitors: dict[str, CapacityMonitor] = {}
        # Discovered budgets (as reported; capped when read) stay in force while a scrape is
        # briefly stale (a GPU's block count changes only when its engine restarts).
        self.known_budget: dict[str, tuple[int, int]] = {}
        discovery = settings.endpoint_discovery
        self._address_policy = (
            AddressPolicy.from_cidrs(discovery.allowed_cidrs) if discovery is not None else None
        )
        # Refused addresses of the last answer and endpoints whose claim was capped: each is
        # logged and counted once while it lasts, not at every refresh or scrape.
        self._refused: set[str] = set()
        self._capped: set[str] = set()
        self.backpressure = (
            BackpressurePolicy(
                max_kv_cache_usage=settings.backpressure.max_kv_cache_usage,
                max_requests_waiting=settings.backpressure.max_requests_waiting,
            )
            if settings.backpressure is not None
            else None
        )
        self._resolver: asyncio.Task[None] | None = None

    async def start(self) -> None:
        discovery = self.settings.endpoint_discovery
        if discovery is not None:
            await self._resolve_once()
            self._resolver = asyncio.create_task(
                self._resolve_forever(discovery.refresh_s), name=f"pool-dns {self.settings.name}"
            )
        await self._sync_monitors()

    async def stop(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver
            self._resolver = None
        for monitor in self.monitors.values():
            await monitor.stop()
        self.monitors.clear()

    async def _resolve_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self._resolve_once():
                    await self._sync_monitors()
            except asyncio.CancelledError:
                raise
            except Exception:  # a resolver hiccup keeps the last membership
                log.exception("pool %s: refreshing endpoints failed", self.settings.name)

    async def _resolve_once(self) -> bool:
        """Refresh membership from DNS; True when it changed. A failed lookup keeps the
        last known members: an empty answer from a flapping resolver must not empty the
        pool."""
        discovery = self.settings.endpoint_discovery
        assert discovery is not None
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                discovery.dns_name, discovery.port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            log.warning(
                "pool %s: resolving %s failed: %s", self.settings.name, discovery.dns_name, exc
            )
            return False
        resolved = {
            f"[{info[4][0]}]:{discovery.port}"
            if info[0] == socket.AF_INET6
            else f"{info[4][0]}:{discovery.port}"
            for info in infos
        }
        found = sorted(self._admit(resolved, discovery.dns_name))
        if len(found) > discovery.max_endpoints:
            log.warning(
                "pool %s: %s resolves to %d addresses; using the first %d (max_endpoints)",
                self.settings.name,
                discovery.dns_name,
                len(found),
                discovery.max_endpoints,
            )
            found = found[: discovery.max_endpoints]
        if not found or tuple(found) == self.addresses:
            return False
        log.info("pool %s: endpoints now %s", self.settings.name, ", ".join(found))
        self.addresses = tuple(found)
        return True

    def _admit(self, resolved: set[str], dns_name: str) -> set[str]:
        """The resolved addresses allowed to join; the others counted and logged once."""
        assert self._address_policy is not None
        refusals: dict[str, str] = {}
        for address in resolved:
            host = address.rpartition(":")[0]
            reason = self._address_policy.refusal(host)
            if reason is not None:
                refusals[address] = reason
        new = sorted(set(refusals) - self._refused)
        self._refused = set(refusals)
        if new:
            shown = ", ".join(f"{a} ({refusals[a]})" for a in new[:8])
            more = f" and {len(new) - 8} more" if len(new) > 8 else ""
            log.warning(
                "pool %s: %s resolves to addresses refused as members "
                "(endpoint_discovery.allowed_cidrs): %s%s",
                self.settings.name,
                dns_name,
                shown,
                more,
            )
            if self._metrics is not None:
                for address in new:
                    self._metrics.pool_refused_addresses.labels(
                        self.settings.name, refusals[address]
                    ).inc()
        return resolved - set(refusals)

    def _observe_reading(self, address: str, reading: VllmCapacity) -> None:
        """Each scrape of an endpoint: count (and log once) a KV cache claim over the cap."""
        settings = self.settings
        reported = reading.kv_capacity_tokens
        cap = settings.max_auto_kv_budget_tokens
        if settings.kv_budget_tokens != "auto" or reported is None or reported <= cap:
            self._capped.discard(address)
            return
        key = endpoint_key(settings.name, address)
        if self._metrics is not None:
            self._metrics.kv_budget_capped_reports.labels(key).inc()
        if address not in self._capped:
            self._capped.add(address)
            log.warning(
                "pool %s: endpoint %s reports a KV cache of %d tokens, over "
                "max_auto_kv_budget_tokens; its budget is capped at %d",
                settings.name,
                address,
                reported,
                cap,
            )

    async def _sync_monitors(self) -> None:
        discovery = self.settings.discovery
        if discovery is None:
            return
        wanted = set(self.addresses)
        for address in list(self.monitors):
            if address not in wanted:
                await self.monitors.pop(address).stop()
                self.known_budget.pop(address, None)
                self._capped.discard(address)
        fresh: list[CapacityMonitor] = []
        for address in self.addresses:
            if address in self.monitors:
                continue
            monitor = CapacityMonitor(
                discovery.metrics_url.replace("{endpoint}", address),
                model_name=discovery.model_name,
                interval_s=discovery.interval_s,
                timeout_s=discovery.timeout_s,
                max_staleness_s=discovery.max_staleness_s,
                max_body_bytes=discovery.max_body_bytes,
                on_reading=functools.partial(self._observe_reading, address),
                clock=self._clock,
            )
            self.monitors[address] = monitor
            fresh.append(monitor)
        # First readings of new members in parallel: a budget at once when they are up.
        await asyncio.gather(*(monitor.poll_once() for monitor in fresh))
        for monitor in fresh:
            await monitor.start()

    def view(self, now: float) -> PoolView:
        settings = self.settings
        pickable: list[PoolEndpoint] = []
        degraded: list[PoolEndpoint] = []
        unhealthy = unknown = 0
        shedding: list[tuple[str, BackpressureVerdict]] = []
        for address in self.addresses:
            key = endpoint_key(settings.name, address)
            monitor = self.monitors.get(address)
            reading = None
            healthy = True
            if monitor is not None:
                reading = monitor.latest(now)
                # The last scrape failed, or nothing fresh: the endpoint is presumed down.
                healthy = reading is not None and monitor.consecutive_failures == 0
            budget, block = settings.kv_budget_tokens, settings.kv_block_size
            if budget == "auto":
                if reading is not None and reading.kv_capacity_tokens and reading.block_size:
                    self.known_budget[address] = (reading.kv_capacity_tokens, reading.block_size)
                known = self.known_budget.get(address)
                if known is None:
                    if healthy:
                        unknown += 1
                    else:
                        unhealthy += 1  # down, and never read: nothing to fall back on
                    continue
                # The endpoint's own claim, never above what the operator allows.
                budget, block = min(known[0], settings.max_auto_kv_budget_tokens), known[1]
            endpoint = PoolEndpoint(
                pool=settings.name,
                address=address,
                key=key,
                limits=BackendLimits(
                    name=key,
                    kv_budget_tokens=int(budget),
                    kv_block_size=block,
                    max_concurrent_requests=settings.max_concurrent_requests,
                ),
                waiting=reading.num_requests_waiting if reading is not None else None,
            )
            if not healthy:
                unhealthy += 1
                degraded.append(endpoint)
                continue
            if self.backpressure is not None:
                verdict = self.backpressure.evaluate(reading)
                if verdict.shed:
                    shedding.append((key, verdict))
                    continue
            pickable.append(endpoint)
        return PoolView(
            pool=settings.name,
            pickable=tuple(pickable),
            members=len(self.addresses),
            unhealthy=unhealthy,
            degraded=tuple(degraded),
            shedding=tuple(shedding),
            capacity_unknown=unknown,
        )

    def endpoint_states(self, now: float) -> list[EndpointState]:
        """Every member's state, in the terms the picker uses (``view``)."""
        view = self.view(now)
        listed: dict[str, tuple[str, PoolEndpoint]] = {}
        for endpoint in view.pickable:
            listed[endpoint.address] = ("ready", endpoint)
        for endpoint in view.degraded:
            listed[endpoint.address] = ("degraded", endpoint)
        shedding = {key for key, _ in view.shedding}
        states = []
        for address in self.addresses:
            key = endpoint_key(self.settings.name, address)
            monitor = self.monitors.get(address)
            reading = monitor.latest(now) if monitor is not None else None
            found = listed.get(address)
            if found is not None:
                state = found[0]
                budget: int | None = found[1].limits.kv_budget_tokens
            else:
                budget = self._known_budget(address)
                if key in shedding:
                    state = "shedding"
                elif monitor is None or monitor.consecutive_failures == 0:
                    state = "unknown"  # answering, but its automatic budget was never read
                else:
                    state = "down"
            last_success = monitor.last_success_at if monitor is not None else None
            states.append(
                EndpointState(
                    address=address,
                    key=key,
                    state=state,
                    kv_budget_tokens=budget,
                    last_scrape_age_s=None if last_success is None else now - last_success,
                    engine_requests_waiting=(
                        reading.num_requests_waiting if reading is not None else None
                    ),
                )
            )
        return states

    def _known_budget(self, address: str) -> int | None:
        budget = self.settings.kv_budget_tokens
        if budget != "auto":
            return int(budget)
        known = self.known_budget.get(address)
        if known is None:
            return None
        return min(known[0], self.settings.max_auto_kv_budget_tokens)


class PoolRegistry:
    """Every pool's live membership and per-endpoint readings."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        self._pools: dict[str, _Pool] = {}

    async def sync(self, config: KvgateConfig) -> None:
        """Start, restart or stop pools to match the configuration (start-up, reload)."""
        wanted = {b.name: b for b in config.backends if b.is_pool}
        for name in list(self._pools):
            if name not in wanted or _restart_needed(self._pools[name].settings, wanted[name]):
                await self._pools.pop(name).stop()
        for name, settings in wanted.items():
            pool = self._pools.get(name)
            if pool is None:
                pool = _Pool(settings, self._clock, self._metrics)
                self._pools[name] = pool
                await pool.start()
            else:
                pool.settings = settings  # limits, picking and queue apply to new work

    def is_pool(self, backend: str) -> bool:
        return backend in self._pools

    def view(self, pool: str) -> PoolView:
        return self._pools[pool].view(self._clock())

    def endpoint_states(self, pool: str) -> list[EndpointState]:
        return self._pools[pool].endpoint_states(self._clock())

    def readings(self) -> dict[str, VllmCapacity]:
        """The latest fresh reading of each endpoint's engine, by its ledger
        (``pool/IP:PORT``), for reconciliation."""
        now = self._clock()
        found: dict[str, VllmCapacity] = {}
        for name, pool in self._pools.items():
            for address, monitor in pool.monitors.items():
                reading = monitor.latest(now)
                if reading is not None:
                    found[endpoint_key(name, address)] = reading
        return found

    def members(self, pool: str) -> Sequence[str]:
        return self._pools[pool].addresses

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.stop()
        self._pools.clear()


def _restart_needed(old: BackendConfig, new: BackendConfig) -> bool:
    """Membership sources or scraping changed: rebuild the pool (its monitors)."""
    return (
        old.endpoints != new.endpoints
        or old.endpoint_discovery != new.endpoint_discovery
        or old.discovery != new.discovery
        or old.backpressure != new.backpressure
    )


__all__ = ["PoolEndpoint", "PoolRegistry", "PoolView", "endpoint_key", "parse_endpoint_address"]
