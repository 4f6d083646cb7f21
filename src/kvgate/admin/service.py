"""The kvgate.admin.v1.Admin servicer: the same numbers as /admin/usage, over gRPC."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

import grpc
import pydantic

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.capacity.pools import PoolRegistry
from kvgate.capacity.reconcile import Reconciler
from kvgate.config import SnapshotHolder
from kvgate.config.model import LevelConfig
from kvgate.config.snapshot import RuntimeSnapshot, compile_level
from kvgate.extproc.services import GatewayServices
from kvgate.keys import KeyDirectory, KeyRecord
from kvgate.lifecycle.usage_report import tenant_usage_report
from kvgate.policy import BackendLimits, BackendStatus, Level, LevelKind
from kvgate.reload import ConfigReloader
from kvgate.usage_records import RecordQuery, RecordSink, UsageRecord
from kvgate.usage_records.cli import money
from kvgate.usage_records.paging import BadPageToken, page_size, page_token, read_page_token

# A page read from the sink; past it the call answers UNAVAILABLE.
RECORDS_READ_TIMEOUT_S = 10.0
# A key id as the directory makes them (also the page token of ListKeys: the last id).
KEY_ID = re.compile(r"^key_[0-9a-f]{16}$")


def _period(entry: dict[str, Any]) -> admin_pb2.PeriodUsage:
    return admin_pb2.PeriodUsage(
        period=entry["period"],
        resets_in_seconds=entry["resets_in_s"],
        requests=entry["requests"],
        prompt_tokens=entry["prompt_tokens"],
        cached_prompt_tokens=entry["cached_prompt_tokens"],
        output_tokens=entry["output_tokens"],
        cost_usd=entry["cost_usd"],
        reserved_usd=entry["reserved_usd"],
        budget_usd=entry.get("budget_usd", ""),
        remaining_usd=entry.get("remaining_usd", ""),
        cache_hits=entry["cache_hits"],
        cache_saved_tokens=entry["cache_saved_tokens"],
        by_model=[
            admin_pb2.ModelUsage(
                model=model,
                requests=totals["requests"],
                prompt_tokens=totals["prompt_tokens"],
                cached_prompt_tokens=totals["cached_prompt_tokens"],
                output_tokens=totals["output_tokens"],
                cost_usd=totals["cost_usd"],
                cache_hits=totals["cache_hits"],
                cache_saved_tokens=totals["cache_saved_tokens"],
            )
            for model, totals in entry["by_model"].items()
        ],
    )


def _level_period(entry: dict[str, Any]) -> admin_pb2.LevelPeriod:
    return admin_pb2.LevelPeriod(
        period=entry["period"],
        cost_usd=entry["cost_usd"],
        budget_usd=entry.get("budget_usd", ""),
        remaining_usd=entry.get("remaining_usd", ""),
    )


def tenant_usage_message(report: dict[str, Any]) -> admin_pb2.TenantUsage:
    return admin_pb2.TenantUsage(
        tenant=report["tenant"],
        today=_period(report["today"]),
        this_month=_period(report["this_month"]),
        levels=[
            admin_pb2.LevelUsage(
                level=level["level"],
                name=level["name"],
                today=_level_period(level["today"]),
                this_month=_level_period(level["this_month"]),
            )
            for level in report.get("levels", ())
        ],
    )


def usage_record_message(record: UsageRecord) -> admin_pb2.UsageRecord:
    return admin_pb2.UsageRecord(
        record_id=record.record_id,
        request_id=record.request_id,
        occurred_at=record.occurred_at_utc.isoformat(),
        ledger_day=record.ledger_day,
        ledger_month=record.ledger_month,
        tenant=record.tenant,
        api=record.api,
        path=record.path,
        requested_model=record.requested_model,
        served_model=record.served_model,
        backend=record.backend,
        endpoint=record.endpoint,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        output_tokens=record.output_tokens,
        reasoning_tokens=record.reasoning_tokens,
        cost_usd=money(record.cost_pico),
        pricing_version=record.pricing_version,
        answer_source=record.answer_source.value,
        status=record.status,
        settle_cause=record.settle_cause,
        booked_request=record.booked_request,
        cache_hit=record.cache_hit,
        saved_tokens=record.saved_tokens,
        route=record.route,
        decision_ms=record.decision_ms,
        ttft_ms=record.ttft_ms,
        duration_ms=record.duration_ms,
        team_id=record.team_id,
        user_id=record.user_id,
        key_id=record.key_id,
    )


def api_key_message(record: KeyRecord, now: float) -> admin_pb2.ApiKey:
    refusal = record.refusal(now)
    return admin_pb2.ApiKey(
        key_id=record.key_id,
        tenant=record.tenant,
        team=record.team,
        user=record.user,
        labels=dict(record.labels),
        created_at_unix_s=record.created_at,
        expires_at_unix_s=record.expires_at,
        revoked_at_unix_s=record.revoked_at,
        limits_json=(
            json.dumps(record.limits.model_dump(mode="json", exclude_defaults=True))
            if record.limits is not None
            else ""
        ),
        state=refusal.value if refusal is not None else "active",
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(
        self,
        services: GatewayServices,
        snapshots: SnapshotHolder,
        reloader: ConfigReloader | None,
        pools: PoolRegistry,
        reconciler: Reconciler,
        usage_records: RecordSink | None = None,
    ) -> None:
        # A reader of the usage record sink (its own connection: the writer's may be busy
        # with a batch); None when records are off.
        self._usage_records = usage_records
        self._services = services
        self._snapshots = snapshots
        self._reloader = reloader
        self._pools = pools
        self._reconciler = reconciler

    async def GetTenantUsage(  # the gRPC method name
        self,
        request: admin_pb2.GetTenantUsageRequest,
        context: grpc.aio.ServicerContext[admin_pb2.GetTenantUsageRequest, admin_pb2.TenantUsage],
    ) -> admin_pb2.TenantUsage:
        snapshot = self._snapshots.current
        if request.tenant not in snapshot.tenants:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tenant '{request.tenant}'")
        levels = await self._levels(request, snapshot, context)
        report = await tenant_usage_report(
            self._services.store, self._services.clock, snapshot, request.tenant, levels
        )
        return tenant_usage_message(report)

    async def _levels(
        self,
        request: admin_pb2.GetTenantUsageRequest,
        snapshot: RuntimeSnapshot,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> list[Level]:
        """The levels a usage request names, with their budgets where they have any (a
        team, user or key without limits of its own still has its spend)."""
        tenant = request.tenant
        levels = [
            next(iter(snapshot.levels(tenant, team, None)), None) or Level(LevelKind.TEAM, team)
            for team in request.teams
        ]
        levels += [
            next(iter(snapshot.levels(tenant, None, user)), None) or Level(LevelKind.USER, user)
            for user in request.users
        ]
        for key_id in request.key_ids:
            keys = await self._keys(context)
            key_id = await self._key_id(key_id, context)
            try:
                record = await keys.get(key_id)
            except Exception as exc:  # the store's own errors, whatever the store
                await self._unavailable(context, exc)
            if record is None or record.tenant != tenant:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no key '{key_id}' of {tenant}")
            assert record is not None
            levels.append(
                compile_level(LevelKind.KEY, key_id, record.limits)
                if record.limits is not None
                else Level(LevelKind.KEY, key_id)
            )
        return levels

    async def ListTenantUsage(
        self,
        request: admin_pb2.ListTenantUsageRequest,
        context: grpc.aio.ServicerContext[
            admin_pb2.ListTenantUsageRequest, admin_pb2.ListTenantUsageResponse
        ],
    ) -> admin_pb2.ListTenantUsageResponse:
        snapshot = self._snapshots.current
        return admin_pb2.ListTenantUsageResponse(
            tenants=[
                tenant_usage_message(
                    await tenant_usage_report(
                        self._services.store, self._services.clock, snapshot, name
                    )
                )
                for name in sorted(snapshot.tenants)
            ]
        )

    async def ListBackends(
        self,
        request: admin_pb2.ListBackendsRequest,
        context: grpc.aio.ServicerContext[
            admin_pb2.ListBackendsRequest, admin_pb2.ListBackendsResponse
        ],
    ) -> admin_pb2.ListBackendsResponse:
        status = {s.name: s for s in await self._services.store.backend_status()}
        backends = []
        for name, limits in sorted(self._snapshots.current.backends.items()):
            if self._pools.is_pool(name):
                backends.append(self._pool_message(name, limits, status))
                continue
            live = status.get(name)
            backends.append(
                admin_pb2.Backend(
                    name=name,
                    kv_budget_tokens=limits.kv_budget_tokens,
                    kv_tokens_in_flight=live.kv_tokens_in_flight if live else 0,
                    requests_in_flight=live.requests_in_flight if live else 0,
                    max_concurrent_requests=limits.max_concurrent_requests,
                )
            )
        return admin_pb2.ListBackendsResponse(backends=backends)

    def _pool_message(
        self, pool: str, limits: BackendLimits, status: Mapping[str, BackendStatus]
    ) -> admin_pb2.Backend:
        """A pool and each endpoint: reservations are kept per endpoint (``pool/IP:PORT``),
        so the pool's own name holds none; its totals are the endpoints' sums."""
        endpoints = []
        for state in self._pools.endpoint_states(pool):
            live = status.get(state.key)
            endpoints.append(
                admin_pb2.PoolEndpoint(
                    address=state.address,
                    state=state.state,
                    kv_budget_tokens=state.kv_budget_tokens or 0,
                    kv_tokens_in_flight=live.kv_tokens_in_flight if live else 0,
                    requests_in_flight=live.requests_in_flight if live else 0,
                    last_scrape_age_s=state.last_scrape_age_s,
                    engine_requests_waiting=state.engine_requests_waiting,
                )
            )
        return admin_pb2.Backend(
            name=pool,
            kv_budget_tokens=sum(e.kv_budget_tokens for e in endpoints),
            kv_tokens_in_flight=sum(e.kv_tokens_in_flight for e in endpoints),
            requests_in_flight=sum(e.requests_in_flight for e in endpoints),
            max_concurrent_requests=limits.max_concurrent_requests,
            pool=True,
            endpoints=endpoints,
        )

    async def Reconcile(
        self,
        request: admin_pb2.ReconcileRequest,
        context: grpc.aio.ServicerContext[admin_pb2.ReconcileRequest, admin_pb2.ReconcileResponse],
    ) -> admin_pb2.ReconcileResponse:
        return admin_pb2.ReconcileResponse(
            engines=[
                admin_pb2.EngineReconciliation(
                    ledger=row.ledger,
                    engine_prompt_tokens=row.engine_prompt_tokens,
                    engine_output_tokens=row.engine_output_tokens,
                    booked_prompt_tokens=row.booked_prompt_tokens,
                    booked_output_tokens=row.booked_output_tokens,
                    unbooked_prompt_tokens=row.unbooked_prompt_tokens,
                    unbooked_output_tokens=row.unbooked_output_tokens,
                    engine_restarts=row.engine_restarts,
                    watching_s=row.watching_s,
                )
                for row in self._reconciler.rows()
            ]
        )

    async def ListUsageRecords(
        self,
        request: admin_pb2.ListUsageRecordsRequest,
        context: grpc.aio.ServicerContext[
            admin_pb2.ListUsageRecordsRequest, admin_pb2.ListUsageRecordsResponse
        ],
    ) -> admin_pb2.ListUsageRecordsResponse:
        sink = self._usage_records
        if sink is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "usage records are off (usage_records.sink)"
            )
        assert sink is not None
        try:
            size = page_size(request.page_size)
            after = read_page_token(request.page_token)
        except (BadPageToken, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        query = RecordQuery(
            tenant=request.tenant or None,
            since=request.since_unix_s if request.HasField("since_unix_s") else None,
            until=request.until_unix_s if request.HasField("until_unix_s") else None,
            after=after,
            limit=size + 1,  # one more: whether another page follows
        )
        try:
            found = await asyncio.wait_for(sink.records(query), RECORDS_READ_TIMEOUT_S)
        except Exception as exc:  # the database's own errors, whatever the sink
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the usage record sink cannot answer: {exc!r}"
            )
        page = found[:size]
        return admin_pb2.ListUsageRecordsResponse(
            records=[usage_record_message(record) for record in page],
            next_page_token=page_token(page[-1]) if len(found) > size else "",
        )

    async def Reload(
        self,
        request: admin_pb2.ReloadRequest,
        context: grpc.aio.ServicerContext[admin_pb2.ReloadRequest, admin_pb2.ReloadResponse],
    ) -> admin_pb2.ReloadResponse:
        if self._reloader is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "kvgate was not started from a config file"
            )
        assert self._reloader is not None
        applied = await self._reloader.reload("admin_api")
        return admin_pb2.ReloadResponse(
            applied=applied,
            error=self._reloader.last_error or "",
            generation=self._reloader.generation,
        )

    # ------------------------------------------------------------------ API keys

    async def _keys(self, context: grpc.aio.ServicerContext[Any, Any]) -> KeyDirectory:
        keys = self._services.keys
        if keys is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "keys.store is off")
        assert keys is not None
        return keys

    async def _key_id(self, key_id: str, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        if not KEY_ID.match(key_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "key_id must be 'key_' and 16 hex digits"
            )
        return key_id

    async def _unavailable(
        self, context: grpc.aio.ServicerContext[Any, Any], exc: Exception
    ) -> NoReturn:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"the key store cannot answer: {type(exc).__name__}"
        )
        raise AssertionError("abort raises")

    async def _key_limits(
        self, limits_json: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> LevelConfig | None:
        if not limits_json:
            return None
        try:
            limits = LevelConfig.model_validate(json.loads(limits_json))
        except (ValueError, pydantic.ValidationError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limits_json: {exc}")
        models = self._snapshots.current.models
        unknown = sorted(set(limits.models or ()) - set(models))
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"limits_json: models {unknown} are not configured models",
            )
        return limits

    async def CreateKey(
        self,
        request: admin_pb2.CreateKeyRequest,
        context: grpc.aio.ServicerContext[admin_pb2.CreateKeyRequest, admin_pb2.CreatedKey],
    ) -> admin_pb2.CreatedKey:
        keys = await self._keys(context)
        if request.tenant not in self._snapshots.current.tenants:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tenant '{request.tenant}'")
        now = time.time()
        expires_at: float | None = None
        if request.HasField("expires_at_unix_s") and request.HasField("ttl_s"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "give expires_at_unix_s or ttl_s, not both"
            )
        if request.HasField("ttl_s"):
            expires_at = now + request.ttl_s
        elif request.HasField("expires_at_unix_s"):
            expires_at = request.expires_at_unix_s
        if expires_at is not None and (not math.isfinite(expires_at) or expires_at <= now):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the expiry is not in the future")
        limits = await self._key_limits(request.limits_json, context)
        try:
            made = await keys.create(
                request.tenant,
                team=request.team if request.HasField("team") else None,
                user=request.user if request.HasField("user") else None,
                labels=dict(request.labels),
                expires_at=expires_at,
                limits=limits,
            )
        except Exception as exc:  # the store's own errors, whatever the store
            await self._unavailable(context, exc)
        return admin_pb2.CreatedKey(secret=made.secret, key=api_key_message(made.record, now))

    async def GetKey(
        self,
        request: admin_pb2.GetKeyRequest,
        context: grpc.aio.ServicerContext[admin_pb2.GetKeyRequest, admin_pb2.ApiKey],
    ) -> admin_pb2.ApiKey:
        keys = await self._keys(context)
        return await self._one_key(request.key_id, keys.get, context)

    async def ListKeys(
        self,
        request: admin_pb2.ListKeysRequest,
        context: grpc.aio.ServicerContext[admin_pb2.ListKeysRequest, admin_pb2.ListKeysResponse],
    ) -> admin_pb2.ListKeysResponse:
        keys = await self._keys(context)
        try:
            size = page_size(request.page_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.page_token and not KEY_ID.match(request.page_token):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this server gave"
            )
        try:
            found = await keys.list(
                tenant=request.tenant or None,
                after_key_id=request.page_token,
                limit=size + 1,  # one more: whether another page follows
            )
        except Exception as exc:
            await self._unavailable(context, exc)
        page = list(found[:size])
        now = time.time()
        return admin_pb2.ListKeysResponse(
            keys=[api_key_message(record, now) for record in page],
            next_page_token=page[-1].key_id if len(found) > size else "",
        )

    async def RevokeKey(
        self,
        request: admin_pb2.RevokeKeyRequest,
        context: grpc.aio.ServicerContext[admin_pb2.RevokeKeyRequest, admin_pb2.ApiKey],
    ) -> admin_pb2.ApiKey:
        keys = await self._keys(context)
        return await self._one_key(request.key_id, keys.revoke, context)

    async def _one_key(
        self,
        key_id: str,
        action: Callable[[str], Awaitable[KeyRecord | None]],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> admin_pb2.ApiKey:
        """``action`` (read, revoke) on one key by id: its record, or NOT_FOUND."""
        key_id = await self._key_id(key_id, context)
        try:
            record = await action(key_id)
        except Exception as exc:  # the store's own errors, whatever the store
            await self._unavailable(context, exc)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no key '{key_id}'")
        assert record is not None
        return api_key_message(record, time.time())

    async def RotateKey(
        self,
        request: admin_pb2.RotateKeyRequest,
        context: grpc.aio.ServicerContext[admin_pb2.RotateKeyRequest, admin_pb2.CreatedKey],
    ) -> admin_pb2.CreatedKey:
        keys = await self._keys(context)
        key_id = await self._key_id(request.key_id, context)
        if not math.isfinite(request.grace_s) or request.grace_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grace_s must be 0 or more")
        try:
            made = await keys.rotate(key_id, grace_s=request.grace_s)
        except Exception as exc:
            await self._unavailable(context, exc)
        if made is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no key '{key_id}' that is not revoked already"
            )
        assert made is not None
        return admin_pb2.CreatedKey(
            secret=made.secret, key=api_key_message(made.record, time.time())
        )
