"""Part 3's in-process measurement: `timeit` of each piece of `PoolScheduler.place`'s
picking path (affinity_text, block_hashes, matches, rendezvous_order, rank_endpoints,
record, and the whole path) on a prefix index filled to its 100,000 entries."""

from __future__ import annotations

import json
import random
import timeit
from collections.abc import Callable
from typing import Any

from bench.pools.load import words
from bench.pools.plans import MODEL, POOL, CostPlan


def picking_microbench(plan: CostPlan) -> list[dict[str, Any]]:
    """timeit of each piece of PoolScheduler.place's picking path, best of `timeit_repeat`."""
    from kvgate.openai.requests import parse_request

    rows: list[dict[str, Any]] = []
    rng = random.Random(13)
    for prompt_tokens in (1_000, 16_000):
        system = f"You are the assistant of tenant-{prompt_tokens}. " + words(rng, prompt_tokens)
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 50)},
                ],
                "max_tokens": 64,
            }
        ).encode()
        parsed = parse_request("/v1/chat/completions", body)
        for n_endpoints in (3, 32):
            rows.append(_micro_case(parsed, prompt_tokens, n_endpoints, plan))
    return rows


def _micro_case(
    parsed: Any, prompt_tokens: int, n_endpoints: int, plan: CostPlan
) -> dict[str, Any]:
    from kvgate.lifecycle.scheduler import affinity_text
    from kvgate.policy.picking import (
        EndpointLoad,
        PickWeights,
        PrefixIndex,
        rank_endpoints,
        rendezvous_order,
    )

    block_chars, max_blocks = 64, 128  # PickingConfig's defaults
    limit = block_chars * max_blocks
    keys = [f"{POOL}/10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n_endpoints)]
    index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks)
    filler = random.Random(7)
    # Fill the index to its 100,000 entries with other prompts' chains of 128 blocks.
    while len(index) < 100_000:
        index.record([filler.getrandbits(63) for _ in range(max_blocks)], filler.choice(keys))
    text = affinity_text(parsed, limit)
    hashes = index.block_hashes(text)
    first_block = text[:block_chars]
    index.record(hashes, keys[0])  # the prompt's prefix is held by one endpoint
    miss = index.block_hashes("never seen " + text)
    loads = [
        EndpointLoad(
            key=k,
            kv_budget_tokens=48_000,
            kv_tokens_in_flight=filler.randrange(0, 40_000),
            requests_in_flight=filler.randrange(0, 20),
            max_concurrent_requests=256,
        )
        for k in keys
    ]
    weights = PickWeights()
    matched = index.matches(hashes)
    tie = rendezvous_order(first_block, keys)
    need = prompt_tokens + 64

    def whole() -> object:
        t = affinity_text(parsed, limit)
        h = index.block_hashes(t)
        m = index.matches(h)
        tie_break = rendezvous_order(t[:block_chars], keys)
        order = rank_endpoints(loads, need, m, len(h), weights, tie_break)
        index.record(h, order[0])
        return order

    pieces: dict[str, Callable[[], object]] = {
        "affinity_text": lambda: affinity_text(parsed, limit),
        "block_hashes": lambda: index.block_hashes(text),
        "matches (hit)": lambda: index.matches(hashes),
        "matches (miss)": lambda: index.matches(miss),
        "rendezvous_order": lambda: rendezvous_order(first_block, keys),
        "rank_endpoints": lambda: rank_endpoints(loads, need, matched, len(hashes), weights, tie),
        "record": lambda: index.record(hashes, keys[0]),
        "whole path (hit)": whole,
    }
    row: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "endpoints": n_endpoints,
        "affinity_chars": len(text),
        "blocks": len(hashes),
        "matched": max(matched.values(), default=0),
    }
    for label, fn in pieces.items():
        row[label] = _best_us(fn, plan)
    return row


def _best_us(fn: Callable[[], object], plan: CostPlan) -> float:
    """Best of `timeit_repeat` runs of about `timeit_budget_s` each, in µs per call."""
    timer = timeit.Timer(fn)
    number = 1
    while (elapsed := timer.timeit(number)) < 0.005:
        number *= 4
    number = max(1, int(number * plan.timeit_budget_s / elapsed))
    return min(timer.repeat(repeat=plan.timeit_repeat, number=number)) / number * 1e6
