"""Picking an endpoint of a pool: the prefix index, rendezvous order and ranking. Pure, no sleeps.

`python -m tests.unit.test_picking` prints the cost measurements quoted in the module's docstring.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.policy import (
    EndpointLoad,
    PickWeights,
    PrefixIndex,
    rank_endpoints,
    rendezvous_order,
)

W = PickWeights()
ROOT = Path(__file__).resolve().parents[2]


def load(
    key: str,
    in_flight: int = 0,
    *,
    budget: int = 10_000,
    requests: int = 0,
    max_requests: int = 16,
    waiting: int | None = None,
) -> EndpointLoad:
    return EndpointLoad(key, budget, in_flight, requests, max_requests, waiting)


def live_pairs(index: PrefixIndex) -> int:
    """What len() should be, counted the slow way from the index's own storage."""
    return sum(1 for held in index._blocks.values() for e in held if e.live)


# --- block_hashes ----------------------------------------------------------------------------


def test_block_hashes_chain_each_block_on_the_one_before() -> None:
    index = PrefixIndex(block_chars=4)
    h0 = hash((0, "abcd"))
    assert index.block_hashes("abcdefgh") == [h0, hash((h0, "efgh"))]
    # The same second block after a different first one is a different prefix.
    assert index.block_hashes("abcXefgh")[1] != index.block_hashes("abcdefgh")[1]


def test_a_partial_last_block_is_not_hashed() -> None:
    index = PrefixIndex(block_chars=4)
    assert index.block_hashes("abcdefghij") == index.block_hashes("abcdefgh")
    assert len(index.block_hashes("abcdefghij")) == 2
    assert index.block_hashes("abc") == []
    assert index.block_hashes("") == []


def test_block_hashes_stop_at_max_blocks() -> None:
    index = PrefixIndex(block_chars=4, max_blocks=3)
    text = "".join(f"{i:04d}" for i in range(10))
    assert index.block_hashes(text) == index.block_hashes(text[:12])
    assert len(index.block_hashes(text)) == 3


def test_block_hashes_take_any_string() -> None:
    # Lone surrogates come out of JSON bodies; the built-in hash takes them.
    index = PrefixIndex(block_chars=2)
    assert len(index.block_hashes("\ud800\udfff\x00é")) == 2


def test_block_hashes_are_salted_per_process() -> None:
    """Another process (another hash seed) hashes the same prompt differently."""
    text = "system: you are a helpful assistant. " * 4
    ours = PrefixIndex().block_hashes(text)
    theirs = json.loads(
        run_with_hash_seed(
            "12345",
            f"import json; from kvgate.policy import PrefixIndex; "
            f"print(json.dumps(PrefixIndex().block_hashes({text!r})))",
        )
    )
    assert len(theirs) == len(ours) == 2
    assert theirs != ours


# --- matches / record / forget ---------------------------------------------------------------


def hashes(n: int, tag: str = "p") -> list[int]:
    return PrefixIndex(block_chars=8).block_hashes("".join(f"{tag}{i:07d}" for i in range(n)))


def test_record_then_match() -> None:
    index = PrefixIndex()
    h = hashes(5)
    assert index.matches(h) == {}
    index.record(h, "A")
    assert index.matches(h) == {"A": 5}
    assert index.matches(h[:3]) == {"A": 3}
    # A longer prompt with the same head matches the head.
    assert index.matches([*h, *hashes(2, "q")]) == {"A": 5}
    assert index.matches(hashes(5, "q")) == {}
    assert index.matches([]) == {}
    assert len(index) == 5


def test_matches_count_only_the_unbroken_run_from_the_first_block() -> None:
    index = PrefixIndex()
    h = hashes(8)
    index.record(h[:6], "A")
    index.record(h[:3], "B")
    index.record(h[1:4], "C")  # never held block 0: its cache is no use for this prompt
    index.record([h[0], h[2], h[3]], "D")  # a gap at block 1: only block 0 counts
    assert index.matches(h) == {"A": 6, "B": 3, "D": 1}


def test_one_endpoint_per_block_is_the_last_one_that_served_it() -> None:
    index = PrefixIndex(max_endpoints_per_block=1)
    h = hashes(6)
    index.record(h, "A")
    index.record(h[:2], "B")
    assert index.matches(h) == {"B": 2}
    assert len(index) == 6


def test_a_full_block_drops_its_least_recent_endpoint() -> None:
    index = PrefixIndex(max_endpoints_per_block=2)
    h = hashes(3)
    index.record(h, "A")
    index.record(h, "B")
    index.record(h, "A")  # A is now more recent than B
    index.record(h, "C")
    assert index.matches(h) == {"A": 3, "C": 3}
    assert len(index) == 6 == live_pairs(index)


def test_the_index_is_bounded_and_evicts_the_least_recently_recorded() -> None:
    index = PrefixIndex(max_entries=10)
    old, hot = hashes(4, "o"), hashes(4, "h")
    index.record(old, "A")
    index.record(hot, "A")
    for i in range(20):
        index.record(hot, "A")  # keeps being served: stays
        index.record(hashes(1, f"x{i}"), "B")
        assert len(index) <= 10
    assert index.matches(hot) == {"A": 4}
    assert index.matches(old) == {}
    assert len(index) == 10 == live_pairs(index)


def test_eviction_takes_a_prompts_tail_before_its_head() -> None:
    # A tail without its head could never match again; the head is what longer prompts share.
    index = PrefixIndex(max_entries=3)
    h = hashes(5)
    index.record(h, "A")
    assert len(index) == 3
    assert index.matches(h) == {"A": 3}


def test_forget_drops_an_endpoint_at_once() -> None:
    index = PrefixIndex()
    h = hashes(4)
    index.record(h, "A")
    index.record(h[:2], "B")
    index.forget("A")
    assert index.matches(h) == {"B": 2}
    assert len(index) == 2 == live_pairs(index)
    assert index.endpoints() == ["B"]
    index.forget("A")  # again, and never seen: no-ops
    index.forget("Z")
    assert len(index) == 2


def test_an_endpoint_that_joins_again_starts_with_no_records() -> None:
    index = PrefixIndex()
    h = hashes(4)
    index.record(h, "A")
    index.forget("A")
    index.record(h[:1], "A")
    assert index.matches(h) == {"A": 1}
    assert len(index) == 1 == live_pairs(index)


def test_forgotten_records_still_count_against_the_bound_until_evicted() -> None:
    index = PrefixIndex(max_entries=4)
    index.record(hashes(4, "a"), "A")
    index.forget("A")
    assert len(index) == 0
    index.record(hashes(2, "b"), "B")  # evicts the oldest (forgotten) blocks to make room
    assert len(index) == 2 == live_pairs(index)
    assert index._size <= 4
    assert index.matches(hashes(2, "b")) == {"B": 2}


def test_index_bookkeeping_holds_under_random_operations() -> None:
    rng = random.Random(7)
    index = PrefixIndex(max_entries=50, max_endpoints_per_block=3)
    prompts = [hashes(rng.randrange(1, 12), f"t{i}") for i in range(30)]
    for _ in range(2_000):
        ep = f"e{rng.randrange(6)}"
        if rng.random() < 0.05:
            index.forget(ep)
        else:
            p = rng.choice(prompts)
            index.record(p[: rng.randrange(1, len(p) + 1)], ep)
        assert len(index) == live_pairs(index)
        assert index._size == sum(len(held) for held in index._blocks.values()) <= 50
        assert all(len(held) <= 3 for held in index._blocks.values())
        for p in rng.sample(prompts, 3):
            for key, n in index.matches(p).items():
                assert 1 <= n <= len(p)
                assert key in index.endpoints()


def test_prefix_index_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(block_chars=0)
    with pytest.raises(ValueError):
        PrefixIndex(max_entries=0)


# --- rendezvous_order ------------------------------------------------------------------------

POOL = [f"vllm-pool/10.0.0.{i}:8000" for i in range(1, 9)]
PREFIXES = ["<|im_start|>system\nYou are", "", "\ud800 lone surrogate", "x" * 64]


def run_with_hash_seed(seed: str, code: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_rendezvous_order_is_the_same_in_every_process(seed: str) -> None:
    code = (
        "import json; from kvgate.policy import rendezvous_order; "
        f"print(json.dumps([rendezvous_order(p, {POOL!r}) for p in {PREFIXES!r}]))"
    )
    theirs = json.loads(run_with_hash_seed(seed, code))
    assert theirs == [rendezvous_order(p, POOL) for p in PREFIXES]


def test_rendezvous_order_is_pinned() -> None:
    # Replicas of two kvgate versions run side by side during a rollout: changing the hash
    # construction makes them disagree on every cold prefix. Change this only on purpose.
    assert rendezvous_order("hello", ["a", "b", "c", "d"]) == ["d", "b", "c", "a"]


def test_rendezvous_order_depends_on_the_endpoints_not_their_order() -> None:
    order = rendezvous_order("some prompt", POOL)
    assert sorted(order) == sorted(POOL)
    assert rendezvous_order("some prompt", list(reversed(POOL))) == order


def test_removing_an_endpoint_moves_only_the_prefixes_it_led() -> None:
    prefixes = [f"prompt {i}" for i in range(500)]
    smaller = POOL[:-1]
    for p in prefixes:
        full = rendezvous_order(p, POOL)
        assert rendezvous_order(p, smaller) == [ep for ep in full if ep != POOL[-1]]


def test_rendezvous_spreads_cold_prefixes_over_every_endpoint() -> None:
    firsts = [rendezvous_order(f"prompt {i}", POOL)[0] for i in range(4_000)]
    for ep in POOL:  # 500 expected each; no endpoint starved
        assert 350 < firsts.count(ep) < 650


# --- rank_endpoints --------------------------------------------------------------------------


def test_affinity_wins_under_the_load_gate() -> None:
    loads = [load("A", 5_000), load("B", 0)]
    # A after the request: 60% used, 100% matched: 0.6 + 0.4 * 0.4 = 0.76 > B's 0.4 * 0.9.
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, W) == ["A", "B"]
    assert rank_endpoints(loads, 1_000, {}, 10, W) == ["B", "A"]


def test_affinity_counts_for_nothing_above_the_load_gate() -> None:
    loads = [load("A", 7_600), load("B", 6_000)]
    # A would be 86% used after the request, above the 85% gate: it ranks by load alone.
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, W) == ["B", "A"]
    # At exactly the gate it still counts.
    loads = [load("A", 7_500), load("B", 6_000)]
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, W) == ["A", "B"]


def test_partial_matches_weigh_by_the_matched_fraction() -> None:
    loads = [load("A", 2_000), load("B", 2_000), load("C", 0)]
    ranked = rank_endpoints(loads, 1_000, {"A": 2, "B": 8}, 10, W)
    assert ranked == ["B", "A", "C"]  # 0.48 + 0.28, 0.12 + 0.28, 0 + 0.36


def test_endpoints_where_the_request_fits_come_first() -> None:
    loads = [
        load("full-kv", 9_500),  # 500 free
        load("full-requests", 0, requests=16),  # at its request limit
        load("fits", 8_000),  # 2,000 free: just fits
        load("more-free", 9_000, budget=12_000, requests=16),  # 3,000 free, at its limit
    ]
    # The best affinity cannot lift an endpoint where the request does not fit.
    matched = {"full-kv": 10, "full-requests": 10, "more-free": 10}
    ranked = rank_endpoints(loads, 2_000, matched, 10, W)
    assert ranked[0] == "fits"
    # The rest by most free KV, whatever their affinity.
    assert ranked[1:] == ["full-requests", "more-free", "full-kv"]


def test_endpoints_where_nothing_fits_are_ordered_by_free_kv() -> None:
    loads = [load("A", 9_000), load("B", 12_000), load("C", 8_000, requests=16)]
    assert rank_endpoints(loads, 5_000, {}, 0, W) == ["C", "A", "B"]


def test_ties_go_by_rendezvous_order() -> None:
    loads = [load("A"), load("B"), load("C")]
    assert rank_endpoints(loads, 100, {}, 0, W, tie_break=["C", "A", "B"]) == ["C", "A", "B"]
    assert rank_endpoints(loads, 100, {}, 0, W, tie_break=["B", "C", "A"]) == ["B", "C", "A"]
    # Without one (or for endpoints it does not list), by key: still deterministic.
    assert rank_endpoints(loads, 100, {}, 0, W) == ["A", "B", "C"]
    assert rank_endpoints(loads, 100, {}, 0, W, tie_break=["B"]) == ["B", "A", "C"]
    assert rank_endpoints(loads, 100, {}, 0, W, tie_break=["C", "A", "C"]) == ["C", "A", "B"]
    # Among endpoints where it does not fit, too.
    assert rank_endpoints(loads, 20_000, {}, 0, W, tie_break=["C", "B", "A"]) == ["C", "B", "A"]


def test_a_long_engine_queue_loses_affinity() -> None:
    weights = PickWeights(max_waiting=2)
    loads = [load("A", 3_000, waiting=3), load("B", 2_000, waiting=0)]
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, weights) == ["B", "A"]
    loads = [load("A", 3_000, waiting=2), load("B", 2_000, waiting=0)]
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, weights) == ["A", "B"]
    # An unknown queue is no reason to withhold the credit; no max_waiting ignores the queue.
    loads = [load("A", 3_000, waiting=None), load("B", 2_000, waiting=0)]
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, weights) == ["A", "B"]
    loads = [load("A", 3_000, waiting=50), load("B", 2_000, waiting=0)]
    assert rank_endpoints(loads, 1_000, {"A": 10}, 10, W) == ["A", "B"]


def test_odd_inputs_rank_without_failing() -> None:
    loads = [load("zero", budget=0), load("over", 12_000), load("A", 0)]
    # A zero budget fits only a zero need and counts as full; over-committed has negative room.
    assert rank_endpoints(loads, 0, {}, 0, W) == ["A", "zero", "over"]
    assert rank_endpoints(loads, 100, {}, 0, W) == ["A", "zero", "over"]
    # More matched blocks than the total (a caller's mistake) is capped at 100%.
    assert rank_endpoints([load("A", 5_000), load("B")], 100, {"A": 99}, 10, W) == ["A", "B"]
    # Matches for endpoints not in the pool are ignored.
    assert rank_endpoints([load("A")], 100, {"gone": 10}, 10, W) == ["A"]
    assert rank_endpoints([], 100, {}, 0, W) == []


def test_pick_weights_refuse_nonsense() -> None:
    for bad in (
        {"affinity": -0.1},
        {"load": float("nan")},
        {"load_gate": float("inf")},
        {"max_waiting": -1},
    ):
        with pytest.raises(ValueError):
            PickWeights(**bad)  # type: ignore[arg-type]


def random_loads(rng: random.Random, n: int) -> list[EndpointLoad]:
    loads = []
    for i in range(n):
        budget = rng.choice([0, 1_000, 10_000, 50_000])
        loads.append(
            EndpointLoad(
                key=f"ep{i}",
                kv_budget_tokens=budget,
                kv_tokens_in_flight=rng.randrange(0, budget + 2_000),
                requests_in_flight=rng.randrange(0, 10),
                max_concurrent_requests=rng.randrange(1, 10),
                waiting=rng.choice([None, 0, 1, 5]),
            )
        )
    return loads


def test_random_loads_rank_every_endpoint_once_and_the_first_fits_if_any_does() -> None:
    rng = random.Random(20_240_601)
    for _ in range(3_000):
        loads = random_loads(rng, rng.randrange(1, 10))
        need = rng.randrange(0, 12_000)
        total = rng.randrange(0, 20)
        matched = {ep.key: rng.randrange(0, total + 1) for ep in loads if rng.random() < 0.5}
        weights = PickWeights(
            affinity=rng.random(),
            load=rng.random(),
            load_gate=rng.random(),
            max_waiting=rng.choice([None, 0, 2]),
        )
        tie = rendezvous_order(str(rng.random()), [ep.key for ep in loads])
        ranked = rank_endpoints(loads, need, matched, total, weights, tie)
        assert sorted(ranked) == sorted(ep.key for ep in loads)
        by_key = {ep.key: ep for ep in loads}
        fits = [by_key[k].fits(need) for k in ranked]
        if any(fits):
            assert fits[0]
        # All that fit before all that do not.
        assert fits == sorted(fits, reverse=True)
        # Deterministic, whatever order the snapshot came in.
        shuffled = rng.sample(loads, len(loads))
        assert rank_endpoints(shuffled, need, matched, total, weights, tie) == ranked


def test_a_shared_prefix_spills_over_instead_of_piling_onto_one_endpoint() -> None:
    """Every request shares one long system prompt; none finishes. Each endpoint should fill to
    the gate on affinity, then the next takes over, and all are used before any passes it."""
    index = PrefixIndex(block_chars=8)
    pool = [f"ep{i}" for i in range(4)]
    in_flight = dict.fromkeys(pool, 0)
    system = "You are a careful assistant. " * 20
    picks = []
    for i in range(36):
        h = index.block_hashes(system + f"question {i}")
        loads = [load(ep, in_flight[ep]) for ep in pool]
        tie = rendezvous_order(index.first_block(system), pool)
        ranked = rank_endpoints(loads, 1_000, index.matches(h), len(h), W, tie)
        best = ranked[0]
        if in_flight[best] + 1_000 > 10_000:
            break
        picks.append(best)
        in_flight[best] += 1_000
        index.record(h, best)
        if any(v > 8_500 for v in in_flight.values()):
            assert all(v > 0 for v in in_flight.values())
    assert len(picks) == 36  # never a pick that did not fit
    assert set(picks) == set(pool)


# --- cost ------------------------------------------------------------------------------------


def bench() -> None:
    import itertools
    import timeit

    def us(stmt: str, number: int, **names: object) -> str:
        best = min(timeit.repeat(stmt, number=number, repeat=7, globals=names)) / number
        return f"{best * 1e6:8.1f} µs"

    rng = random.Random(1)
    alphabet = "abcdefghij klmnopqrstuvwxyz,."

    def text(n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    index = PrefixIndex()
    t8k, t100k = text(8_192), text(100_000)
    h = index.block_hashes(t8k)
    print("block_hashes 8k chars      ", us("index.block_hashes(t)", 2_000, index=index, t=t8k))
    print("block_hashes 100k chars    ", us("index.block_hashes(t)", 2_000, index=index, t=t100k))
    for i in range(800):  # fill it: 100k entries from 32 endpoints
        index.record(index.block_hashes(text(8_192)), f"vllm-pool/10.0.0.{i % 32}:8000")
    print("entries                    ", len(index))
    print("matches, miss              ", us("index.matches(h)", 20_000, index=index, h=h))
    index.record(h, "vllm-pool/10.0.0.1:8000")
    print("matches, 128 on one        ", us("index.matches(h)", 5_000, index=index, h=h))
    for i in range(2, 5):
        index.record(h, f"vllm-pool/10.0.0.{i}:8000")
    print("matches, 128 on four       ", us("index.matches(h)", 5_000, index=index, h=h))
    print(
        "record, same endpoint      ",
        us("index.record(h, 'vllm-pool/10.0.0.4:8000')", 5_000, index=index, h=h),
    )
    # More prompts than the index holds, so each comes back evicted: always 128 new blocks.
    it = itertools.cycle([index.block_hashes(text(8_192)) for _ in range(2_000)])
    print(
        "record, 128 new, evicting  ",
        us("index.record(next(it), 'vllm-pool/10.0.0.9:8000')", 2_000, index=index, it=it),
    )
    for n in (3, 32):
        keys = [f"vllm-pool/10.0.0.{i}:8000" for i in range(n)]
        loads = [
            EndpointLoad(k, 100_000, rng.randrange(90_000), rng.randrange(50), 64, 0) for k in keys
        ]
        matched = {keys[0]: 100, keys[1]: 40}
        tie = rendezvous_order(t8k[:64], keys)
        names = {"rank": rank_endpoints, "loads": loads, "m": matched, "tie": tie, "w": W}
        print(
            f"rank_endpoints {n:2d}          ",
            us("rank(loads, 4000, m, 128, w, tie)", 20_000, **names),
        )
        print(
            f"rendezvous_order {n:2d}        ",
            us("order(b, keys)", 20_000, order=rendezvous_order, b=t8k[:64], keys=keys),
        )
    print(
        "forget                     ", us("index.forget('vllm-pool/10.0.0.9:8000')", 1, index=index)
    )


if __name__ == "__main__":
    bench()
