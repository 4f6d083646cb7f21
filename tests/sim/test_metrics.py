"""/metrics carries vLLM's names and labels, and agrees with /sim/stats."""

from __future__ import annotations

import asyncio

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, chat_body, scrape, stats, value, wait_for


async def test_metric_names_and_labels(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=128, block_size=32)
    samples = await scrape(client)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert value(samples, name) == 0.0
    for reason in ("stop", "length", "abort"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0.0
    [(labels, one)] = samples["vllm:cache_config_info"]
    assert one == 1.0
    assert labels["num_gpu_blocks"] == "128"
    assert labels["block_size"] == "32"
    assert labels["cache_dtype"] == "auto"
    assert labels["engine"] == "0"


async def test_metrics_agree_with_stats(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=12, block_size=16)
    bodies = [chat_body(max_tokens=40), chat_body(max_tokens=5), chat_body(max_tokens=60)]
    headers = {"x-sim-output-tokens": "30"}
    await asyncio.gather(*(client.post(CHAT, json=b, headers=headers) for b in bodies * 3))
    snap = await stats(client)
    samples = await scrape(client)
    assert value(samples, "vllm:prompt_tokens_total") == snap["prompt_tokens_total"]
    assert value(samples, "vllm:generation_tokens_total") == snap["completion_tokens_total"]
    assert value(samples, "vllm:num_preemptions_total") == snap["preemptions"]
    assert value(samples, "vllm:num_requests_running") == snap["running"] == 0
    assert value(samples, "vllm:num_requests_waiting") == snap["waiting"] == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0
    reasons = [r["finish_reason"] for r in snap["served"]]
    for reason in ("stop", "length", "abort"):
        got = value(samples, "vllm:request_success_total", finished_reason=reason)
        assert got == reasons.count(reason)
    assert reasons.count("length") == 3 and reasons.count("stop") == 6
    assert snap["completion_tokens_total"] == 3 * (30 + 5 + 30)


async def test_live_gauges_and_reset(make_client: MakeClient) -> None:
    client = await make_client(num_gpu_blocks=10, block_size=16)
    headers = {"x-sim-stall-after": "2"}
    resp = await client.post(CHAT, json=chat_body(stream=True, max_tokens=50), headers=headers)
    await resp.content.readuntil(b"\n\n")  # role chunk
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    snap = await stats(client)
    samples = await scrape(client)
    assert snap["running"] == 1
    assert value(samples, "vllm:num_requests_running") == 1
    usage = value(samples, "vllm:kv_cache_usage_perc")
    assert usage == snap["kv_blocks_used"] / 10 and usage > 0
    resp.close()
    await wait_for(client, lambda s: s["aborted_total"] == 1 and s["kv_blocks_used"] == 0)
    assert value(await scrape(client), "vllm:request_success_total", finished_reason="abort") == 1

    reset = await client.post("/sim/reset")
    assert (await reset.json()) == {"ok": True}
    snap = await stats(client)
    assert snap["requests_total"] == 0 and snap["served"] == []
    assert value(await scrape(client), "vllm:prompt_tokens_total") == 0
