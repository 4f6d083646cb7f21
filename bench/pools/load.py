"""The pools benchmark's load: a streamed chat client that records what a request saw
(`Rec`), and the drivers of each part: a closed loop over a request sequence (part 1), closed
loops per tenant for a phase's duration (part 2), one request at a time with the arms
interleaved (part 3)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.interleaved import Request as OneRequest
from bench.interleaved import Sample, rotated, send
from bench.interleaved import _session as one_connection_session
from bench.loadgen import _StreamClock
from bench.pools.plans import COST_ARMS, MODEL, CostPlan, FairnessPlan, api_key
from bench.prompts import prompt_text
from bench.stack import Arm
from vllm_sim.tokenization import SINGLE_TOKEN_WORDS


@dataclass
class Rec:
    tenant: str
    bench_id: str
    t_send: float = math.nan  # perf_counter
    epoch_send: float = math.nan  # time.time(), to compare with the simulators' records
    t_first: float = math.nan
    t_end: float = math.nan
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    epoch_admitted: float = math.nan  # arrival at a simulator

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def wait_s(self) -> float:
        return self.epoch_admitted - self.epoch_send


def _usage(raw: bytes) -> dict[str, Any] | None:
    for event in reversed(raw.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") and b'"usage":{' in event:
            with contextlib.suppress(ValueError):
                usage = json.loads(event[6:]).get("usage")
                if usage:
                    return dict(usage)
    return None


async def stream_chat(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, rec: Rec
) -> None:
    clock = _StreamClock()
    raw = bytearray()
    rec.epoch_send = time.time()
    rec.t_send = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status == 200:
                async for chunk in resp.content.iter_any():
                    clock.feed(chunk, time.perf_counter())
                    raw += chunk
            else:
                raw += await resp.read()
        rec.t_end = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        rec.t_end = time.perf_counter()
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    if clock.first is not None:
        rec.t_first = clock.first
    if rec.status != 200:
        rec.error = f"http {rec.status}: {bytes(raw[:160]).decode(errors='replace')}"
        return
    usage = _usage(bytes(raw))
    if usage is None:
        rec.error = "no usage event"
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = int(details.get("cached_tokens") or 0)


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(SINGLE_TOKEN_WORDS, k=n))


def client_session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, use_dns_cache=False),
        timeout=aiohttp.ClientTimeout(total=120),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def headers_for(t: str, **extra: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {api_key(t)}", **extra}


async def closed_loop(
    base_url: str, sequence: list[tuple[str, bytes]], concurrency: int, out: list[Rec]
) -> float:
    url = f"{base_url}/v1/chat/completions"
    todo = iter(enumerate(sequence))
    async with client_session(concurrency) as session:

        async def worker() -> None:
            for i, (t, body) in todo:
                rec = Rec(t, str(i))
                await stream_chat(session, url, headers_for(t), body, rec)
                out.append(rec)
                if rec.status == 429:
                    await asyncio.sleep(0.1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


async def fair_load(
    base_url: str, load: dict[str, int], plan: FairnessPlan, out: list[Rec], phase: str
) -> tuple[float, float]:
    """Closed loop per client until the phase's end; requests under way then finish."""
    url = f"{base_url}/v1/chat/completions"
    clients = sum(load.values())
    async with client_session(clients + 4) as session:
        t0 = time.perf_counter()
        t_stop = t0 + plan.duration_s

        async def client(t: str, c: int) -> None:
            rng = random.Random(f"{phase}/{t}/{c}")
            i = 0
            while time.perf_counter() < t_stop:
                bench_id = f"{phase}/{t}/{c}/{i}"
                text = f"[{bench_id}] " + words(rng, plan.prompt_words)
                body = chat_body([{"role": "user", "content": text}], plan.max_tokens)
                headers = headers_for(
                    t,
                    **{
                        "x-bench-id": bench_id,
                        "x-sim-ttft-ms": str(plan.ttft_ms),
                        "x-sim-itl-ms": str(plan.itl_ms),
                        "x-sim-output-tokens": str(plan.max_tokens),
                        "x-sim-chunk-tokens": str(plan.chunk_tokens),
                    },
                )
                rec = Rec(t, bench_id, max_tokens=plan.max_tokens)
                await stream_chat(session, url, headers, body, rec)
                out.append(rec)
                i += 1
                if rec.status == 429:
                    await asyncio.sleep(plan.retry_429_s)
                elif not rec.ok:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(client(t, c) for t, n in load.items() for c in range(n)))
        return t0, t_stop


async def interleaved(arms: dict[str, Arm], plan: CostPlan) -> list[Sample]:
    text = prompt_text(plan.prompt_tokens)
    run_id = f"{os.getpid()}-{int(time.time())}"

    def request(arm: str, i: int) -> OneRequest:
        content = f"[{run_id} {COST_ARMS.index(arm)} {i}] {text}"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": plan.max_tokens,
        }
        return OneRequest(json.dumps(body, separators=(",", ":")).encode())

    pause = plan.pause_ms / 1e3
    sessions = {a: one_connection_session() for a in arms}
    samples: list[Sample] = []
    try:
        for i in range(-plan.warmup, 0):
            for arm in arms:
                s = Sample("1k", i, 0, arm, -1)
                await send(sessions[arm], arms[arm], request(arm, i), s, pause)
        for step in range(plan.iterations):
            for arm in rotated(list(arms), step):
                body = request(arm, step)
                s = Sample("1k", step, 0, arm, step)
                await send(sessions[arm], arms[arm], body, s, pause)
                if s.error:
                    print(f"    FAIL {arm} {step}: {s.error}")
                samples.append(s)
    finally:
        for session in sessions.values():
            await session.close()
    return samples
