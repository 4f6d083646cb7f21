"""The x-sim-* test steering headers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, event_json, stats, wait_for


async def _usage(client: TestClient, body: dict, **headers: str) -> tuple[dict, str]:
    data = await (await client.post(CHAT, json=body, headers=headers)).json()
    return data["usage"], data["choices"][0]["finish_reason"]


async def test_default_output_rule(make_client: MakeClient) -> None:
    client = await make_client(default_output_tokens=7)
    # min(max_tokens, default): below the cap the model "stops", at the cap "length".
    usage, reason = await _usage(client, chat_body(max_tokens=100))
    assert usage["completion_tokens"] == 7 and reason == "stop"
    usage, reason = await _usage(client, chat_body(max_tokens=5))
    assert usage["completion_tokens"] == 5 and reason == "length"
    usage, reason = await _usage(client, chat_body(max_tokens=7))
    assert usage["completion_tokens"] == 7 and reason == "length"
    # No max_tokens in chat: the cap is the context left.
    usage, reason = await _usage(client, chat_body())
    assert usage["completion_tokens"] == 7 and reason == "stop"


async def test_output_tokens_header(client: TestClient) -> None:
    usage, reason = await _usage(client, chat_body(max_tokens=50), **{"x-sim-output-tokens": "12"})
    assert usage["completion_tokens"] == 12 and reason == "stop"
    usage, reason = await _usage(client, chat_body(max_tokens=10), **{"x-sim-output-tokens": "12"})
    assert usage["completion_tokens"] == 10 and reason == "length"
    usage, reason = await _usage(
        client, chat_body(max_completion_tokens=4), **{"x-sim-output-tokens": "12"}
    )
    assert usage["completion_tokens"] == 4 and reason == "length"


async def test_ignore_max_tokens(client: TestClient) -> None:
    headers = {"x-sim-output-tokens": "25", "x-sim-ignore-max-tokens": "1"}
    usage, reason = await _usage(client, chat_body(max_tokens=5), **headers)
    assert usage["completion_tokens"] == 25 and reason == "stop"
    body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    raw = await (await client.post(CHAT, json=body, headers=headers)).read()
    events = raw.split(b"\n\n")[:-1]
    assert len(events) == 1 + 25 + 1 + 1  # role, tokens, usage, [DONE]
    assert event_json(events[-2])["usage"]["completion_tokens"] == 25


async def test_ignore_max_tokens_still_bound_by_context(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    headers = {"x-sim-output-tokens": "500", "x-sim-ignore-max-tokens": "1"}
    usage, reason = await _usage(client, chat_body(max_tokens=5), **headers)
    assert usage["total_tokens"] == 64 and reason == "length"


async def test_latency_headers(make_client: MakeClient) -> None:
    client = await make_client(ttft_ms=0, itl_ms=0)
    body = chat_body(stream=True, max_tokens=5)
    start = time.monotonic()
    resp = await client.post(
        CHAT, json=body, headers={"x-sim-ttft-ms": "300", "x-sim-itl-ms": "40"}
    )
    assert resp.status == 200
    headers_at = time.monotonic() - start
    await resp.content.readuntil(b"\n\n")
    first = time.monotonic() - start
    assert first - headers_at >= 0.25  # headers go out before prefill
    await resp.read()
    total = time.monotonic() - start
    assert first >= 0.29
    assert total >= 0.29 + 4 * 0.039


async def test_server_default_latency(make_client: MakeClient) -> None:
    client = await make_client(ttft_ms=100, itl_ms=20)
    start = time.monotonic()
    await (await client.post(CHAT, json=chat_body(max_tokens=4))).json()
    assert time.monotonic() - start >= 0.1 + 3 * 0.019


async def test_abort_after_cuts_stream(client: TestClient) -> None:
    body = chat_body(stream=True, max_tokens=50)
    resp = await client.post(CHAT, json=body, headers={"x-sim-abort-after": "4"})
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for data in resp.content.iter_any():
            received += data
    events = [e for e in received.split(b"\n\n") if e]
    assert len(events) == 1 + 4
    assert b"[DONE]" not in received
    snap = await wait_for(client, lambda s: s["aborted_total"] == 1)
    [served] = snap["served"]
    assert served["completion_tokens_sent"] == 4 and served["aborted"] is True
    assert snap["kv_blocks_used"] == 0


async def test_abort_after_non_stream(client: TestClient) -> None:
    with pytest.raises(aiohttp.ClientError):
        await client.post(CHAT, json=chat_body(max_tokens=50), headers={"x-sim-abort-after": "2"})
    snap = await wait_for(client, lambda s: s["aborted_total"] == 1)
    assert snap["served"][0]["completion_tokens_generated"] == 2
    assert snap["served"][0]["completion_tokens_sent"] == 0


async def test_abort_after_zero_sends_headers_only(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 5}
    resp = await client.post(COMPLETIONS, json=body, headers={"x-sim-abort-after": "0"})
    assert resp.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()


async def test_stall_after_holds_until_client_leaves(client: TestClient) -> None:
    body = chat_body(stream=True, max_tokens=50)
    resp = await client.post(CHAT, json=body, headers={"x-sim-stall-after": "2"})
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=0.3)
    snap = await stats(client)
    assert snap["running"] == 1 and snap["kv_blocks_used"] > 0
    resp.close()
    snap = await wait_for(client, lambda s: s["running"] == 0)
    assert snap["kv_blocks_used"] == 0
    assert snap["served"][0]["completion_tokens_sent"] == 2


async def test_bad_steering_header(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(), headers={"x-sim-output-tokens": "many"})
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "BadRequestError"


async def test_ignore_eos_and_min_tokens(client: TestClient) -> None:
    # Benchmark clients pin output lengths with ignore_eos + max_tokens.
    usage, reason = await _usage(client, chat_body(max_tokens=40, ignore_eos=True))
    assert usage["completion_tokens"] == 40 and reason == "length"
    usage, reason = await _usage(client, chat_body(max_tokens=40, min_tokens=25))
    assert usage["completion_tokens"] == 25 and reason == "stop"
