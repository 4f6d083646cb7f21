"""The shared state store: Redis, one atomic Lua script per operation.

Several kvgate replicas pointed at one Redis enforce one set of limits. Each admission is one
round trip (`reserve.lua`: sweep expired leases, check every limit, reserve on all of them or
none) and so is each settlement (`settle.lua`); a pre-check that takes the tenant's RPM request
before the prompt is tokenized (`precheck.lua`) is one more. Time comes from Redis `TIME`
inside the script, so replicas with skewed clocks agree; tests inject a clock instead.

The decision is taken by the script; the explanation (which limit, the message, Retry-After,
the x-ratelimit-* view) is produced here by the policy's own `admit()` run over the exact state
the script checked, so the Redis store and the memory store answer with the same words. If the
two ever disagree on the outcome, that is a bug and is raised as `StoreInconsistency`.

Key layout, money representation and failure handling: docs/redis.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BackendStatus,
    Clock,
    Decision,
    Period,
    Reservation,
    ScopeLimits,
    SettleCause,
    Settlement,
    TenantHold,
    TenantPolicy,
    TenantState,
    TokenBucket,
    UsageTotals,
    admit,
    period_key,
    precheck,
)
from kvgate.policy.kv import new_reservation
from kvgate.policy.tenant import TENANT_SCOPE, ScopeState
from kvgate.store.base import (
    ABANDON_RETENTION_S,
    BILL_RETENTION_S,
    ExpiredLeaseHook,
    TenantUsage,
    abandoned_decision,
)
from kvgate.store.errors import StoreUnavailable

log = logging.getLogger("kvgate.store.redis")

_T = TypeVar("_T")

# Errors that mean "Redis cannot answer right now" (the failure policy applies), as opposed to
# a bug (a script error), which propagates as is.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    rex.ConnectionError,  # incl. BusyLoadingError (restarting), MaxConnectionsError, sentinel
    rex.TimeoutError,
    rex.ClusterError,
    rex.TryAgainError,
    rex.ReadOnlyError,  # a replica promoted / failover in progress
    rex.OutOfMemoryError,
    rex.RedisClusterException,
    OSError,
    TimeoutError,  # asyncio.timeout
)


def _script(name: str) -> str:
    lua = resources.files("kvgate.store") / "lua"
    return (
        (lua / "lib.lua").read_text(encoding="utf-8")
        + "\n"
        + (lua / name).read_text(encoding="utf-8")
    )


def hash_tag(prefix: str) -> str:
    """`{prefix}`: every key of a deployment shares it, so all live in one Cluster slot."""
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError("the Redis key prefix must be non-empty and contain no braces")
    return "{" + prefix + "}"


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """How to reach Redis (built by the composition root from the configuration)."""

    url: str
    key_prefix: str = "kvgate"
    connect_timeout_s: float = 0.25
    timeout_s: float = 0.25
    cluster: bool = False
    sentinel_master: str | None = None
    sentinel_nodes: tuple[tuple[str, int], ...] = ()
    sentinel_password: str | None = dataclasses.field(default=None, repr=False)
    # The password (for Sentinel: the master's) when the URL carries none, read by the
    # composition root from redis.password_env / redis.password_file.
    password: str | None = dataclasses.field(default=None, repr=False)
    # Calls in flight at once per replica (and connections per Redis node); more wait their
    # turn, within the same timeout.
    max_connections: int = 64
    # How long the ids of requests admitted by the local fallback are remembered once their
    # usage is booked (deduplicates a redelivery after a timed-out delivery). Settlements of
    # Redis reservations need no window: their billing record is consumed once.
    settled_id_retention_s: float = BILL_RETENTION_S


def connect(settings: RedisSettings) -> aioredis.Redis | RedisCluster:
    """A client with bounded socket timeouts and no automatic retries.

    Retries are off on purpose: a retried script could be applied twice (the first reply may
    have been lost, not the call), and they would stretch a request's wait past the timeout.
    The store's callers decide what to do after a failure.
    """
    credentials: dict[str, Any] = {}
    if settings.password is not None:
        credentials["password"] = settings.password  # a password in the URL wins
    common: dict[str, Any] = {
        "socket_timeout": settings.timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": settings.max_connections,
        "health_check_interval": 0,
    }
    if settings.cluster:
        return RedisCluster.from_url(
            settings.url,
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=settings.max_connections,
            **credentials,
        )
    if settings.sentinel_master:
        # The URL gives the master's credentials, database and TLS; its host is not used.
        pool_kwargs = aioredis.ConnectionPool.from_url(settings.url).connection_kwargs
        master_kwargs = {
            k: v
            for k, v in pool_kwargs.items()
            if k in ("username", "password", "db", "ssl", "ssl_cert_reqs", "ssl_ca_certs")
        }
        if master_kwargs.get("password") is None:
            master_kwargs.update(credentials)
        sentinel = Sentinel(
            list(settings.sentinel_nodes),
            sentinel_kwargs={
                "socket_timeout": settings.timeout_s,
                "socket_connect_timeout": settings.connect_timeout_s,
                "password": settings.sentinel_password,
            },
        )
        # redis-py leaves master_for unannotated; it builds its redis_class, Redis by default.
        return cast(
            aioredis.Redis, sentinel.master_for(settings.sentinel_master, **common, **master_kwargs)
        )
    return aioredis.Redis.from_url(settings.url, **common, **credentials)


class StoreInconsistency(RuntimeError):
    """The script and the policy disagree about a decision (a bug, never expected)."""


class _BackendView:
    """A backend as the reserve script saw it (policy `BackendView`): its counts, and the
    Retry-After estimates the script computed over the in-flight leases."""

    def __init__(self, limits: BackendLimits, result: Mapping[str, Any]) -> None:
        self.limits = limits
        self.requests_in_flight = int(result["n"])
        self.kv_tokens_in_flight = int(result["kvin"])
        self._waits = {k: float(result[k]) for k in ("w_slot", "w_kv", "w_tenant") if k in result}

    def seconds_until_freed(
        self,
        now: float,
        kv_needed: int,
        slots_needed: int = 0,
        tenant: str | None = None,
    ) -> float:
        key = "w_tenant" if tenant is not None else "w_slot" if slots_needed else "w_kv"
        try:
            return self._waits[key]
        except KeyError:
            raise StoreInconsistency(f"the reserve script did not estimate {key}") from None

    def commit(
        self,
        request: AdmissionRequest,
        reservation_id: str,
        now: float,
        lease_ttl_s: float,
        hold: TenantHold | None = None,
    ) -> Reservation:
        # The script made the reservation already; this is its record.
        return new_reservation(self.limits, request, reservation_id, now, lease_ttl_s, hold)


def _rule(limits: ScopeLimits, key: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"k": key}
    if limits.rpm is not None:
        rule["r"] = [limits.rpm.spec.capacity, limits.rpm.spec.refill_per_s, limits.rpm.shadow]
    if limits.tpm is not None:
        rule["t"] = [limits.tpm.spec.capacity, limits.tpm.spec.refill_per_s, limits.tpm.shadow]
    if limits.concurrency is not None:
        rule["c"] = [limits.concurrency.limit, limits.concurrency.shadow]
    return rule


def _policy_rules(policy: TenantPolicy) -> str:
    """Every scope's rules of a tenant (what a sweep of its leases settles against)."""
    rules = [_rule(policy.limits, TENANT_SCOPE)]
    rules += [_rule(limits, model) for model, limits in sorted(policy.model_limits.items())]
    rules += [_rule(level.limits, level.scope_key) for level in policy.levels]
    return json.dumps(rules, separators=(",", ":"))


def _level_args(policy: TenantPolicy) -> dict[str, Any]:
    """The caller's levels for the scripts: "lv" their scope keys (each holds the request's
    money), "lb" their budgets [scope, period, cap, shadow] (always "block")."""
    return {
        "lv": list(policy.level_scope_keys()),
        "lb": [
            [level.scope_key, rule.period.value, str(rule.cap_pico), rule.shadow]
            for level in policy.levels
            for rule in level.budgets
        ],
    }


def _tenant_state(
    scopes: Sequence[tuple[str, ScopeLimits]],
    result: Mapping[str, Any],
    levels: Sequence[str] = (),
) -> TenantState:
    """The tenant's state exactly as the script checked it (before any reservation)."""
    state = TenantState()
    for (key, limits), snap in zip(scopes, result["sc"], strict=True):
        scope = ScopeState(in_flight=int(snap["n"]))
        if limits.rpm is not None and "r" in snap:
            level, at = snap["r"]
            scope.requests = TokenBucket(limits.rpm.spec, float(level), float(at))
        if limits.tpm is not None and "t" in snap:
            level, at = snap["t"]
            scope.tokens = TokenBucket(limits.tpm.spec, float(level), float(at))
        state.scopes[key] = scope
    day, month = result["dk"], result["mk"]
    state.spent = {day: int(result["sp"][0]), month: int(result["sp"][1])}
    state.reserved = {day: int(result["rs"][0]), month: int(result["rs"][1])}
    for scope_key, money in zip(levels, _list(result.get("lm")), strict=True):
        spent_day, reserved_day, spent_month, reserved_month = (int(x) for x in money)
        state.level_spent[(scope_key, day)] = spent_day
        state.level_reserved[(scope_key, day)] = reserved_day
        state.level_spent[(scope_key, month)] = spent_month
        state.level_reserved[(scope_key, month)] = reserved_month
    return state


def _reservation_from_record(
    backend: str, reservation_id: str, expires: str, raw: str
) -> Reservation:
    rec = json.loads(raw.partition("\n")[2])  # after the "<started> <kv> <max new> <tenant>" line
    request = AdmissionRequest(
        request_id=rec["rid"],
        tenant=rec["t"],
        model=rec["m"],
        backend=backend,
        prompt_tokens=int(rec["p"]),
        max_new_tokens=int(rec["x"]),
        choices=int(rec["c"]),
        cost_pico=int(rec["cost"]),
        request_slot_taken=bool(rec.get("pre")),
    )
    hold = TenantHold(
        model=rec["m"],
        tokens=int(rec["tk"]),
        cost_pico=int(rec["cost"]),
        period_keys=((Period.DAY, rec["dk"]), (Period.MONTH, rec["mk"])),
        concurrency_scopes=tuple(rec["sc"] or ()),
        request_slot_taken=bool(rec.get("pre")),
        level_scopes=tuple(_list(rec.get("lv"))),
    )
    return Reservation(
        reservation_id=reservation_id,
        request=request,
        kv_tokens=int(rec["kv"]),
        started_at=float(rec["s"]),
        expires_at=float(expires),
        hold=hold,
    )


def _list(value: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}.
    return value if isinstance(value, list) else []


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


_TOTAL_FIELDS = {
    "req": "requests",
    "pt": "prompt_tokens",
    "ot": "output_tokens",
    "ct": "cached_tokens",
    "cost": "cost_pico",
    "hit": "cache_hits",
    "hst": "cache_saved_tokens",
}


def _add_field(totals: UsageTotals, field: str, value: bytes | str) -> None:
    name = _TOTAL_FIELDS.get(field)
    if name is not None:
        setattr(totals, name, int(_text(value)))


class RedisStore:
    """`StateStore` on Redis. Every call is bounded by `timeout_s` (socket timeouts plus an
    overall deadline) and raises `StoreUnavailable` rather than hang."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        lease_ttl_s: float,
        key_prefix: str = "kvgate",
        timeout_s: float = 0.25,
        max_in_flight: int = 64,
        settled_id_retention_s: float = BILL_RETENTION_S,
        clock: Clock | None = None,
        on_lease_expired: ExpiredLeaseHook | None = None,
        bill_retention_s: float = BILL_RETENTION_S,
        abandon_retention_s: float = ABANDON_RETENTION_S,
    ) -> None:
        self._client = client
        # redis-py's pool fails (not waits) when it runs out of connections: queue here
        # instead, within each call's deadline. Keep it at most the pool's size.
        self._slots = asyncio.Semaphore(max_in_flight)
        # redis-py's asyncio RedisCluster can break connections when many commands arrive
        # before it has loaded the slot map (seen with 8.1): load it once, first.
        self._cluster_ready = not isinstance(client, RedisCluster)
        self._cluster_lock = asyncio.Lock()
        self._tag = hash_tag(key_prefix)
        # KEYS[1] of every script: routes the call (Cluster) and names its slot.
        self._route_key = f"{self._tag}:leases"
        self._lease_ttl_s = lease_ttl_s
        self._timeout_s = timeout_s
        self._settled_id_retention_s = settled_id_retention_s
        self._bill_retention_s = max(bill_retention_s, lease_ttl_s)
        self._abandon_retention_s = abandon_retention_s
        # None in production: the scripts read Redis TIME. A test clock is sent as ARGV.
        self._clock = clock
        self._on_lease_expired = on_lease_expired
        self._reserve = client.register_script(_script("reserve.lua"))
        self._precheck = client.register_script(_script("precheck.lua"))
        self._settle = client.register_script(_script("settle.lua"))
        self._renew = client.register_script(_script("renew.lua"))
        self._abandon = client.register_script(_script("abandon.lua"))
        self._status = client.register_script(_script("status.lua"))
        self._usage = client.register_script(_script("usage.lua"))

    @classmethod
    def from_settings(
        cls,
        settings: RedisSettings,
        *,
        lease_ttl_s: float,
        clock: Clock | None = None,
        on_lease_expired: ExpiredLeaseHook | None = None,
    ) -> RedisStore:
        return cls(
            connect(settings),
            lease_ttl_s=lease_ttl_s,
            key_prefix=settings.key_prefix,
            timeout_s=settings.timeout_s,
            max_in_flight=settings.max_connections,
            settled_id_retention_s=settings.settled_id_retention_s,
            clock=clock,
            on_lease_expired=on_lease_expired,
        )

    @property
    def key_tag(self) -> str:
        return self._tag

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        """The connection pool (shared with the idempotency keys, under the same tag)."""
        return self._client

    # ------------------------------------------------------------------ plumbing

    async def _bounded(self, op: str, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            async with asyncio.timeout(self._timeout_s), self._slots:
                if not self._cluster_ready:
                    await self._initialize_cluster()
                return await call()
        except UNAVAILABLE_ERRORS as exc:
            raise StoreUnavailable(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc

    async def _initialize_cluster(self) -> None:
        async with self._cluster_lock:
            if not self._cluster_ready and isinstance(self._client, RedisCluster):
                await self._client.initialize()
                self._cluster_ready = True

    async def _run(self, op: str, script: Any, args: dict[str, Any], *extra: str) -> Any:
        if self._clock is not None:
            args["now"] = self._clock.now()
            args["wall"] = self._clock.wall()
        payload = json.dumps(args, separators=(",", ":"))
        raw = await self._bounded(
            op, lambda: script(keys=[self._route_key], args=[self._tag, payload, *extra])
        )
        return json.loads(raw) if isinstance(raw, bytes | str) else raw

    def _report_expired(self, swept: Any) -> None:
        if self._on_lease_expired is None:
            return
        for backend, reservation_id, expires, raw in _list(swept):
            try:
                reservation = _reservation_from_record(backend, reservation_id, expires, raw)
            except (KeyError, TypeError, ValueError):
                log.exception("unreadable expired lease", extra={"reservation_id": reservation_id})
                continue
            self._on_lease_expired(reservation)

    async def ping(self) -> None:
        await self._bounded("ping", self._client.ping)

    # ------------------------------------------------------------------ StateStore

    async def reserve(
        self, request: AdmissionRequest, backend: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        reservation_id = uuid.uuid4().hex
        scopes = tenant.scopes(request.model)
        result = await self._run(
            "reserve",
            self._reserve,
            {
                "id": reservation_id,
                "ttl": self._lease_ttl_s,
                "keep": self._bill_retention_s,
                "rid": request.request_id,
                "t": request.tenant,
                "m": request.model,
                # As the memory store: the ledger is the limits' backend; settle and renew
                # find the lease by the request's backend (the same name in real use).
                "b": backend.name,
                "p": request.prompt_tokens,
                "x": request.max_new_tokens,
                "c": request.choices,
                "tk": request.cost_tokens,
                "kv": backend.round_to_blocks(request.cost_tokens),
                "cost": str(request.cost_pico),
                "kvb": backend.kv_budget_tokens,
                "mc": backend.max_concurrent_requests,
                "sc": [_rule(limits, key) for key, limits in scopes],
                "bu": [[r.period.value, str(r.cap_pico), r.shadow] for r in tenant.budgets],
                # `request_slot_taken` (the pre-check took the RPM request: not checked nor
                # taken again). "pre" is its name on the wire and in the stored record, read
                # back by `_reservation_from_record` and the Lua scripts (`a.pre`, `rec.pre`).
                "pre": request.request_slot_taken,
                **_level_args(tenant),
            },
            _policy_rules(tenant),
        )
        self._report_expired(result.get("exp"))
        if result.get("ab"):
            return abandoned_decision(request)
        decision = admit(
            request,
            backend=_BackendView(backend, result),
            policy=tenant,
            state=_tenant_state(scopes, result, tenant.level_scope_keys()),
            reservation_id=reservation_id,
            now=float(result["now"]),
            wall=float(result["wall"]),
            lease_ttl_s=self._lease_ttl_s,
        )
        admitted = bool(result["ok"])
        if decision.admitted != admitted:
            raise StoreInconsistency(
                f"reserve: the script {'admitted' if admitted else 'rejected'} request "
                f"{request.request_id!r}, the policy says {decision.reason.value}"
            )
        hold = decision.reservation.hold if decision.reservation else None
        if hold is not None and [k for _, k in hold.period_keys] != [result["dk"], result["mk"]]:
            raise StoreInconsistency(
                f"reserve: period keys differ ({hold.period_keys} vs {result['dk']}, "
                f"{result['mk']})"
            )
        return decision

    async def precheck(
        self,
        lower_bound: AdmissionRequest,
        backend: BackendLimits,
        tenant: TenantPolicy,
        *,
        take_request_slot: bool = False,
    ) -> Decision | None:
        if not take_request_slot or lower_bound.request_slot_taken:
            # Nothing to take: a read-only check would be a round trip for an answer the
            # reserve (one round trip too) gives anyway.
            return None
        scopes = tenant.scopes(lower_bound.model)
        result = await self._run(
            "precheck",
            self._precheck,
            {
                "t": lower_bound.tenant,
                "b": backend.name,
                "tk": lower_bound.cost_tokens,
                "cost": str(lower_bound.cost_pico),
                "sc": [_rule(limits, key) for key, limits in scopes],
                "bu": [[r.period.value, str(r.cap_pico), r.shadow] for r in tenant.budgets],
                **_level_args(tenant),
            },
        )
        self._report_expired(result.get("exp"))
        decision = precheck(
            lower_bound,
            backend=_BackendView(backend, result),
            policy=tenant,
            state=_tenant_state(scopes, result, tenant.level_scope_keys()),
            now=float(result["now"]),
            wall=float(result["wall"]),
            take_request_slot=True,
        )
        taken = bool(result["ok"])
        if (decision is None) != taken:
            raise StoreInconsistency(
                f"precheck: the script {'took' if taken else 'refused'} request "
                f"{lower_bound.request_id!r}, the policy says "
                f"{'pass' if decision is None else decision.reason.value}"
            )
        return decision

    async def settle(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
    ) -> Settlement:
        return await self._settle_call(
            reservation, cause, usage, cost_pico=cost_pico, tenant=tenant, local=False
        )

    async def settle_local(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
    ) -> Settlement:
        """Book the usage of a request a replica admitted with its local store while Redis was
        down (it never had a reservation here): once per reservation id, remembered for
        `settled_id_retention_s` against a redelivery."""
        return await self._settle_call(
            reservation, cause, usage, cost_pico=cost_pico, tenant=tenant, local=True
        )

    async def _settle_call(
        self,
        reservation: Reservation,
        cause: SettleCause,
        usage: ActualUsage,
        *,
        cost_pico: int,
        tenant: TenantPolicy,
        local: bool,
    ) -> Settlement:
        request = reservation.request
        hold = reservation.hold
        model = hold.model if hold is not None else request.model
        if hold is not None and len(hold.period_keys) == 2:
            day, month = (key for _, key in hold.period_keys)
        else:
            wall = reservation.started_at
            day, month = period_key(Period.DAY, wall), period_key(Period.MONTH, wall)
        result = await self._run(
            "settle",
            self._settle,
            {
                "id": reservation.reservation_id,
                "b": request.backend,
                "t": request.tenant,
                "m": model,
                "dk": day,
                "mk": month,
                "pt": usage.prompt_tokens,
                "ot": usage.output_tokens,
                "ct": usage.cached_tokens,
                "cost": str(cost_pico),
                # Generation speed is learnt from generations (an embedding generates none).
                "completed": cause is SettleCause.COMPLETED and usage.output_tokens > 0,
                "loc": local,
                "keep": self._settled_id_retention_s,
                "sc": [_rule(limits, key) for key, limits in tenant.scopes(model)],
                # Levels whose spend a local admission books (`loc`); a Redis reservation's
                # levels are in its billing record.
                "lv": list(hold.level_scopes) if hold is not None else [],
            },
        )
        return Settlement(
            reservation_id=reservation.reservation_id,
            cause=cause,
            usage=usage,
            reserved_kv_tokens=reservation.kv_tokens,
            applied=bool(result["ok"]),
            duration_s=float(result["now"]) - reservation.started_at,
            cost_pico=cost_pico,
            lease_expired=bool(result["expired"]),
        )

    async def renew(self, reservation: Reservation) -> bool:
        return (await self.renew_many([reservation]))[0] == 1

    async def renew_many(
        self, reservations: Sequence[Reservation], *, revive: bool = False
    ) -> list[int]:
        """Renew several leases in one round trip: per lease 1 (extended), 0 (lost) or, with
        `revive`, 2 (it had lapsed while its request is still open, and is held again).
        `revive` is for replaying renewals after an outage (FallbackStore)."""
        if not reservations:
            return []
        result = await self._run(
            "renew",
            self._renew,
            {
                "l": [[r.reservation_id, r.request.backend] for r in reservations],
                "ttl": self._lease_ttl_s,
                "keep": self._bill_retention_s,
                "revive": revive,
            },
        )
        return [int(state) for state in _list(result)]

    async def abandon(self, request: AdmissionRequest) -> None:
        if not request.request_id:
            return  # nothing identifies it: its lease expires on its own
        await self._run(
            "abandon",
            self._abandon,
            {"t": request.tenant, "rid": request.request_id, "ab": self._abandon_retention_s},
        )

    async def backend_status(self) -> list[BackendStatus]:
        result = await self._run("status", self._status, {})
        self._report_expired(result.get("exp"))
        return [
            BackendStatus(
                name=name,
                kv_budget_tokens=int(budget),
                kv_tokens_in_flight=int(kv),
                requests_in_flight=int(count),
                max_concurrent_requests=int(max_concurrent),
            )
            for name, budget, kv, count, max_concurrent in sorted(_list(result.get("backends")))
        ]

    async def record_cache_hit(
        self, tenant: str, model: str, saved_tokens: int, period_keys: Iterable[str]
    ) -> None:
        # The same hashes and field names as settle.lua's ledger (`hit`, `hst` beside `req`,
        # `pt`, ...), one MULTI so a reader never sees the all-time and period rows disagree.
        def book() -> Any:
            pipe = self._client.pipeline(transaction=True)
            rows = [(f"{self._tag}:tot", f"{tenant}|{model}|")]
            rows += [(f"{self._tag}:l|{tenant}|{key}", f"{model}|") for key in period_keys]
            for key, prefix in rows:
                pipe.hincrby(key, prefix + "hit", 1)
                pipe.hincrby(key, prefix + "hst", saved_tokens)
            return pipe.execute()

        await self._bounded("record_cache_hit", book)

    async def usage_totals(self) -> dict[tuple[str, str], UsageTotals]:
        raw: dict[Any, Any] = await self._bounded(
            "usage_totals",
            lambda: self._client.hgetall(f"{self._tag}:tot"),
        )
        totals: dict[tuple[str, str], UsageTotals] = {}
        for name, value in raw.items():
            tenant, model, field = _text(name).rsplit("|", 2)
            _add_field(totals.setdefault((tenant, model), UsageTotals()), field, value)
        return totals

    async def backend_totals(self) -> dict[str, UsageTotals]:
        raw: dict[Any, Any] = await self._bounded(
            "backend_totals",
            lambda: self._client.hgetall(f"{self._tag}:btot"),
        )
        totals: dict[str, UsageTotals] = {}
        for name, value in raw.items():
            backend, field = _text(name).rsplit("|", 1)
            _add_field(totals.setdefault(backend, UsageTotals()), field, value)
        return totals

    async def tenant_usage(
        self, tenant: str, period_keys: Iterable[str], levels: Iterable[str] = ()
    ) -> TenantUsage:
        keys = sorted(set(period_keys))
        level_keys = sorted(set(levels))
        usage = TenantUsage()
        if not keys:
            return usage
        level_arg = json.dumps(level_keys)
        rows = await self._bounded(
            "tenant_usage",
            lambda: self._usage(keys=[self._route_key], args=[self._tag, tenant, level_arg, *keys]),
        )
        for key, spent, reserved, ledger, level_spent in rows:
            key = _text(key)
            for scope_key, value in zip(level_keys, _list(level_spent), strict=True):
                usage.level_spent_pico[(scope_key, key)] = int(_text(value))
            usage.spent_pico[key] = int(_text(spent))
            usage.reserved_pico[key] = int(_text(reserved))
            for name, value in zip(ledger[::2], ledger[1::2], strict=True):
                model, field = _text(name).rsplit("|", 1)
                _add_field(
                    usage.by_period_model.setdefault((key, model), UsageTotals()), field, value
                )
        return usage

    async def close(self) -> None:
        with contextlib.suppress(*UNAVAILABLE_ERRORS):
            await self._client.aclose()
