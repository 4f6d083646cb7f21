"""kvgate's pooling admission against vLLM 0.34's own length rules (its TokenizeParams run
from the wheel): for token-id inputs of every length around the context and every kind of
truncate_prompt_tokens, kvgate reserves exactly the tokens the engine keeps, and refuses
exactly what the engine refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.lifecycle import Rejected
from kvgate.lifecycle.billing import ResponseReading
from kvgate.policy import SettleCause
from kvgate.protocols import EMBEDDINGS
from tests.lifecycle.conftest import MODEL, Lifecycle
from tests.pooling.vllm_params_oracle import engine_prompt_length, load_tokenize_params

MAX_CONTEXT = 4096  # the lifecycle fixture's model

LENGTHS = (1, 7, 100, MAX_CONTEXT - 1, MAX_CONTEXT, MAX_CONTEXT + 1, 9000)
TRUNCATIONS = (None, -1, 0, 1, 5, 100, MAX_CONTEXT - 1, MAX_CONTEXT, MAX_CONTEXT + 1)


@pytest.fixture(scope="module")
def tokenize_params() -> Any:
    params = load_tokenize_params()
    if params is None:
        pytest.skip("vLLM's wheel is not available (offline)")
    return params


async def kvgate_prompt_length(life: Lifecycle, length: int, truncate: int | None) -> int | str:
    fields: dict[str, Any] = {"model": MODEL, "input": [5] * length}
    if truncate is not None:
        fields["truncate_prompt_tokens"] = truncate
    request = EMBEDDINGS.parse(json.dumps(fields).encode())
    policy = life.snapshots.current.tenants["acme"]
    try:
        ticket = await life.admission().admit(request, policy, "r", f"r/{length}/{truncate}")
    except Rejected as refused:
        return refused.rejection.param or "?"
    # Settled at once: the next admission finds the backend's KV free again.
    _, task = life.settler.settle(ticket, SettleCause.UPSTREAM_ERROR, ResponseReading())
    await task
    return ticket.prompt_tokens


@pytest.mark.parametrize("truncate", TRUNCATIONS)
async def test_reserved_tokens_and_refusals_match_the_engine(
    life: Lifecycle, tokenize_params: Any, truncate: int | None
) -> None:
    for length in LENGTHS:
        engine = engine_prompt_length(tokenize_params, length, MAX_CONTEXT, truncate)
        kvgate = await kvgate_prompt_length(life, length, truncate)
        if isinstance(engine, str):
            # vLLM's parameter names: its length check says input_tokens; kvgate names the
            # request's field, input.
            expected = {"input_tokens": "input"}.get(engine, engine)
            assert kvgate == expected, (length, truncate, engine)
        else:
            assert kvgate == engine, (length, truncate)
