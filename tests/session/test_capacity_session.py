"""KV budget discovered from vLLM's /metrics, and back-pressure, through the ext_proc session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvgate.config import parse_config
from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir
from tests.session.conftest import _rig, body_msg, headers_msg, make_config
from vllm_sim import SimConfig, create_app

CHAT = {"model": "qwen2.5-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
async def sim() -> AsyncIterator[TestServer]:
    config = SimConfig(
        model_dir=Path(demo_model_dir()),
        served_model_name=DEMO_MODEL_NAME,
        num_gpu_blocks=1000,
        block_size=32,
    )
    server = TestServer(create_app(config))
    await server.start_server()
    yield server
    await server.close()


def auto_config(sim: TestServer, **backend: Any) -> dict[str, Any]:
    config = make_config()
    config["backends"][0] = {
        "name": "gpu-a",
        "kv_budget_tokens": "auto",
        "discovery": {
            "metrics_url": str(sim.make_url("/metrics")),
            "interval_s": 0.2,
            "max_staleness_s": 1.0,
            "timeout_s": 0.5,
        },
        **backend,
    }
    return config


async def test_auto_budget_comes_from_the_engine(sim: TestServer) -> None:
    async for rig in _rig(auto_config(sim)):
        stream = rig.stream()
        await stream.exchange(headers_msg())
        reply = await stream.exchange(body_msg(CHAT))
        assert reply.WhichOneof("response") == "request_body"
        [status] = await rig.server.store.backend_status()
        # 1,000 blocks x 32 tokens, and reservations rounded to the engine's 32-token blocks.
        assert status.kv_budget_tokens == 32_000
        assert status.kv_tokens_in_flight % 32 == 0
        too_big = rig.stream()
        await too_big.exchange(headers_msg())
        reply = await too_big.exchange(body_msg(dict(CHAT, max_tokens=32_500)))
        error = json.loads(reply.immediate_response.body)["error"]
        assert error["code"] in ("request_exceeds_kv_budget", "context_length_exceeded")


async def test_auto_budget_unknown_is_503_not_a_guess() -> None:
    config = make_config()
    config["backends"][0] = {
        "name": "gpu-a",
        "kv_budget_tokens": "auto",
        "discovery": {"metrics_url": "http://127.0.0.1:9/metrics", "timeout_s": 0.2},
    }
    async for rig in _rig(config):
        stream = rig.stream()
        await stream.exchange(headers_msg())
        reply = await stream.exchange(body_msg(CHAT))
        imm = reply.immediate_response
        assert imm.status.code == 503
        assert json.loads(imm.body)["error"]["code"] == "service_unavailable"


async def test_backpressure_sheds_while_the_engine_is_full_and_stale_data_never_sheds(
    sim: TestServer,
) -> None:
    # A threshold below one block's share of the cache: one running request is "full".
    config = auto_config(sim, backpressure={"max_kv_cache_usage": 0.0005, "retry_after_s": 3})
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": [{"role": "user", "content": "x " * 10}],
        "max_tokens": 100,
        "stream": True,
    }
    async for rig in _rig(config):
        async with aiohttp.ClientSession() as client:
            url = sim.make_url("/v1/chat/completions")
            headers = {"x-sim-output-tokens": "100", "x-sim-stall-after": "1"}
            first = await client.post(url, json=body, headers=headers)
            await first.content.readline()
            try:
                shed = None
                for _ in range(50):  # bounded: the monitor polls every 0.2 s
                    stream = rig.stream()
                    await stream.exchange(headers_msg())
                    reply = await stream.exchange(body_msg(CHAT))
                    if reply.WhichOneof("response") == "immediate_response":
                        shed = reply.immediate_response
                        break
                    stream.reset()
                    await asyncio.sleep(0.1)
                assert shed is not None, "the engine's queue never caused shedding"
                assert shed.status.code == 429
                assert json.loads(shed.body)["error"]["code"] == "backend_overloaded"
                headers_out = {h.header.key: h.header.raw_value for h in shed.headers.set_headers}
                assert headers_out["retry-after"] == b"3"
            finally:
                first.close()
        # The engine stops answering: once its numbers are stale they shed nothing, and the
        # budget learnt before stays in force.
        await sim.close()
        await asyncio.sleep(1.5)
        stream = rig.stream()
        await stream.exchange(headers_msg())
        reply = await stream.exchange(body_msg(CHAT))
        assert reply.WhichOneof("response") == "request_body"
        assert parse_config(config).backends[0].kv_budget_tokens == "auto"
