"""What only the Redis store has: one clock (Redis TIME), scripts reloaded after a flush, one
hash tag (one Cluster slot) per deployment, exact money at rest, and late settlements."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from kvgate.config import parse_config
from kvgate.config.model import ConfigError
from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    BudgetRule,
    ManualClock,
    Period,
    SettleCause,
    TenantPolicy,
    UsageTotals,
)
from kvgate.store import MemoryStore
from kvgate.store.redis_store import RedisStore, hash_tag
from tests.store.conftest import REDIS_URL, delete_prefix

BACKEND = BackendLimits("b", kv_budget_tokens=10_000, kv_block_size=16, max_concurrent_requests=8)
TENANT = TenantPolicy(name="t", budgets=(BudgetRule(Period.MONTH, 10**21),))


def req(cost: int = 0) -> AdmissionRequest:
    return AdmissionRequest("r", "t", "m", "b", prompt_tokens=10, max_new_tokens=10, cost_pico=cost)


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(REDIS_URL)
    yield connection
    await connection.aclose()


def make(client: aioredis.Redis, clock: ManualClock | None = None, ttl: float = 60) -> RedisStore:
    return RedisStore(
        client,
        lease_ttl_s=ttl,
        key_prefix=f"kvgate-rs-{uuid.uuid4().hex[:12]}",
        timeout_s=5,
        clock=clock,
    )


async def test_time_comes_from_redis(client: aioredis.Redis) -> None:
    store = make(client)
    try:
        seconds, micros = await client.time()
        decision = await store.reserve(req(), BACKEND, TENANT)
        assert decision.reservation is not None
        assert abs(decision.reservation.started_at - (seconds + micros / 1e6)) < 1.0
        assert decision.reservation.expires_at == pytest.approx(
            decision.reservation.started_at + 60
        )
    finally:
        await delete_prefix(client, store.key_tag)


async def test_scripts_are_reloaded_after_a_flush(client: aioredis.Redis) -> None:
    store = make(client)
    try:
        assert (await store.reserve(req(), BACKEND, TENANT)).admitted
        await client.script_flush()
        assert (await store.reserve(req(), BACKEND, TENANT)).admitted  # NOSCRIPT -> reload
    finally:
        await delete_prefix(client, store.key_tag)


async def test_every_key_shares_one_slot_and_money_is_exact_at_rest(
    client: aioredis.Redis,
) -> None:
    clock = ManualClock()
    store = make(client, clock, ttl=5)
    cost = 123_456_789_012_345_678_901  # ~ $123M: far beyond 2**53 pico-dollars
    try:
        kept = (await store.reserve(req(cost), BACKEND, TENANT)).reservation
        lost = (await store.reserve(req(cost), BACKEND, TENANT)).reservation
        assert kept and lost
        await store.renew(kept)
        await store.settle(
            kept, SettleCause.COMPLETED, ActualUsage(10, 3), cost_pico=cost - 1, tenant=TENANT
        )
        clock.advance(6)
        await store.backend_status()  # sweeps `lost`
        keys = [key async for key in client.scan_iter(match=f"{store.key_tag}*")]
        assert len(keys) >= 6  # tenant, backend, ledgers, totals, settled ids, ...
        assert {key_slot(key) for key in keys} == {key_slot(store.key_tag.encode())}
        month = kept.hold.period_keys[1][1] if kept.hold else ""
        tenant_hash = f"{store.key_tag}:t|t"
        assert await client.hget(tenant_hash, f"sp|{month}") == str(cost - 1).encode()
        assert await client.hget(tenant_hash, f"rs|{month}") == b"0"
        totals = await store.usage_totals()
        assert totals == {("t", "m"): UsageTotals(1, 10, 3, 0, cost - 1)}
    finally:
        await delete_prefix(client, store.key_tag)


async def test_settlements_book_through_the_billing_record_once(client: aioredis.Redis) -> None:
    clock = ManualClock()
    store = make(client, clock, ttl=5)
    usage = ActualUsage(10, 4)
    try:
        live = (await store.reserve(req(50), BACKEND, TENANT)).reservation
        expired = (await store.reserve(req(50), BACKEND, TENANT)).reservation
        assert live and expired
        first = await store.settle(live, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT)
        assert first.applied and not first.lease_expired
        # Settled already: a copy applies nothing (the record was consumed).
        assert not (
            await store.settle(live, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT)
        ).applied
        # Expired (its hold released, nothing charged): the settlement books the usage once.
        clock.advance(6)
        await store.backend_status()
        late = await store.settle(
            expired, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT
        )
        assert late.applied and late.lease_expired
        assert not (
            await store.settle(expired, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT)
        ).applied
        assert await store.usage_totals() == {("t", "m"): UsageTotals(2, 20, 8, 0, 80)}
        month = live.hold.period_keys[1][1] if live.hold else ""
        usage_now = await store.tenant_usage("t", [month])
        assert usage_now.spent_pico == {month: 80} and usage_now.reserved_pico == {month: 0}
        # Nothing is left behind: no lease, no billing record, no request index.
        tag = store.key_tag
        for key in (f"{tag}:bill", f"{tag}:billx", f"{tag}:rq", f"{tag}:leases", f"{tag}:r|b"):
            assert not await client.exists(key), key
    finally:
        await delete_prefix(client, store.key_tag)


async def test_a_local_admission_is_booked_once_per_id(client: aioredis.Redis) -> None:
    """The usage of a request admitted by a replica's local fallback has no billing record
    in Redis: it is booked once per reservation id."""
    clock = ManualClock()
    store = make(client, clock)
    local = MemoryStore(lease_ttl_s=60, clock=clock)
    usage = ActualUsage(10, 4)
    try:
        held = (await local.reserve(req(50), BACKEND, TENANT)).reservation
        assert held is not None
        for expected in (True, False):
            settlement = await store.settle_local(
                held, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT
            )
            assert settlement.applied is expected
        # Through the ordinary path it is unknown here: nothing booked.
        assert not (
            await store.settle(held, SettleCause.COMPLETED, usage, cost_pico=40, tenant=TENANT)
        ).applied
        assert await store.usage_totals() == {("t", "m"): UsageTotals(1, 10, 4, 0, 40)}
    finally:
        await delete_prefix(client, store.key_tag)


async def test_reserve_sends_compact_json_and_integers_as_strings(client: aioredis.Redis) -> None:
    sent: list[list[object]] = []
    store = make(client, ManualClock())
    original = store._reserve

    async def spy(keys: list[str], args: list[str]) -> object:
        sent.append([*keys, *args])
        return await original(keys=keys, args=args)

    store._reserve = spy  # type: ignore[assignment]
    try:
        await store.reserve(req(10**20), BACKEND, TENANT)
        [[route, tag, payload, rules]] = sent
        assert route == f"{tag}:leases" and tag == store.key_tag
        body = json.loads(str(payload))
        assert body["cost"] == str(10**20) and body["bu"] == [["month", str(10**21), False]]
        assert json.loads(str(rules)) == [{"k": ""}]
    finally:
        await delete_prefix(client, store.key_tag)


def test_hash_tag_rejects_braces() -> None:
    assert hash_tag("prod-eu") == "{prod-eu}"
    with pytest.raises(ValueError):
        hash_tag("a{b}")


BASE = {
    "tenants": [{"name": "t", "api_key_sha256": "a" * 64}],
    "models": [
        {
            "name": "m",
            "tokenizer": "x",
            "max_context": 10,
            "default_max_new_tokens": 1,
            "backend": "b",
        }
    ],
    "backends": [{"name": "b", "kv_budget_tokens": 100}],
}


def test_store_selection_in_the_config() -> None:
    memory = parse_config(BASE)
    assert memory.store == "memory" and not memory.uses_redis
    shared = parse_config(
        {
            **BASE,
            "store": "rediss://:secret@redis.internal:6380/2",
            "redis": {"key_prefix": "prod-eu", "failure_policy": "fail_open", "timeout_s": 0.1},
        }
    )
    assert shared.uses_redis and shared.redis.failure_policy == "fail_open"
    assert shared.redis.key_prefix == "prod-eu" and shared.redis.timeout_s == 0.1
    sentinel = parse_config(
        {
            **BASE,
            "store": "redis://:pw@ignored/0",
            "redis": {"sentinel": {"master": "mymaster", "nodes": ["s1:26379", "s2:26379"]}},
        }
    )
    assert sentinel.redis.sentinel is not None and sentinel.redis.sentinel.master == "mymaster"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"store": "postgres://x"}, "store: Value error, must be 'memory' or a redis://"),
        ({"redis": {"failure_policy": "maybe"}}, "redis.failure_policy"),
        ({"redis": {"key_prefix": "a{b}"}}, "redis.key_prefix"),
        ({"redis": {"timeout_s": 0}}, "redis.timeout_s"),
        (
            {"redis": {"cluster": True, "sentinel": {"master": "m", "nodes": ["h:1"]}}},
            "mutually exclusive",
        ),
        ({"redis": {"sentinel": {"master": "m", "nodes": ["nohost"]}}}, "must be HOST:PORT"),
    ],
)
def test_store_config_errors_name_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **change}, "cfg.yaml")
    assert message.replace("Value error, ", "") in str(info.value)
