"""A reservation that generates nothing (embeddings, rerank, score: max_new_tokens 0) in
every store (memory, Redis, Redis Cluster, the fallback over Redis): the prompt's KV in
whole blocks, the prompt's tokens from TPM, its money on the budget, then released and
booked with no output."""

from __future__ import annotations

from kvgate.policy import BudgetRule, ConcurrencyRule, Period, ScopeLimits, SettleCause
from tests.store.conftest import StoreFactory, clock, make_store, redis_cluster
from tests.store.test_contract import admitted, in_flight, req, rpm, settle, tenant, tpm

__all__ = ["clock", "make_store", "redis_cluster"]


async def test_a_pooling_reservation_holds_the_prompt_only(make_store: StoreFactory) -> None:
    store = make_store()
    policy = tenant(
        limits=ScopeLimits(rpm=rpm(10), tpm=tpm(1000), concurrency=ConcurrencyRule(5)),
        budgets=(BudgetRule(Period.DAY, 10**12),),
    )
    reservation = await admitted(store, req(95, 0, cost=95_000_000), policy)
    assert reservation.kv_tokens == 100  # 95 rounded up to 10-token blocks, no output
    assert reservation.request.reserved_output_tokens == 0
    assert await in_flight(store) == (100, 1)
    # The rest of the backend's KV exactly (no output held back for either).
    second = await admitted(store, req(895, 0, rid="r2"), policy)
    assert second.kv_tokens == 900
    assert await in_flight(store) == (1000, 2)
    assert await settle(store, reservation, 95, 0, cost=95_000_000, policy=policy)
    assert await settle(store, second, 895, 0, policy=policy, cause=SettleCause.COMPLETED)
    assert await in_flight(store) == (0, 0)
    [totals] = (await store.usage_totals()).values()
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens) == (2, 990, 0)


async def test_nothing_is_left_in_flight_after_an_upstream_error(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    reservation = await admitted(store, req(40, 0))
    assert await settle(store, reservation, cause=SettleCause.UPSTREAM_ERROR)
    assert await in_flight(store) == (0, 0)
