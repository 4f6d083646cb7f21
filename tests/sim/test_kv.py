"""KV-cache accounting and scheduling: capacity, preemption, FIFO waiting, release."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, chat_body, stats, wait_for
from vllm_sim.engine import KVEngine, SeqState, SimRequest


def _req(name: str, prompt: int, out: int) -> SimRequest:
    return SimRequest(
        request_id=name, prompt_tokens=prompt, target_tokens=out, finish_reason="length"
    )


async def _run(engine: KVEngine, req: SimRequest) -> None:
    async for _ in engine.generate(req, ttft_s=0, itl_s=0):
        pass
    engine.finish(req)


async def test_engine_within_capacity_never_preempts() -> None:
    engine = KVEngine(num_gpu_blocks=8, block_size=16, max_num_seqs=8)
    # Each grows to ceil((20 + 44) / 16) = 4 blocks: two fit exactly.
    reqs = [_req("a", 20, 44), _req("b", 20, 44)]
    for r in reqs:
        engine.submit(r)
    await asyncio.gather(*(_run(engine, r) for r in reqs))
    assert engine.stats.preemptions == 0
    assert engine.stats.peak_blocks_used == 8
    assert 120 < engine.stats.peak_kv_tokens_used <= 128
    assert engine.used_blocks == 0 and engine.kv_tokens_used == 0
    assert all(r.generated == 44 and r.state is SeqState.FINISHED for r in reqs)


async def test_engine_over_capacity_preempts_youngest_and_recovers() -> None:
    engine = KVEngine(num_gpu_blocks=8, block_size=16, max_num_seqs=8)
    reqs = [_req(str(i), 20, 40) for i in range(4)]  # 2 blocks each on admission
    for r in reqs:
        engine.submit(r)
    assert len(engine.running) == 4 and engine.used_blocks == 8
    await asyncio.gather(*(_run(engine, r) for r in reqs))
    assert engine.stats.preemptions > 0
    assert engine.stats.peak_blocks_used <= 8
    assert all(r.generated == 40 for r in reqs)
    # The oldest request is never the victim while younger ones run.
    assert reqs[0].preemptions == 0
    assert engine.stats.prompt_tokens_total == 4 * 20  # recompute is not recounted


async def test_engine_waits_fifo_when_prompt_does_not_fit() -> None:
    engine = KVEngine(num_gpu_blocks=4, block_size=16, max_num_seqs=8)
    big = _req("big", 40, 10)  # 3 blocks
    small1 = _req("s1", 20, 2)  # 2 blocks: does not fit beside big
    small2 = _req("s2", 5, 2)  # 1 block: would fit, but FIFO keeps it behind s1
    for r in (big, small1, small2):
        engine.submit(r)
    assert [r.request_id for r in engine.running] == ["big"]
    assert [r.request_id for r in engine.waiting] == ["s1", "s2"]
    await asyncio.gather(*(_run(engine, r) for r in (big, small1, small2)))
    assert engine.stats.preemptions == 0
    assert engine.stats.peak_running <= 2


async def test_engine_max_num_seqs() -> None:
    engine = KVEngine(num_gpu_blocks=100, block_size=16, max_num_seqs=2)
    reqs = [_req(str(i), 10, 3) for i in range(5)]
    for r in reqs:
        engine.submit(r)
    assert len(engine.running) == 2 and len(engine.waiting) == 3
    await asyncio.gather(*(_run(engine, r) for r in reqs))
    assert engine.stats.peak_running == 2


async def test_engine_abort_releases_blocks() -> None:
    engine = KVEngine(num_gpu_blocks=4, block_size=16, max_num_seqs=8)
    a, b = _req("a", 40, 10), _req("b", 40, 10)
    engine.submit(a)
    engine.submit(b)
    assert engine.used_blocks == 3 and list(engine.waiting) == [b]
    engine.abort(a)
    assert a.aborted and a.final_reason == "abort"
    assert engine.running == [b] and engine.used_blocks == 3


async def _post_all(client: TestClient, n: int, out: int) -> list[dict]:
    body = chat_body(max_tokens=out)
    headers = {"x-sim-output-tokens": "1000"}  # run to max_tokens
    resps = await asyncio.gather(*(client.post(CHAT, json=body, headers=headers) for _ in range(n)))
    return [await r.json() for r in resps]


async def test_server_over_capacity_preempts(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=12, block_size=16, itl_ms=1)
    results = await _post_all(client, 6, 60)
    assert all(r["usage"]["completion_tokens"] == 60 for r in results)
    snap = await stats(client)
    assert snap["preemptions"] > 0
    assert snap["peak_blocks_used"] <= 12
    assert snap["peak_kv_tokens_used"] <= 12 * 16
    assert snap["kv_blocks_used"] == 0 and snap["running"] == 0 and snap["waiting"] == 0
    assert sum(r["preemptions"] for r in snap["served"]) == snap["preemptions"]


async def test_server_within_capacity_no_preemption(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=64, block_size=16, itl_ms=1)
    results = await _post_all(client, 6, 60)
    prompt = results[0]["usage"]["prompt_tokens"]
    snap = await stats(client)
    assert snap["preemptions"] == 0
    per_request_blocks = -(-(prompt + 60) // 16)
    assert snap["peak_blocks_used"] == 6 * per_request_blocks
    assert snap["peak_running"] == 6


async def test_server_tiny_cache_clamps_context(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=4, block_size=16)
    card = (await (await client.get("/v1/models")).json())["data"][0]
    assert card["max_model_len"] == 64
    resp = await client.post(CHAT, json=chat_body(max_tokens=30))
    assert resp.status == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_releases_blocks(make_client: MakeClient, stream: bool) -> None:
    client = await make_client(num_gpu_blocks=32, block_size=16)
    body = chat_body(stream=stream, max_tokens=100)
    headers = {"x-sim-stall-after": "3"}
    if stream:
        resp = await client.post(CHAT, json=body, headers=headers)
        events = [await resp.content.readuntil(b"\n\n") for _ in range(4)]
        assert json.loads(events[-1][6:])["choices"][0]["delta"]["content"] == " sat"
    else:
        # A non-streaming answer never starts: hang up from the client side.
        pending = asyncio.create_task(client.post(CHAT, json=body, headers=headers))
    busy = await wait_for(client, lambda s: s["running"] == 1 and s["kv_tokens_used"] > 0)
    assert busy["kv_blocks_used"] > 0
    if stream:
        resp.close()  # the client goes away mid-stream
    else:
        await wait_for(client, lambda s: s["completion_tokens_total"] == 3)
        pending.cancel()
    snap = await wait_for(client, lambda s: s["aborted_total"] == 1)
    assert snap["kv_blocks_used"] == 0 and snap["running"] == 0 and snap["kv_tokens_used"] == 0
    [served] = snap["served"]
    assert served["aborted"] is True and served["finished"] is False
    assert served["finish_reason"] == "abort"
    assert served["completion_tokens_sent"] == (3 if stream else 0)
    # A stalled engine stops generating: nothing beyond what the stall allowed.
    assert served["completion_tokens_generated"] == 3


def test_engine_refuses_a_sequence_larger_than_the_cache() -> None:
    engine = KVEngine(num_gpu_blocks=2, block_size=16, max_num_seqs=8)
    with pytest.raises(ValueError, match="more than the cache"):
        engine.submit(_req("huge", 20, 20))
