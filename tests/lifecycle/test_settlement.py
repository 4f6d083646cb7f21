"""Settlement without a server: the one path, exactly once, with the billing rule."""

from __future__ import annotations

from kvgate.lifecycle import ResponseReading
from kvgate.openai import parse_request
from kvgate.policy import ActualUsage, SettleCause
from tests.lifecycle.conftest import MODEL, Lifecycle
from tests.lifecycle.support import CHAT, chat


async def test_settles_once_and_books_the_usage(life: Lifecycle) -> None:
    request = parse_request(CHAT, chat(max_tokens=20))
    policy = life.snapshots.current.tenants["acme"]
    ticket = await life.admission().admit(request, policy, "r1", "r1/x")
    reading = ResponseReading(accepted=True, streamed=False, usage=ActualUsage(12, 7))
    charged, task = life.settler.settle(ticket, SettleCause.COMPLETED, reading)
    await task
    assert (charged.prompt_tokens, charged.output_tokens) == (12, 7)
    _, again = life.settler.settle(ticket, SettleCause.DISCONNECTED, reading)
    await again
    totals = (await life.store.usage_totals())[("acme", MODEL)]
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens) == (1, 12, 7)
    assert totals.cost_pico == ticket.pricing.cost(12, 7, 0)
    assert await life.in_flight() == (0, 0)
    assert life.metrics.settlements.labels("gpu", "completed")._value.get() == 1


async def test_unreadable_usage_is_charged_the_worst_case(life: Lifecycle) -> None:
    request = parse_request(CHAT, chat(max_tokens=20, n=2))
    policy = life.snapshots.current.tenants["acme"]
    ticket = await life.admission().admit(request, policy, "r2", "r2/x")
    charged, task = life.settler.settle(
        ticket, SettleCause.COMPLETED, ResponseReading(accepted=True, streamed=False)
    )
    await task
    assert (charged.prompt_tokens, charged.output_tokens) == (ticket.prompt_tokens, 40)
    assert life.metrics.unmetered_settlements.labels("gpu")._value.get() == 1
