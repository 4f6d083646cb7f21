"""Admission without a server: domain outcomes, no HTTP."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.lifecycle import Rejected
from kvgate.openai import parse_request
from kvgate.policy import Reason
from tests.lifecycle.conftest import MODEL, Lifecycle, make_lifecycle
from tests.lifecycle.support import CHAT, chat


async def admit(life: Lifecycle, body: bytes, request_id: str = "r1"):  # type: ignore[no-untyped-def]
    request = parse_request(CHAT, body)
    policy = life.snapshots.current.tenants["acme"]
    return await life.admission().admit(request, policy, request_id, f"{request_id}/x")


async def test_admitted_request_gets_a_ticket_with_its_reservation(life: Lifecycle) -> None:
    ticket = await admit(life, chat(max_tokens=20))
    prompt = await life.tokenizers.count_chat(MODEL, [{"role": "user", "content": "hello there"}])
    assert ticket.prompt_tokens == prompt
    assert ticket.max_new_tokens == 20
    assert ticket.reservation.kv_tokens >= prompt + 20
    assert ticket.request_id == "r1"
    assert ticket.reservation.request.request_id == "r1/x"
    assert not ticket.body_needs_cap  # the body already says 20
    assert await life.in_flight() == (ticket.reservation.kv_tokens, 1)


async def test_missing_cap_is_reserved_and_must_be_written(life: Lifecycle) -> None:
    ticket = await admit(life, chat())
    assert ticket.max_new_tokens == 100  # the model's default
    assert ticket.body_needs_cap


async def test_rejections_are_domain_values(life: Lifecycle) -> None:
    with pytest.raises(Rejected) as unknown:
        await admit(life, chat(model_extra=1).replace(MODEL.encode(), b"nope"))
    assert unknown.value.rejection.reason is Reason.MODEL_NOT_FOUND
    with pytest.raises(Rejected) as too_long:
        await admit(life, chat(max_tokens=4096))
    rejection = too_long.value.rejection
    assert rejection.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    assert rejection.context is not None and rejection.context.max_context == 4096
    assert rejection.context.max_new_tokens == 4096
    with pytest.raises(Rejected) as min_tokens:
        await admit(life, chat(max_tokens=5, min_tokens=6))
    assert min_tokens.value.rejection.reason is Reason.MIN_TOKENS_OVER_CAP
    assert min_tokens.value.rejection.param == "min_tokens"
    assert await life.in_flight() == (0, 0)


async def test_rpm_is_refused_before_counting() -> None:
    async for life in make_lifecycle(rpm=1):
        await admit(life, chat(max_tokens=5), "a")
        with pytest.raises(Rejected) as second:
            await admit(life, chat(max_tokens=5), "b")
        assert second.value.rejection.reason is Reason.RPM_EXCEEDED
        assert second.value.rejection.retry_after_s is not None


async def test_a_cancelled_admission_leaves_nothing_held(life: Lifecycle) -> None:
    """Cancelled at any await (here: while counting a long prompt), admission holds
    nothing afterwards: an interrupted reserve is abandoned."""
    task = asyncio.ensure_future(admit(life, chat("word " * 30_000, max_tokens=5)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await life.drain()
    assert await life.in_flight() == (0, 0)
