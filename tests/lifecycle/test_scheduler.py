"""Pool placement through the real admission path: the memory store, the demo tokenizer and
a static pool of three endpoints (nothing listens on them: no discovery, so they are all
pickable). No gRPC, no Envoy."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.lifecycle import Rejected
from kvgate.lifecycle.scheduler import affinity_text
from kvgate.openai import parse_request
from kvgate.policy import ActualUsage, Reason, SettleCause
from tests.lifecycle.support import ENDPOINTS, Pool, pool_config


async def test_requests_spread_over_endpoints_and_each_ledger_holds_its_own(pool: Pool) -> None:
    # ~500 prompt+answer tokens: two fit one 1,024-token endpoint, so six fit the pool.
    tickets = [await pool.admit("light", f"q{i}", 480) for i in range(6)]
    placed = sorted(t.endpoint for t in tickets)
    assert placed == sorted(ENDPOINTS * 2)
    for ticket in tickets:
        assert ticket.backend == f"pool/{ticket.endpoint}" and ticket.cluster == "pool"
    statuses = {s.name: s for s in await pool.store.backend_status()}
    for address in ENDPOINTS:
        assert statuses[f"pool/{address}"].kv_tokens_in_flight <= 1024
    with pytest.raises(Rejected) as full:
        await pool.admit("light", "one-more", 480)
    assert full.value.rejection.reason is Reason.KV_BUDGET_EXHAUSTED
    assert full.value.rejection.retry_after_s is not None


async def test_a_request_no_endpoint_could_hold_is_a_400_reason(pool: Pool) -> None:
    with pytest.raises(Rejected) as too_big:
        await pool.admit("light", "big", 2000)
    assert too_big.value.rejection.reason is Reason.REQUEST_EXCEEDS_KV_BUDGET


async def test_a_tenant_limit_answers_at_once_without_trying_other_endpoints() -> None:
    pool = Pool(pool_config(tpm=600))
    await pool.start()
    try:
        await pool.admit("heavy", "first", 480)
        with pytest.raises(Rejected) as limited:
            await pool.admit("heavy", "second", 480)
        assert limited.value.rejection.reason is Reason.TPM_EXCEEDED
        # Nothing was reserved anywhere for the refused request.
        statuses = await pool.store.backend_status()
        assert sum(s.requests_in_flight for s in statuses) == 1
    finally:
        await pool.close()


async def test_a_full_pool_queues_and_admits_when_a_settlement_frees_room() -> None:
    pool = Pool(pool_config(queue={"max_wait_s": 5, "poll_interval_s": 0.01}))
    await pool.start()
    try:
        tickets = [await pool.admit("heavy", f"h{i}", 480) for i in range(6)]
        queued_for: list[float] = []
        waiter = asyncio.create_task(pool.admit("light", "waits", 480, on_queued=queued_for.append))
        await asyncio.sleep(0.05)
        assert not waiter.done() and queued_for == [5]
        freed = tickets[0].reservation
        await pool.store.settle(
            freed,
            SettleCause.COMPLETED,
            ActualUsage(prompt_tokens=10, output_tokens=10),
            cost_pico=0,
            tenant=pool.snapshot.tenants["heavy"],
        )
        pool.scheduler.on_settled(tickets[0], ActualUsage(prompt_tokens=10, output_tokens=10))
        ticket = await asyncio.wait_for(waiter, 2)
        assert ticket.endpoint == tickets[0].endpoint
        assert pool.metrics.queue_wait_seconds.labels("pool", "light", "0")._sum.get() > 0
    finally:
        await pool.close()


async def test_a_settlement_corrects_the_fair_share_counter_to_the_output_really_given() -> None:
    pool = Pool(pool_config(queue={"max_wait_s": 5, "poll_interval_s": 0.01}))
    await pool.start()
    try:
        ticket = await pool.admit("heavy", "h", 480)
        queue = pool.scheduler.queue("pool")
        assert queue is not None
        # Input weight 1, output weight 2: charged the reserved output at admission...
        assert queue.counters()["heavy"] == ticket.prompt_tokens + 2 * 480
        used = ActualUsage(prompt_tokens=ticket.prompt_tokens, output_tokens=30)
        pool.scheduler.on_settled(ticket, used)
        # ...and, once settled, only what it really got.
        assert queue.counters()["heavy"] == ticket.prompt_tokens + 2 * 30
    finally:
        await pool.close()


async def test_a_queued_request_that_is_cancelled_leaves_nothing_behind() -> None:
    pool = Pool(pool_config(queue={"max_wait_s": 5, "poll_interval_s": 0.01}))
    await pool.start()
    try:
        for i in range(6):
            await pool.admit("heavy", f"h{i}", 480)
        waiter = asyncio.create_task(pool.admit("light", "gives-up", 480))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        queue = pool.scheduler.queue("pool")
        assert queue is not None and queue.waiting == 0
        statuses = await pool.store.backend_status()
        assert sum(s.requests_in_flight for s in statuses) == 6
        drops = pool.metrics.queue_drops.labels("pool", "light", "disconnected")._value.get()
        assert drops == 1
    finally:
        await pool.close()


async def test_the_wait_bound_ends_in_a_queue_rejection_with_retry_after() -> None:
    pool = Pool(pool_config(queue={"max_wait_s": 0.2, "poll_interval_s": 0.01}))
    await pool.start()
    try:
        for i in range(6):
            await pool.admit("heavy", f"h{i}", 480)
        with pytest.raises(Rejected) as expired:
            await pool.admit("light", "expires", 480)
        assert expired.value.rejection.reason is Reason.QUEUE_WAIT_EXPIRED
        assert (expired.value.rejection.retry_after_s or 0) >= 1
    finally:
        await pool.close()


def test_affinity_text_follows_the_rendered_order_and_stops_at_the_limit() -> None:
    body = (
        b'{"model":"m","messages":[{"role":"system","content":"S"},'
        b'{"role":"user","content":"U"}],"tools":[{"type":"function","function":{"name":"f"}}]}'
    )
    request = parse_request("/v1/chat/completions", body)
    text = affinity_text(request, 1000)
    assert text.index("function") < text.index("S") < text.index("U")
    assert len(affinity_text(request, 5)) == 5
    ids = parse_request("/v1/completions", b'{"model":"m","prompt":[[11,12,13]]}')
    other = parse_request("/v1/completions", b'{"model":"m","prompt":[[11,12,14]]}')
    assert "12" in affinity_text(ids, 100) and affinity_text(ids, 100) != affinity_text(other, 100)
