"""Tenant limits through the ext_proc session: 429 headers, budget actions, usage report."""

from __future__ import annotations

import json
from typing import Any

from tests.session.conftest import (
    SessionRig,
    _rig,
    body_msg,
    header_values,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
)

CHAT = {
    "model": "qwen2.5-demo",
    "messages": [{"role": "user", "content": "Summarise the plot of Hamlet."}],
    "max_tokens": 400,
}


def tenant_config(**tenant: Any) -> dict[str, Any]:
    config = make_config()
    config["tenants"][0].update(tenant)
    big = config["models"][0]
    big["pricing"] = {"input_per_million": "10", "output_per_million": "30"}
    small = dict(
        big, name="small-demo", pricing={"input_per_million": "1", "output_per_million": "2"}
    )
    config["models"].append(small)
    return config


async def admit(rig: SessionRig, body: dict[str, Any]):
    stream = rig.stream()
    await stream.exchange(headers_msg())
    return stream, await stream.exchange(body_msg(body))


async def finish(stream, prompt: int, output: int):
    await stream.exchange(response_headers_msg(content_type="application/json"))
    payload = json.dumps(
        {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": output,
                "total_tokens": prompt + output,
            }
        }
    ).encode()
    return await stream.exchange(response_body_msg(payload, end_of_stream=True))


async def test_tpm_429_carries_openai_headers_and_admitted_responses_too() -> None:
    config = tenant_config(limits={"tpm": {"capacity": 1000, "refill_per_s": 10}, "rpm": 100})
    async for rig in _rig(config):
        first, reply = await admit(rig, CHAT)
        assert reply.WhichOneof("response") == "request_body"
        done = await finish(first, 20, 5)
        assert done.WhichOneof("response") == "response_body"

        # The admitted response carried the limits as the client will see them.
        again = rig.stream()
        await again.exchange(headers_msg())
        await again.exchange(body_msg(CHAT))
        headers_reply = await again.exchange(response_headers_msg(content_type="application/json"))
        seen = header_values(headers_reply.response_headers.response.header_mutation)
        assert seen["x-ratelimit-limit-tokens"] == "1000"
        assert seen["x-ratelimit-limit-requests"] == "100"
        assert int(seen["x-ratelimit-remaining-tokens"]) < 1000

        # ~975 left after the refund, ~545 after the held request: 630 no longer fits.
        _, rejected = await admit(rig, dict(CHAT, max_tokens=600))
        imm = rejected.immediate_response
        assert imm.status.code == 429
        body = json.loads(imm.body)["error"]
        assert body["code"] == "tpm_exceeded" and body["type"] == "rate_limit_exceeded"
        headers = header_values(imm.headers)
        assert int(headers["retry-after"]) >= 1
        assert int(headers["retry-after-ms"]) >= 1
        assert headers["x-ratelimit-remaining-tokens"].isdigit()


async def test_request_larger_than_the_bucket_is_400_without_retry_after() -> None:
    async for rig in _rig(tenant_config(limits={"tpm": 300})):
        _, reply = await admit(rig, CHAT)
        imm = reply.immediate_response
        assert imm.status.code == 400
        assert json.loads(imm.body)["error"]["code"] == "request_exceeds_tpm"
        assert "retry-after" not in header_values(imm.headers)


async def test_budget_block_is_insufficient_quota_with_reset_time() -> None:
    # Worst case of CHAT on the big model: ~30 prompt x $10/M + 400 x $30/M ~ $0.0123.
    config = tenant_config(budget={"daily_usd": "0.01", "action": "block"})
    async for rig in _rig(config):
        _, reply = await admit(rig, CHAT)
        imm = reply.immediate_response
        assert imm.status.code == 429
        error = json.loads(imm.body)["error"]
        assert error["type"] == "insufficient_quota" and error["code"] == "budget_exceeded"
        # The whole budget is smaller than this request's worst case: waiting cannot help.
        assert "retry-after" not in header_values(imm.headers)


async def test_budget_clamp_lowers_max_tokens_and_says_so() -> None:
    config = tenant_config(budget={"daily_usd": "0.006", "action": "clamp"})
    async for rig in _rig(config):
        prompt = await rig.server.tokenizers.count_chat("qwen2.5-demo", CHAT["messages"])
        stream, reply = await admit(rig, CHAT)
        common = reply.request_body.response
        forwarded = json.loads(common.body_mutation.body)
        # $0.006 minus the prompt at $10/M, at $30/M per output token.
        # In pico-dollars: $0.006 = 6e9; $10/M = 1e7 per token; $30/M = 3e7 per token.
        affordable = (6_000_000_000 - prompt * 10_000_000) // 30_000_000
        assert forwarded["max_tokens"] == affordable
        headers = await stream.exchange(response_headers_msg(content_type="application/json"))
        notice = header_values(headers.response_headers.response.header_mutation)
        assert notice["x-kvgate-max-tokens-clamped"] == f"400 -> {affordable}"


async def test_budget_fallback_reroutes_to_the_cheaper_model() -> None:
    config = tenant_config(
        budget={"daily_usd": "0.005", "action": "fallback", "fallback_model": "small-demo"}
    )
    async for rig in _rig(config):
        stream, reply = await admit(rig, CHAT)
        common = reply.request_body.response
        routed = header_values(common.header_mutation)
        assert routed["x-kvgate-model"] == "small-demo"
        assert common.clear_route_cache
        assert json.loads(common.body_mutation.body)["model"] == "small-demo"
        headers = await stream.exchange(response_headers_msg(content_type="application/json"))
        notice = header_values(headers.response_headers.response.header_mutation)
        assert notice["x-kvgate-fallback"] == "qwen2.5-demo -> small-demo"


async def test_usage_report_shows_tokens_cost_and_remaining_budget() -> None:
    config = tenant_config(budget={"daily_usd": "1", "monthly_usd": "20"})
    async for rig in _rig(config):
        stream, _ = await admit(rig, CHAT)
        await finish(stream, 1000, 100)  # $0.01 + $0.003
        await rig.server.services.drain(5)
        report_stream = rig.stream()
        reply = await report_stream.exchange(
            headers_msg("/v1/kvgate/usage", "GET", end_of_stream=True)
        )
        imm = reply.immediate_response
        assert imm.status.code == 200
        report = json.loads(imm.body)
        today = report["today"]
        assert report["tenant"] == "acme"
        assert (today["prompt_tokens"], today["output_tokens"]) == (1000, 100)
        assert today["cost_usd"] == "0.013"
        assert today["remaining_usd"] == "0.987"
        assert report["this_month"]["remaining_usd"] == "19.987"
        assert today["by_model"]["qwen2.5-demo"]["requests"] == 1


async def test_shadow_mode_rejects_nothing_and_counts() -> None:
    config = tenant_config(limits={"tpm": {"capacity": 500, "shadow": True}})
    async for rig in _rig(config):
        for _ in range(3):
            _, reply = await admit(rig, CHAT)
            assert reply.WhichOneof("response") == "request_body"
        samples = {
            (s.labels["tenant"], s.labels["limit"]): s.value
            for m in rig.server.metrics.shadow_rejections.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        assert samples[("acme", "tpm")] >= 2


async def test_a_tenant_over_its_limit_is_turned_away_before_tokenizing() -> None:
    async for rig in _rig(tenant_config(limits={"rpm": 1})):
        _, first = await admit(rig, CHAT)
        assert first.WhichOneof("response") == "request_body"
        stats = rig.server.tokenizers.cache_stats()
        _, second = await admit(rig, dict(CHAT, messages=[{"role": "user", "content": "new"}]))
        assert second.immediate_response.status.code == 429
        assert json.loads(second.immediate_response.body)["error"]["code"] == "rpm_exceeded"
        after = rig.server.tokenizers.cache_stats()
        # Neither a cache hit nor a miss: the prompt was never counted.
        assert (after.hits, after.misses) == (stats.hits, stats.misses)
