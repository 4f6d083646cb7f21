"""Automatic prefix caching as vLLM v1 does it: chained block hashes, shared
reference-counted blocks, evictable blocks kept until an allocation needs them,
``prompt_tokens_details.cached_tokens`` and the prefix-cache counters."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    event_json,
    scrape,
    split_sse,
    stats,
    value,
)
from vllm_sim.cli import build_parser, config_from_args
from vllm_sim.engine import KVEngine, SimRequest
from vllm_sim.tokenization import SimTokenizer

# --- engine level ------------------------------------------------------------------


def _seq(
    name: str,
    ids: list[int],
    out: int = 1,
    *,
    salt: str | None = None,
    lookup: bool = True,
    output_id: Callable[[int], int] | None = lambda i: 10_000 + i,
) -> SimRequest:
    return SimRequest(
        request_id=name,
        prompt_tokens=len(ids),
        target_tokens=out,
        finish_reason="length",
        prompt_ids=ids,
        output_id=output_id,
        cache_salt=salt,
        prefix_lookup=lookup,
    )


def _engine(blocks: int, block_size: int = 4, *, caching: bool = True, seqs: int = 8) -> KVEngine:
    return KVEngine(
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_num_seqs=seqs,
        enable_prefix_caching=caching,
    )


def _cached_prefix_blocks(engine: KVEngine, ids: list[int]) -> int:
    """How many leading blocks of ``ids`` the cache holds (a lookup that takes nothing)."""
    probe = _seq("probe", ids)
    engine._hash_blocks(probe, len(ids))
    return len(engine.pool.lookup(probe.block_hashes))


def _check_pool(engine: KVEngine) -> None:
    """What the counters claim agrees with the blocks the running requests hold."""
    held = [b for r in engine.running for b in r.block_ids]
    distinct = set(held)
    assert engine.used_blocks == len(distinct)
    assert engine.pool.shared == len(held) - len(distinct)
    tokens = sum(r.num_tokens for r in engine.running)
    assert engine.kv_tokens_used == tokens - engine.pool.shared * engine.block_size
    assert engine.used_blocks <= engine.num_gpu_blocks
    assert all(len(r.block_ids) == engine.blocks_for(r.num_tokens) for r in engine.running)


async def _run(engine: KVEngine, req: SimRequest, check: bool = False) -> None:
    async for _ in engine.generate(req, ttft_s=0, itl_s=0):
        if check:
            _check_pool(engine)
    engine.finish(req)


async def _serve(engine: KVEngine, req: SimRequest) -> None:
    engine.submit(req)
    await _run(engine, req)


async def test_block_hashes_chain_over_full_blocks_only() -> None:
    engine = _engine(32)
    a = _seq("a", list(range(10)))  # blocks [0..3] [4..7] and a partial [8, 9]
    engine.submit(a)
    assert len(a.block_hashes) == 2  # the partial block has no hash
    twin = _seq("twin", list(range(10)))
    engine._hash_blocks(twin, 10)
    assert twin.block_hashes == a.block_hashes
    # Block 1 holds the same tokens, but its parent differs: so does its hash.
    other = _seq("other", [99, 1, 2, 3, *range(4, 10)])
    engine._hash_blocks(other, 10)
    assert other.block_hashes[0] != a.block_hashes[0]
    assert other.block_hashes[1] != a.block_hashes[1]
    # A cache_salt changes the first block, and so the whole chain.
    salted = _seq("salted", list(range(10)), salt="s3cret")
    engine._hash_blocks(salted, 10)
    assert all(x != y for x, y in zip(salted.block_hashes, a.block_hashes, strict=True))
    await _run(engine, a)


async def test_partial_block_is_never_cached() -> None:
    engine = _engine(32)
    await _serve(engine, _seq("a", list(range(10))))
    assert engine.pool.num_cached == 2 and engine.used_blocks == 0
    # Same 10 tokens plus two: the first 8 hit, the 9th and 10th were in a partial block.
    b = _seq("b", [*range(10), 50, 51])
    engine.submit(b)
    assert b.num_cached_tokens == 8 and b.prefill_tokens == 4
    await _run(engine, b)


async def test_full_hit_recomputes_the_last_block() -> None:
    engine = _engine(32)
    await _serve(engine, _seq("a", list(range(8))))  # two full blocks, both cached
    again = _seq("again", list(range(8)))
    engine.submit(again)
    # Every block matches, but vLLM computes at least the last token: one block back.
    assert again.num_cached_tokens == 4 and again.prefill_tokens == 4
    await _run(engine, again)
    longer = _seq("longer", list(range(9)))
    engine.submit(longer)
    assert longer.num_cached_tokens == 8 and longer.prefill_tokens == 1
    await _run(engine, longer)
    assert engine.stats.prefix_cache_queries == 8 + 8 + 9
    assert engine.stats.prefix_cache_hits == 0 + 4 + 8


async def test_generated_tokens_fill_cacheable_blocks() -> None:
    """A follow-up whose prompt continues the previous answer reuses the answer's KV
    (blocks filled by tokens fed back to the model; the last sample never is)."""
    engine = _engine(32)
    outputs = [10_000 + i for i in range(6)]
    await _serve(engine, _seq("a", list(range(6)), out=6))
    # Tokens fed: 6 prompt + 5 outputs = 11 -> two full blocks cached.
    assert engine.pool.num_cached == 2
    follow = _seq("follow", [*range(6), *outputs, 77, 78])
    engine.submit(follow)
    assert follow.num_cached_tokens == 8
    await _run(engine, follow)


async def test_shared_blocks_are_charged_once() -> None:
    engine = _engine(10)
    prefix = list(range(16))
    a, b = _seq("a", [*prefix, 100], out=3), _seq("b", [*prefix, 200], out=3)
    engine.submit(a)
    engine.submit(b)
    # Each holds 5 blocks (17 tokens); four of them are the same physical blocks.
    assert len(engine.running) == 2 and a.blocks == b.blocks == 5
    assert a.block_ids[:4] == b.block_ids[:4]
    assert engine.used_blocks == 6 and engine.pool.shared == 4
    assert engine.kv_tokens_used == 17 + 17 - 16
    _check_pool(engine)
    await asyncio.gather(_run(engine, a, check=True), _run(engine, b, check=True))
    assert engine.used_blocks == 0 and engine.kv_tokens_used == 0 and engine.pool.shared == 0
    assert engine.kv_usage == 0.0  # cached blocks nobody holds count as free
    assert engine.pool.num_cached == engine.pool.num_evictable > 0


async def test_without_caching_twins_do_not_share() -> None:
    engine = _engine(9, caching=False)
    prefix = list(range(16))
    a, b = _seq("a", [*prefix, 100], out=3), _seq("b", [*prefix, 200], out=3)
    engine.submit(a)
    engine.submit(b)
    assert [r.request_id for r in engine.running] == ["a"]  # 5 + 5 blocks > 9: b waits
    assert engine.pool.num_cached == 0 and engine.stats.prefix_cache_queries == 0
    await asyncio.gather(_run(engine, a), _run(engine, b))
    assert engine.stats.peak_running == 1 and b.cached_tokens == 0


async def test_lru_eviction_takes_the_oldest_freed_tail_first() -> None:
    engine = _engine(6)
    a_ids, b_ids = list(range(9)), list(range(100, 109))
    await _serve(engine, _seq("a", a_ids))  # 3 blocks: 2 cached + a partial one
    await _serve(engine, _seq("b", b_ids))
    # B took never-used blocks: A's cached blocks survived it.
    assert engine.pool.num_cached == 4 and engine.pool.evictions == 0
    assert engine.free_blocks == 6
    # C needs 2 blocks: the oldest freed are A's, tail first (its partial block, then
    # its second block); A's first block and all of B's stay.
    await _serve(engine, _seq("c", list(range(200, 205))))
    assert engine.pool.evictions == 1
    assert _cached_prefix_blocks(engine, a_ids) == 1
    assert _cached_prefix_blocks(engine, b_ids) == 2
    a2 = _seq("a2", a_ids)
    await _serve(engine, a2)
    assert a2.num_cached_tokens == 4


async def test_eviction_only_when_an_allocation_needs_blocks() -> None:
    engine = _engine(4)
    await _serve(engine, _seq("a", list(range(9))))  # 3 blocks, 2 cached
    assert engine.pool.num_cached == 2 and engine.free_blocks == 4
    # A request that needs every block evicts what it must, and runs.
    big = _seq("big", list(range(300, 313)), out=3)  # 13 + 3 tokens = 4 blocks
    await _serve(engine, big)
    assert engine.pool.evictions == 2 and big.generated == 3


async def test_preemption_with_caching_recovers_and_rehits() -> None:
    engine = _engine(8, block_size=16)
    reqs = [_seq(str(i), [i * 1000 + t for t in range(20)], out=40) for i in range(4)]
    for r in reqs:
        engine.submit(r)
    await asyncio.gather(*(_run(engine, r, check=True) for r in reqs))
    assert engine.stats.preemptions > 0
    assert engine.stats.peak_blocks_used <= 8
    assert all(r.generated == 40 for r in reqs)
    assert reqs[0].preemptions == 0
    assert engine.stats.prompt_tokens_total == 4 * 20
    # A re-admission finds its own freed blocks (its cached tokens stay the first
    # admission's, as vLLM's num_cached_tokens).
    assert engine.stats.prefix_cache_hits > 0
    assert all(r.cached_tokens == 0 for r in reqs)
    assert engine.used_blocks == 0 and engine.pool.shared == 0


async def test_shared_prefix_churn_keeps_the_books() -> None:
    """Many requests over a few shared prefixes on a small cache: preemption,
    sharing and eviction together never break the block accounting."""
    rng = random.Random(7)
    engine = _engine(24, seqs=6)
    prefixes = [[p * 100 + t for t in range(rng.randint(4, 14))] for p in range(3)]
    reqs = [
        _seq(
            str(i), [*rng.choice(prefixes), *range(i, i + rng.randint(1, 6))], out=rng.randint(1, 9)
        )
        for i in range(40)
    ]

    async def one(req: SimRequest) -> None:
        await asyncio.sleep(rng.random() / 200)
        engine.submit(req)
        await _run(engine, req, check=True)

    await asyncio.gather(*(one(r) for r in reqs))
    assert all(r.generated == r.target_tokens for r in reqs)
    assert engine.used_blocks == 0 and engine.pool.shared == 0
    assert engine.stats.prefix_cache_hits > 0
    assert engine.pool.num_evictable == engine.pool.num_cached


async def test_prompt_logprobs_skip_the_lookup_but_fill_the_cache() -> None:
    engine = _engine(32)
    first = _seq("first", list(range(9)), lookup=False)
    await _serve(engine, first)
    assert engine.stats.prefix_cache_queries == 0 and engine.pool.num_cached == 2
    again = _seq("again", list(range(9)), lookup=False)
    await _serve(engine, again)
    assert again.num_cached_tokens == 0
    plain = _seq("plain", list(range(9)))
    await _serve(engine, plain)
    assert plain.num_cached_tokens == 8


async def test_caching_off_changes_nothing() -> None:
    engine = _engine(32, caching=False)
    await _serve(engine, _seq("a", list(range(9))))
    b = _seq("b", list(range(9)))
    await _serve(engine, b)
    assert b.num_cached_tokens == 0 and b.prefill_tokens == 9
    assert engine.pool.num_cached == 0 and engine.stats.prefix_cache_queries == 0


# --- server level ------------------------------------------------------------------


def _ids(tok: SimTokenizer, n: int, offset: int = 0) -> list[int]:
    words = tok.word_ids
    return [words[(offset + i) % len(words)] for i in range(n)]


async def _completion(client: TestClient, **body: Any) -> dict[str, Any]:
    resp = await client.post(COMPLETIONS, json={"model": MODEL, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_server_twins_with_a_1000_token_prefix_fit_only_when_shared(
    make_client: MakeClient, sim_tokenizer: SimTokenizer
) -> None:
    """Two 1,008-token prompts sharing their first 1,000 tokens, 8 tokens out: 64
    blocks each of 100. Shared (62 full blocks), both run at once; unshared, the
    second waits for the first."""
    prefix = _ids(sim_tokenizer, 1000)
    prompts = [[*prefix, *_ids(sim_tokenizer, 8, offset=k + 1)] for k in range(2)]
    for caching in (True, False):
        client = await make_client(
            num_gpu_blocks=100, block_size=16, itl_ms=5, enable_prefix_caching=caching
        )
        bodies = [{"prompt": p, "max_tokens": 8, "ignore_eos": True} for p in prompts]
        results = await asyncio.gather(*(_completion(client, **b) for b in bodies))
        assert all(r["usage"]["completion_tokens"] == 8 for r in results)
        snap = await stats(client)
        assert snap["preemptions"] == 0
        if caching:
            assert snap["peak_running"] == 2
            assert snap["peak_blocks_used"] == 64 + 64 - 62
            assert snap["peak_kv_tokens_used"] <= 66 * 16
            assert sorted(s["cached_tokens"] for s in snap["served"]) == [0, 992]
            assert snap["prefix_cache_hits_total"] == 992
        else:
            assert snap["peak_running"] == 1
            assert snap["peak_blocks_used"] == 64
            assert snap["prefix_cache_queries_total"] == 0


def _usage_from_stream(raw: bytes) -> dict[str, Any]:
    events = split_sse(raw)
    assert events[-1] == b"data: [DONE]"
    last = event_json(events[-2])
    assert last["choices"] == []
    return last["usage"]


async def _ask(client: TestClient, api: str, stream: bool, prompt: Any) -> tuple[bytes, Any]:
    if api == "chat":
        path, body = CHAT, {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = COMPLETIONS, {"prompt": prompt}
    body.update(model=MODEL, max_tokens=3, ignore_eos=True)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    raw = await resp.read()
    return raw, _usage_from_stream(raw) if stream else json.loads(raw)["usage"]


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("details", [True, False])
async def test_cached_tokens_in_usage(
    make_client: MakeClient, sim_tokenizer: SimTokenizer, api: str, stream: bool, details: bool
) -> None:
    client = await make_client(
        block_size=16, enable_prefix_caching=True, enable_prompt_tokens_details=details
    )
    text = "Summarise:" + "".join(sim_tokenizer.word_texts[i % 20] for i in range(200))
    raw, first = await _ask(client, api, stream, text)
    prompt = first["prompt_tokens"]
    # A cold cache: vLLM leaves the details out when nothing was cached.
    expected_first = {"prompt_tokens": prompt, "total_tokens": prompt + 3, "completion_tokens": 3}
    if not stream:
        expected_first["prompt_tokens_details"] = None
    assert first == expected_first
    raw, again = await _ask(client, api, stream, text)
    cached = (prompt - 1) // 16 * 16
    usage = f'"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + 3},"completion_tokens":3'
    if details:
        assert again["prompt_tokens_details"] == {"cached_tokens": cached}
        assert (usage + f',"prompt_tokens_details":{{"cached_tokens":{cached}}}}}').encode() in raw
    elif stream:
        assert "prompt_tokens_details" not in again
        assert (usage + "}").encode() in raw
    else:
        assert again["prompt_tokens_details"] is None
        assert (usage + ',"prompt_tokens_details":null}').encode() in raw
    snap = await stats(client)
    assert [s["cached_tokens"] for s in snap["served"]] == [0, cached]


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_continuous_usage_chunks_carry_no_details(make_client: MakeClient, api: str) -> None:
    client = await make_client(enable_prefix_caching=True, enable_prompt_tokens_details=True)
    text = "One two three four five six seven eight nine ten eleven twelve " * 4
    if api == "chat":
        path, body = CHAT, {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = COMPLETIONS, {"prompt": text}
    body.update(
        model=MODEL,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    await (await client.post(path, json=body)).read()
    raw = await (await client.post(path, json=body)).read()
    events = [event_json(e) for e in split_sse(raw)[:-1]]
    for chunk in events[:-1]:
        # Chat chunks leave unset fields out; completion chunks dump them as null.
        assert chunk["usage"].get("prompt_tokens_details", "absent") == (
            "absent" if api == "chat" else None
        )
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_n_fans_out_into_sharing_sequences(make_client: MakeClient) -> None:
    client = await make_client(
        block_size=16, enable_prefix_caching=True, enable_prompt_tokens_details=True
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about " * 10}],
        "n": 3,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = await (await client.post(CHAT, json=body)).read()
    usage = _usage_from_stream(raw)
    # The first sequence admitted found a cold cache; a stream reports its count.
    assert "prompt_tokens_details" not in usage
    snap = await stats(client)
    cached = (usage["prompt_tokens"] - 1) // 16 * 16
    assert sorted(s["cached_tokens"] for s in snap["served"]) == [0, cached, cached]


async def test_prefix_cache_counters_on_metrics(make_client: MakeClient) -> None:
    client = await make_client(block_size=16, enable_prefix_caching=True)
    samples = await scrape(client)
    assert value(samples, "vllm:prefix_cache_queries_total") == 0
    assert value(samples, "vllm:prefix_cache_hits_total") == 0
    [(labels, _)] = samples["vllm:cache_config_info"]
    assert labels["enable_prefix_caching"] == "True"
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    first = await _completion(client, prompt=prompt, max_tokens=2)
    await _completion(client, prompt=prompt, max_tokens=2)
    p = first["usage"]["prompt_tokens"]
    samples = await scrape(client)
    snap = await stats(client)
    assert value(samples, "vllm:prefix_cache_queries_total") == 2 * p
    assert value(samples, "vllm:prefix_cache_hits_total") == (p - 1) // 16 * 16
    assert snap["prefix_cache_queries_total"] == 2 * p
    assert snap["prefix_cache_hits_total"] == (p - 1) // 16 * 16
    assert snap["prefix_cache_blocks"] == snap["prefix_cache_evictable_blocks"] >= p // 16
    assert snap["kv_blocks_used"] == 0 and snap["kv_cache_usage"] == 0.0
    assert snap["config"]["enable_prefix_caching"] is True


async def test_counters_stay_zero_with_caching_off(make_client: MakeClient) -> None:
    client = await make_client(enable_prompt_tokens_details=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    await _completion(client, prompt=prompt, max_tokens=2)
    second = await _completion(client, prompt=prompt, max_tokens=2)
    assert second["usage"]["prompt_tokens_details"] is None
    samples = await scrape(client)
    assert value(samples, "vllm:prefix_cache_queries_total") == 0
    assert value(samples, "vllm:prefix_cache_hits_total") == 0
    [(labels, _)] = samples["vllm:cache_config_info"]
    assert labels["enable_prefix_caching"] == "False"
    snap = await stats(client)
    assert snap["prefix_caching"] is False and snap["prefix_cache_blocks"] == 0


async def test_reset_empties_the_cache(make_client: MakeClient) -> None:
    client = await make_client(enable_prefix_caching=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    await _completion(client, prompt=prompt, max_tokens=2)
    assert (await stats(client))["prefix_cache_blocks"] > 0
    await client.post("/sim/reset")
    snap = await stats(client)
    assert snap["prefix_cache_blocks"] == 0 and snap["prefix_cache_hits_total"] == 0
    await _completion(client, prompt=prompt, max_tokens=2)
    assert (await stats(client))["prefix_cache_hits_total"] == 0


async def test_prompt_logprobs_and_echo_logprobs_bypass_the_cache(make_client: MakeClient) -> None:
    client = await make_client(enable_prefix_caching=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    await _completion(client, prompt=prompt, max_tokens=2)
    await _completion(client, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    await _completion(client, prompt=prompt, max_tokens=2, prompt_logprobs=1)
    await _completion(client, prompt=prompt, max_tokens=2, echo=True)  # no logprobs: looks up
    snap = await stats(client)
    assert [s["cached_tokens"] > 0 for s in snap["served"]] == [False, False, False, True]


async def test_cache_salt_separates_and_is_checked(make_client: MakeClient) -> None:
    client = await make_client(enable_prefix_caching=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    await _completion(client, prompt=prompt, max_tokens=2, cache_salt="alice")
    await _completion(client, prompt=prompt, max_tokens=2, cache_salt="bob")
    await _completion(client, prompt=prompt, max_tokens=2, cache_salt="alice")
    await _completion(client, prompt=prompt, max_tokens=2)
    snap = await stats(client)
    assert [s["cached_tokens"] > 0 for s in snap["served"]] == [False, False, True, False]
    for path, body in (
        (COMPLETIONS, {"prompt": "hi", "cache_salt": ""}),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "cache_salt": 5}),
    ):
        resp = await client.post(path, json={"model": MODEL, **body})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["type"] == "Bad Request"
        assert "Parameter 'cache_salt' must be a non-empty string if provided." in error["message"]


async def test_ttft_counts_only_uncached_prompt_tokens(
    make_client: MakeClient, sim_tokenizer: SimTokenizer
) -> None:
    client = await make_client(
        block_size=16, enable_prefix_caching=True, prefill_ms_per_1k_tokens=500
    )
    prompt = _ids(sim_tokenizer, 1000)

    async def timed() -> float:
        start = time.perf_counter()
        await _completion(client, prompt=prompt, max_tokens=1)
        return time.perf_counter() - start

    cold = await timed()  # 1,000 tokens to prefill: 500 ms
    warm = await timed()  # 992 cached, 8 to prefill: 4 ms
    assert cold >= 0.48, cold
    assert warm < 0.25, warm
    assert [s["cached_tokens"] for s in (await stats(client))["served"]] == [0, 992]


async def test_prefill_cost_without_caching_covers_the_whole_prompt() -> None:
    engine = _engine(300, block_size=16, caching=False)
    req = _seq("a", list(range(1000)))
    engine.submit(req)
    start = asyncio.get_running_loop().time()
    async for _ in engine.generate(req, ttft_s=0.01, itl_s=0, prefill_s_per_token=0.0001):
        pass
    engine.finish(req)
    assert req.prefill_tokens == 1000
    assert asyncio.get_running_loop().time() - start >= 0.01 + 0.1 - 0.005


def test_cli_flags() -> None:
    parser = build_parser()
    base = ["--model-dir", "m"]
    off = config_from_args(parser.parse_args(base))
    assert off.enable_prefix_caching is False
    assert off.enable_prompt_tokens_details is False
    assert off.prefill_ms_per_1k_tokens == 0.0
    on = config_from_args(
        parser.parse_args(
            [
                *base,
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--prefill-ms-per-1k-tokens",
                "40",
            ]
        )
    )
    assert on.enable_prefix_caching and on.enable_prompt_tokens_details
    assert on.prefill_ms_per_1k_tokens == 40.0
    args = parser.parse_args([*base, "--enable-prefix-caching", "--no-enable-prefix-caching"])
    assert config_from_args(args).enable_prefix_caching is False
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args([*base, "--prefill-ms-per-1k-tokens", "-1"]))
