"""Admission and settlement of a request that generates nothing (embeddings, pooling):
its prompts counted as the engine encodes them, truncated and checked against the whole
context as vLLM does, reserved with no output tokens, charged for its input only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.lifecycle import Rejected
from kvgate.lifecycle.billing import ResponseReading
from kvgate.lifecycle.protocol import rejection_answer
from kvgate.lifecycle.ticket import Ticket
from kvgate.policy import ActualUsage, Reason, SettleCause
from kvgate.protocols import EMBEDDINGS
from tests.lifecycle.conftest import MODEL, Lifecycle

MAX_CONTEXT = 4096  # the lifecycle fixture's model


def embedding(value: Any, **fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "input": value, **fields}).encode()


async def admit(life: Lifecycle, raw: bytes, request_id: str = "e1") -> Ticket:
    request = EMBEDDINGS.parse(raw)
    policy = life.snapshots.current.tenants["acme"]
    return await life.admission().admit(request, policy, request_id, f"{request_id}/x")


async def test_each_input_is_counted_as_the_engine_encodes_it(life: Lifecycle) -> None:
    texts = ["hello there", "a longer sentence about embeddings", "x"]
    ticket = await admit(life, embedding(texts))
    # Each input on its own, with the tokenizer's special tokens (add_special_tokens).
    expected = [await life.tokenizers.count_completion(MODEL, text) for text in texts]
    assert ticket.prompt_tokens == sum(expected)
    assert ticket.max_new_tokens == 0
    assert ticket.reservation.request.reserved_output_tokens == 0
    # KV for the prefill only, in whole blocks.
    assert ticket.reservation.kv_tokens == -(-sum(expected) // 16) * 16
    assert await life.in_flight() == (ticket.reservation.kv_tokens, 1)


async def test_token_ids_count_as_given(life: Lifecycle) -> None:
    ticket = await admit(life, embedding([[1, 2, 3], [4, 5]]))
    assert ticket.prompt_tokens == 5


async def test_a_prompt_may_fill_the_whole_context(life: Lifecycle) -> None:
    """Pooling keeps no room for output: vLLM accepts a prompt of exactly max_model_len."""
    ticket = await admit(life, embedding([7] * MAX_CONTEXT))
    assert ticket.prompt_tokens == MAX_CONTEXT


async def test_one_token_over_the_context_is_refused_naming_input(life: Lifecycle) -> None:
    with pytest.raises(Rejected) as refused:
        await admit(life, embedding([[1], [7] * (MAX_CONTEXT + 1)]))
    rejection = refused.value.rejection
    assert rejection.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    assert rejection.param == "input"
    assert rejection.context is not None
    assert rejection.context.prompt_tokens == MAX_CONTEXT + 1
    assert not rejection.context.max_new_tokens
    assert await life.in_flight() == (0, 0)


async def test_a_huge_text_is_refused_before_counting(life: Lifecycle) -> None:
    with pytest.raises(Rejected) as refused:
        await admit(life, embedding("word " * 200_000))
    assert refused.value.rejection.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    assert refused.value.rejection.param == "input"


async def test_truncation_counts_what_the_engine_keeps(life: Lifecycle) -> None:
    long_text = "word " * 10_000  # far over the context untruncated
    ticket = await admit(life, embedding([long_text, "hi"], truncate_prompt_tokens=8))
    short = await life.tokenizers.count_completion(MODEL, "hi")
    assert ticket.prompt_tokens == 8 + min(8, short)


async def test_truncation_to_the_context_admits_a_long_input(life: Lifecycle) -> None:
    ticket = await admit(life, embedding([5] * 9000, truncate_prompt_tokens=-1))
    assert ticket.prompt_tokens == MAX_CONTEXT


async def test_truncation_over_the_context_is_refused(life: Lifecycle) -> None:
    with pytest.raises(Rejected) as refused:
        await admit(life, embedding("hi", truncate_prompt_tokens=MAX_CONTEXT + 1))
    assert refused.value.rejection.param == "truncate_prompt_tokens"
    assert "cannot be greater than max_model_len" in refused.value.rejection.message
    assert await life.in_flight() == (0, 0)


async def test_the_answer_usage_settles_input_only(life: Lifecycle) -> None:
    ticket = await admit(life, embedding(["hello there", "again"]))
    # Whatever completion_tokens the answer says, pooling generated nothing.
    meter = EMBEDDINGS.meter(ticket)
    meter.on_headers(200, "application/json")
    answer = {
        "object": "list",
        "data": [],
        "usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 4},
    }
    meter.on_chunk(json.dumps(answer).encode(), end_of_stream=True)

    async def no_output(text: str) -> int:
        raise AssertionError("a pooling answer has no output text to count")

    reading = await meter.reading(no_output)
    charged, task = life.settler.settle(ticket, SettleCause.COMPLETED, reading)
    await task
    assert charged == ActualUsage(prompt_tokens=9, output_tokens=0)
    [totals] = (await life.store.usage_totals()).values()
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens) == (1, 9, 0)
    # Priced per input token only: 9 tokens at 1 per million.
    assert totals.cost_pico == 9 * 1_000_000
    assert await life.in_flight() == (0, 0)


async def test_an_unreadable_answer_is_charged_the_counted_prompt(life: Lifecycle) -> None:
    ticket = await admit(life, embedding("hello there"))
    reading = ResponseReading(accepted=True, streamed=False, usage=None)
    charged, task = life.settler.settle(ticket, SettleCause.COMPLETED, reading)
    await task
    assert charged == ActualUsage(prompt_tokens=ticket.prompt_tokens, output_tokens=0)


async def test_chat_still_reserves_a_generation(life: Lifecycle) -> None:
    from kvgate.openai import parse_request

    request = parse_request(
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
    )
    assert request.generates
    policy = life.snapshots.current.tenants["acme"]
    ticket = await life.admission().admit(request, policy, "c1", "c1/x")
    assert ticket.max_new_tokens == 100 and ticket.body_needs_cap


async def test_more_inputs_than_the_configured_cap_are_refused_naming_input(
    life: Lifecycle,
) -> None:
    cap = life.snapshots.current.config.server.max_pooling_inputs
    assert cap == 2048  # the default
    ticket = await admit(life, embedding([[1]] * cap))
    assert ticket.prompt_tokens == cap
    with pytest.raises(Rejected) as refused:
        await admit(life, embedding([[1]] * 10_000), "e2")
    rejection = refused.value.rejection
    assert rejection.reason is Reason.TOO_MANY_INPUTS and rejection.param == "input"
    assert "at most 2048 inputs" in rejection.message and "10000" in rejection.message
    answer = json.loads(rejection_answer(rejection, EMBEDDINGS.errors).to_body())["error"]
    assert (answer["param"], answer["code"]) == ("input", "too_many_inputs")
