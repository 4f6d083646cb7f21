"""A hostile-tenant run: normal tenants and one abusive tenant on one small backend,
through the real stack (Envoy -> kvgate -> the vLLM simulator).

    .venv/bin/python -m bench.hostile_tenant [--duration 75] [--out var/bench/hostile-tenant]
    .venv/bin/python -m bench.hostile_tenant --store redis --answer-layer attack --duration 60

One Stack (testbed/harness.py: envoy/envoy.yaml, kvgate with the in-memory store, one
simulator) on free loopback ports. The backend has a 16,384-token KV budget (1,024 blocks
of 16, max_model_len 4,096); kvgate's budget for it is the same. kvgate runs with
server.log_level DEBUG so it writes one JSON line per settled request (its charge per
request id); Envoy's access log gives each request's ext_proc phase latencies. A few
warm-up requests (a tenant of their own, outside every table) go first: a fresh kvgate's
first decision takes a few hundred ms.

Normal tenants (open loop, Poisson arrivals) send small chats, half of them streamed, with
max_tokens set. The abusive tenant, at the same time, cycles through: multi-MB bodies (over
the context bound, at the edge of kvgate's cheap length bound, JSON-whitespace padding
around a small prompt, over Envoy's buffer), instant cancellations (connect, send, close),
streams cut after a few events, requests without max_tokens (or null) with ignore_eos,
HTTP/2 requests with trailers, big logprobs answers (n=4 x top_logprobs 20 non-streamed;
one multi-MB SSE event with x-sim-chunk-tokens), and streams it stops reading.

--store redis: kvgate's state (limits, ledger, idempotency keys, cached answers) in a
private redis-server on a free port, started with --maxmemory (64 MiB) and
--maxmemory-policy noeviction; its INFO memory and each tenant's answer-store quota use are
sampled every second.

--answer-layer baseline: the exact-match response cache (scope: model, hit_charge: free)
and idempotency keys, both with 4 MiB per-tenant quotas; a fifth normal tenant
(`normal-share`) and the abuser opt in to shared entries (cache_sharing) and to cached
samples (response_cache_sampled); the abuser's RPM is 300. --answer-layer attack: the same,
and the abuser's cycle gains (weighted to make most of its traffic): a flood of new
Idempotency-Keys on one cached deterministic request with a ~90 KB answer; sampled streams
of the popular questions the sharer also asks, cut when it "does not like" them; 4 MB keyed
temperature-0 bodies while over its RPM; 40 concurrent duplicates of one slow keyed
request. The sharer asks each popular question sampled at most once (preferably one the
abuser read to the end): it must never get `x-kvgate-cache: hit` on those.

What is reported (JSON on stdout and in <out>/summary.json, a markdown table in
<out>/summary.md):
- the simulator's preemptions and peak KV tokens (/sim/stats) against the budget;
- for normal tenants: kvgate's decision time (Envoy's measure of the ext_proc request-body
  phase per request, the client's time to response headers of streamed requests, and
  kvgate's own kvgate_decision_seconds histogram, which mixes all tenants) and outcomes by
  kind (Envoy 504s, empty bodies, non-JSON error bodies, transport errors, kvgate's 429s);
- the abusive tenant's outcomes by action and status/code (and cache hit / replay);
- per tenant, kvgate's ledger (/admin/usage) against what the simulator served, request by
  request (see `served_by_rule`), the differences of the kinds the billing rule documents
  (a cut stream's tokens still in Envoy when the client left; the prompt of a non-streamed
  request cut before the backend read it) told apart from any other, and the ledger's cache
  hits against the hits its clients got;
- with Redis: used_memory (start, peak sampled, final), INFO's used_memory_peak,
  maxmemory, and each tenant's answer-store bytes per namespace against its quota;
- with the answer layer: the sharer's cache outcomes and kvgate's answer-layer counters.

Bounded: arrivals stop after --duration seconds and at --max-requests; every request has a
timeout; stragglers are cancelled after --drain seconds. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import socket
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import h2.exceptions
from prometheus_client.parser import text_string_to_metric_families

from bench.prompts import prompt_text
from bench.stats import percentile
from testbed.demo_model import demo_model_dir
from testbed.harness import REPO_ROOT, SimOptions, Stack
from testbed.redis_harness import RedisServer

MODEL = "qwen2.5-demo"
BACKEND = "vllm-local"
CHAT = "/v1/chat/completions"
KV_BLOCKS, BLOCK = 1024, 16
KV_BUDGET = KV_BLOCKS * BLOCK  # 16,384 tokens
CONTEXT = 4096
DEFAULT_MAX_NEW = 256
TTFT_MS, ITL_MS = 10, 3
NORMAL_TENANTS = [f"normal-{i}" for i in range(1, 5)]
ABUSER = "abuser"
NORMAL_LIMITS = {"rpm": 600, "tpm": {"capacity": 200_000}, "concurrency": 16}
ABUSER_LIMITS = {"rpm": 1200, "tpm": {"capacity": 2_000_000}, "concurrency": 16}
REQUEST_TIMEOUT_S = 60.0
CLIENT_GONE = 499  # the simulator's record of a stream whose client left mid-write
MB = 1_000_000
DEFAULT_OUT = REPO_ROOT / "var" / "bench" / "hostile-tenant"

# ---- the answer layer (--answer-layer baseline | attack)
# A fifth normal tenant that opts in to shared entries and to cached samples, as the abuser
# does: the one that could be served the abuser's chosen samples if sharing leaked them.
SHARER = "normal-share"
# A tenant of its own for the warm-up requests sent before the arrivals start (kept out of
# every table and check): a fresh kvgate's first decision takes a few hundred ms.
WARMUP = "warmup"
# The abuser's RPM with the answer layer on: low enough that its answer-layer floods push
# it over (a bucket of 300 refilled at 5/s), high enough that the baseline's abuser
# (~2 requests/s) never meets it.
ANSWER_ABUSER_RPM = 300
MIB = 1024 * 1024
# Per tenant and namespace (idempotency keys; cached answers): 6 tenants x (4 + 4) MiB =
# 48 MiB, under the answer store's stop line (0.8 x maxmemory = 51.2 MiB of 64 MiB).
ANSWER_QUOTA_BYTES = 4 * MIB
REDIS_MAXMEMORY_MB = 64
REDIS_KEY_PREFIX = "hostile"
# Questions both the sharer and the abuser ask (the "shared entries").
POPULAR = [
    f"Popular question {i}: in two sentences, why is the sky blue at noon but red at dusk?"
    for i in range(96)
]
# The first few of them are also asked deterministically (temperature 0), by both.
SHARED_DETERMINISTIC = 8
# The flood's one cached deterministic request: ~200 output tokens with 5 top logprobs each,
# a ~70 KB JSON answer (under response_cache.max_answer_bytes, 1 MiB); every new
# Idempotency-Key on it would keep another copy.
FLOOD_TOKENS = 200
FLOOD_KEYS_PER_ACTION = 30
WAITER_DUPLICATES = 40  # > idempotency.max_waiting_per_tenant (32, the default)


def key_of(tenant: str) -> str:
    return f"sk-hostile-{tenant}"


# --------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """One request as its client saw it."""

    tenant: str
    rid: str
    action: str
    stream: bool
    sent_at: float
    status: int | None = None
    code: str = ""  # the error's code (or type) from an OpenAI-shaped body
    kind: str = "unfinished"  # ok | refused | client_cancelled | client_abandoned | <error kind>
    headers_s: float | None = None  # time to response headers
    total_s: float | None = None
    body_bytes: int = 0
    detail: str = ""
    cache: str = ""  # x-kvgate-cache: hit | miss | bypass ("" when absent)
    replayed: bool = False  # Idempotent-Replayed: true
    sampled: bool = False  # the request's temperature was > 0 (or absent)


def classify(out: Outcome, content_type: str, body: bytes, *, stream: bool) -> None:
    """Sort a finished response into ok / refused (a well-formed 429) / an error kind."""
    out.body_bytes = len(body)
    status = out.status or 0
    if status == 504:
        out.kind = "envoy_504"
        return
    if not body:
        out.kind = "empty_body"
        return
    if status >= 400:
        try:
            error = json.loads(body)["error"]
            out.code = str(error.get("code") or error.get("type"))
        except (ValueError, KeyError, TypeError):
            out.kind = "non_json_error_body"
            out.detail = body[:200].decode("utf-8", "replace")
            return
        if "application/json" not in content_type:
            out.kind = "error_body_not_labelled_json"
            return
        out.kind = "refused" if status == 429 else f"http_{status}"
        return
    if stream:
        if not body.rstrip().endswith(b"data: [DONE]"):
            out.kind = "stream_without_done"
        elif b'"choices":[],' in body:
            # No client here asks for stream_options.include_usage: a usage event is the
            # one kvgate injected and must have stripped.
            out.kind = "injected_usage_leaked"
        elif b'"error"' in body and b'"choices"' not in body:
            out.kind = "stream_error_event"
        else:
            out.kind = "ok"
        return
    try:
        json.loads(body)["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        out.kind = "bad_json_body"
        out.detail = body[:200].decode("utf-8", "replace")
        return
    out.kind = "ok"


# --------------------------------------------------------------------------- clients


def chat_body(rid: str, prompt_tokens: int, **fields: Any) -> dict[str, Any]:
    """A chat whose prompt is unique (the request id leads it) and ~prompt_tokens long."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{rid} {prompt_text(prompt_tokens)}"}],
        **fields,
    }


class Client:
    def __init__(self, stack: Stack, session: aiohttp.ClientSession) -> None:
        self.stack = stack
        self.session = session
        self.outcomes: list[Outcome] = []
        self.tenant_of: dict[str, str] = {}
        self.action_of: dict[str, str] = {}
        # When each tenant last got a 429 rpm_exceeded (monotonic): it "is over its RPM"
        # while that refusal is recent.
        self.rpm_refused_at: dict[str, float] = {}

    def new(self, tenant: str, rid: str, action: str, stream: bool) -> Outcome:
        out = Outcome(tenant=tenant, rid=rid, action=action, stream=stream, sent_at=time.time())
        self.outcomes.append(out)
        self.tenant_of[rid] = tenant
        self.action_of[rid] = action
        return out

    def over_rpm(self, tenant: str, within_s: float = 1.0) -> bool:
        return time.monotonic() - self.rpm_refused_at.get(tenant, -1e9) < within_s

    def headers(self, tenant: str, rid: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            "authorization": f"Bearer {key_of(tenant)}",
            "content-type": "application/json",
            "x-request-id": rid,
            **(extra or {}),
        }

    async def post(
        self,
        tenant: str,
        rid: str,
        action: str,
        body: dict[str, Any] | bytes,
        *,
        extra: dict[str, str] | None = None,
        cut_after_chunks: int | None = None,
        abandon_s: float | None = None,
    ) -> Outcome:
        """POST a chat; stream when the body says so. cut_after_chunks: close the connection
        after that many body chunks. abandon_s: after the first chunk, stop reading for that
        long (the connection stays open), then close."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        stream = isinstance(body, dict) and bool(body.get("stream"))
        out = self.new(tenant, rid, action, stream)
        out.sampled = isinstance(body, dict) and body.get("temperature") != 0
        started = time.perf_counter()
        try:
            async with self.session.post(
                self.stack.base_url + CHAT,
                data=raw,
                headers=self.headers(tenant, rid, extra),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as resp:
                out.status = resp.status
                out.headers_s = time.perf_counter() - started
                ctype = resp.headers.get("content-type", "")
                out.cache = resp.headers.get("x-kvgate-cache", "")
                out.replayed = resp.headers.get("idempotent-replayed", "") == "true"
                if resp.status == 200 and (cut_after_chunks is not None or abandon_s is not None):
                    chunks = 0
                    async for chunk in resp.content.iter_any():
                        out.body_bytes += len(chunk)
                        chunks += 1
                        if abandon_s is not None:
                            await asyncio.sleep(abandon_s)  # not reading: backpressure
                            out.kind = "client_abandoned"
                            break
                        if cut_after_chunks is not None and chunks >= cut_after_chunks:
                            out.kind = "client_cancelled"
                            break
                    else:
                        out.kind = "ok"  # ended before the client meant to leave
                    resp.close()  # drop the connection, not just the response
                    out.total_s = time.perf_counter() - started
                    return out
                data = await resp.read()
                out.total_s = time.perf_counter() - started
                classify(out, ctype, data, stream=stream)
                if out.code == "rpm_exceeded":
                    self.rpm_refused_at[tenant] = time.monotonic()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            out.kind = f"transport_error:{type(exc).__name__}"
            out.detail = str(exc)[:200]
            out.total_s = time.perf_counter() - started
        return out

    async def instant_cancel(
        self, tenant: str, rid: str, body: dict[str, Any], delay_s: float
    ) -> Outcome:
        """Connect, send the whole request, close after `delay_s` (0: at once)."""
        out = self.new(tenant, rid, "instant_cancel", bool(body.get("stream")))
        payload = json.dumps(body).encode()
        head = "".join(
            f"{k}: {v}\r\n"
            for k, v in {
                "host": f"127.0.0.1:{self.stack.listen_port}",
                **self.headers(tenant, rid),
                "content-length": str(len(payload)),
            }.items()
        )
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", self.stack.listen_port)
            writer.write(f"POST {CHAT} HTTP/1.1\r\n{head}\r\n".encode() + payload)
            await writer.drain()
            if delay_s:
                await asyncio.sleep(delay_s)
            transport = writer.transport
            if isinstance(transport, asyncio.Transport):
                transport.abort()  # RST, as a killed client
            else:
                writer.close()
            out.kind = "client_cancelled"
            out.detail = f"closed {delay_s * 1000:.0f} ms after sending"
        except OSError as exc:
            out.kind = f"transport_error:{type(exc).__name__}"
        return out

    async def h2_trailers(self, tenant: str, rid: str, body: dict[str, Any]) -> Outcome:
        out = self.new(tenant, rid, "h2_trailers", False)
        started = time.perf_counter()
        try:
            status, ctype, data = await asyncio.to_thread(
                h2_post,
                self.stack.listen_port,
                self.headers(tenant, rid),
                json.dumps(body).encode(),
                {"x-client-checksum": "0123abcd"},
            )
            out.status = status
            out.total_s = time.perf_counter() - started
            classify(out, ctype, data, stream=False)
        except (OSError, h2.exceptions.H2Error) as exc:
            out.kind = f"transport_error:{type(exc).__name__}"
            out.detail = str(exc)[:200]
        return out


def h2_post(
    port: int, headers: dict[str, str], body: bytes, trailers: dict[str, str]
) -> tuple[int | None, str, bytes]:
    """One POST over cleartext HTTP/2 (prior knowledge) with request trailers, on a fresh
    connection (as tests/e2e/test_edge_holes.py sends them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as sock:
        conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":path", CHAT),
                (":scheme", "http"),
                (":authority", f"127.0.0.1:{port}"),
                *((k.lower(), v) for k, v in headers.items()),
            ],
        )
        conn.send_data(sid, body)
        conn.send_headers(sid, list(trailers.items()), end_stream=True)
        sock.sendall(conn.data_to_send())
        status: int | None = None
        ctype = ""
        data = b""
        done = False
        while not done:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                if getattr(event, "stream_id", None) != sid:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    got = {str(k): str(v) for k, v in event.headers}
                    status = int(got[":status"])
                    ctype = got.get("content-type", "")
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, sid)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    done = True
            pending = conn.data_to_send()
            if pending:
                sock.sendall(pending)
        return status, ctype, data


# --------------------------------------------------------------------------- load


@dataclass
class Plan:
    duration_s: float
    normal_rate: float  # requests per second per normal tenant
    abuser_workers: int
    max_requests: int
    drain_s: float
    seed: int
    store: str = "memory"  # memory | redis (a private redis-server, --maxmemory, noeviction)
    # off: the original run. baseline: response cache (scope model) and idempotency on,
    # the sharer tenant, the abuser opted in to sharing and samples, its RPM lowered;
    # attack: baseline + the abuser's answer-layer actions.
    answer_layer: str = "off"
    redis_maxmemory_mb: int = REDIS_MAXMEMORY_MB
    warmup: bool = True  # False: the load meets a fresh kvgate (its cold first decisions)


def normal_tenants(plan: Plan | dict[str, Any] | None) -> list[str]:
    layer = plan.answer_layer if isinstance(plan, Plan) else (plan or {}).get("answer_layer")
    return [*NORMAL_TENANTS, SHARER] if layer not in (None, "off") else list(NORMAL_TENANTS)


@dataclass
class Shared:
    """What the abuser's and the sharer's loops know of each other (client side)."""

    # Popular questions whose sampled (temperature 1, streamed) answer the abuser read to
    # the end: kvgate may have kept that sample (in the abuser's own scope).
    abuser_kept_samples: list[int] = field(default_factory=list)
    # Popular questions the sharer has asked sampled (each at most once: a second time
    # would be its own cached sample, which it opted in to).
    sharer_sampled: set[int] = field(default_factory=set)
    flood_seeded: bool = False
    flood_seq: int = 0


def popular_body(i: int, *, sampled: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": POPULAR[i]}],
        "max_tokens": 48,
        "temperature": 1 if sampled else 0,
    }
    if stream:
        body["stream"] = True
    return body


async def sharer_request(
    client: Client, rid: str, rng: random.Random, shared: Shared
) -> Outcome | None:
    """One of the sharer's popular questions: deterministic (shared entries, a hit is
    expected and legitimate), or sampled, streamed, asked once, preferably one the abuser
    sampled to the end (a hit there would be the abuser's chosen sample)."""
    if rng.random() < 0.5:
        i = rng.randrange(SHARED_DETERMINISTIC)  # few: they repeat, and hit
        stream = rng.random() < 0.5
        body = popular_body(i, sampled=False, stream=stream)
        return await client.post(SHARER, rid, "share_deterministic", body, extra=POPULAR_SIM)
    fresh = [i for i in shared.abuser_kept_samples if i not in shared.sharer_sampled]
    action = "share_sampled_after_abuser"
    if not fresh:
        fresh = [i for i in range(len(POPULAR)) if i not in shared.sharer_sampled]
        action = "share_sampled"
    if not fresh:
        return None
    i = rng.choice(fresh)
    shared.sharer_sampled.add(i)
    body = popular_body(i, sampled=True, stream=True)
    return await client.post(SHARER, rid, action, body, extra=POPULAR_SIM)


POPULAR_SIM = {"x-sim-output-tokens": "48"}


async def normal_tenant(
    client: Client, tenant: str, plan: Plan, rng: random.Random, shared: Shared | None = None
) -> None:
    """Open loop: Poisson arrivals for plan.duration_s; each request is its own task. The
    sharer (`shared` given) sends 40 % popular questions (sharer_request)."""
    tasks: list[asyncio.Task[Outcome | None]] = []
    start = time.monotonic()
    at = 0.0
    seq = 0
    budget = plan.max_requests // (len(normal_tenants(plan)) + 1)
    while seq < budget:
        at += rng.expovariate(plan.normal_rate)
        if at >= plan.duration_s:
            break
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        seq += 1
        if shared is not None and rng.random() < 0.4:
            rid = f"{tenant}-p-{seq:05d}"
            tasks.append(asyncio.create_task(sharer_request(client, rid, rng, shared)))
            continue
        stream = rng.random() < 0.5
        rid = f"{tenant}-{'s' if stream else 'u'}-{seq:05d}"
        max_tokens = rng.choice([16, 32, 64, 128])
        body = chat_body(rid, rng.randint(60, 600), max_tokens=max_tokens)
        if stream:
            body["stream"] = True
        wants = rng.randint(max(1, max_tokens // 4), max_tokens + 16)
        extra = {"x-sim-output-tokens": str(wants)}
        tasks.append(asyncio.create_task(client.post(tenant, rid, "normal", body, extra=extra)))
    await asyncio.gather(*tasks)


def text_of(chars: int) -> str:
    """Plain words, exactly `chars` characters."""
    unit = prompt_text(2000) + " "
    return (unit * (chars // len(unit) + 1))[:chars]


class Abuse:
    """The abusive tenant's actions; each sends one request (or connection), but for the
    answer layer's, which send bursts."""

    def __init__(
        self,
        client: Client,
        rng: random.Random,
        shared: Shared | None = None,
        answer_attack: bool = False,
    ) -> None:
        self.client = client
        self.rng = rng
        self.seq = 0
        self.shared = shared or Shared()
        self.answer_attack = answer_attack
        # ~4 MB of words: over the context whatever the exact count.
        self.huge_text = text_of(4 * MB)
        # Just under what kvgate's length bound admits (128 chars per token at most, for
        # this vocabulary): ~3,000 tokens by the bound, ~70,000 by the tokenizer.
        self.edge_text = text_of(3_000 * 128)
        self.over_buffer_text = text_of(9 * MB)

    def rid(self, action: str) -> str:
        self.seq += 1
        return f"{ABUSER}-{action}-{self.seq:05d}"

    def actions(self) -> list[tuple[str, int, Callable[[], Awaitable[Any]]]]:
        # The answer layer's come first (the first pass runs every action once, in this
        # order): the waiters before the flood fills the abuser's key quota.
        answer_layer: list[tuple[str, int, Callable[[], Awaitable[Any]]]] = [
            ("key_waiters", 2, self.key_waiters),
            ("sampled_cut_shared", 10, self.sampled_cut_shared),
            ("key_flood", 8, self.key_flood),
            ("giant_keyed_over_rpm", 3, self.giant_keyed_over_rpm),
        ]
        return (answer_layer if self.answer_attack else []) + [
            ("huge_over_context", 2, self.huge_over_context),
            ("huge_at_bound", 2, self.huge_at_bound),
            ("huge_padded_small_prompt", 1, self.huge_padded),
            ("huge_over_envoy_buffer", 1, self.huge_over_buffer),
            ("instant_cancel", 5, self.instant_cancel),
            ("cut_mid_stream", 3, self.cut_mid_stream),
            ("no_max_tokens_ignore_eos", 3, self.no_max_tokens),
            ("h2_trailers", 2, self.h2_trailers),
            ("kv_hog_stream", 2, self.kv_hog),
            ("big_logprobs_n4", 1, self.big_logprobs_n4),
            ("big_sse_event", 1, self.big_sse_event),
            ("abandoned_stream", 1, self.abandoned_stream),
        ]

    # ---------------------------------------------------------------- the answer layer

    async def key_flood(self) -> list[Outcome]:
        """One cached deterministic request with a long answer, resent under ever new
        Idempotency-Keys (5 at a time): each hit completes its key with another copy of the
        answer, until the abuser's key quota is full (429 idempotency_keys_exhausted)."""
        body = chat_body(
            "flood",
            60,
            max_tokens=FLOOD_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
        extra = {"x-sim-output-tokens": str(FLOOD_TOKENS)}
        out: list[Outcome] = []
        if not self.shared.flood_seeded:
            # The first answer is generated once and cached; the flood's are hits.
            self.shared.flood_seeded = True
            rid = self.rid("key_flood")
            out.append(await self.client.post(ABUSER, rid, "key_flood", body, extra=extra))
            await asyncio.sleep(0.3)  # stored at settlement

        async def one() -> Outcome:
            self.shared.flood_seq += 1
            key = {"idempotency-key": f"flood-{self.shared.flood_seq:06d}"}
            return await self.client.post(
                ABUSER, self.rid("key_flood"), "key_flood", body, extra={**extra, **key}
            )

        for _ in range(FLOOD_KEYS_PER_ACTION // 5):
            out += await asyncio.gather(*(one() for _ in range(5)))
        return out

    async def sampled_cut_shared(self) -> list[Outcome]:
        """Three popular questions sampled (temperature 1, streamed): the streams it does
        not like (two in three) are closed after a few events, the others read to the end
        (kvgate may keep that sample, in the abuser's own scope). One in four times the
        deterministic version instead, read to the end: a shared entry."""

        async def one() -> Outcome:
            i = self.rng.randrange(len(POPULAR))
            if self.rng.random() < 0.25:
                body = popular_body(i % SHARED_DETERMINISTIC, sampled=False, stream=True)
                rid = self.rid("sampled_cut_shared")
                return await self.client.post(
                    ABUSER, rid, "sampled_cut_shared:deterministic", body, extra=POPULAR_SIM
                )
            body = popular_body(i, sampled=True, stream=True)
            rid = self.rid("sampled_cut_shared")
            if self.rng.random() < 2 / 3:
                return await self.client.post(
                    ABUSER,
                    rid,
                    "sampled_cut_shared:cut",
                    body,
                    extra=POPULAR_SIM,
                    cut_after_chunks=self.rng.randint(2, 4),
                )
            out = await self.client.post(
                ABUSER, rid, "sampled_cut_shared:kept", body, extra=POPULAR_SIM
            )
            if out.kind == "ok" and out.status == 200:
                self.shared.abuser_kept_samples.append(i)
            return out

        return list(await asyncio.gather(*(one() for _ in range(3))))

    async def giant_keyed_over_rpm(self) -> list[Outcome]:
        """While over its RPM (a 429 rpm_exceeded in the last second; waits up to 3 s for
        one), three 4 MB bodies with an Idempotency-Key and temperature 0: kvgate must
        refuse them before reading, digesting or looking anything up."""
        for _ in range(30):  # 3 s at most
            if self.client.over_rpm(ABUSER):
                break
            await asyncio.sleep(0.1)
        over = self.client.over_rpm(ABUSER)
        out: list[Outcome] = []
        for _ in range(3):
            rid = self.rid("giant_keyed_over_rpm")
            text = rid + " " + self.huge_text
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 16,
                "temperature": 0,
            }
            action = "giant_keyed_over_rpm" if over else "giant_keyed:not_yet_over_rpm"
            o = await self.client.post(
                ABUSER, rid, action, body, extra={"idempotency-key": f"giant-{rid}"}
            )
            out.append(o)
        return out

    async def key_waiters(self) -> list[Outcome]:
        """One slow keyed request (40 tokens at 50 ms: 2 s), then 40 concurrent duplicates
        (same key, same body): 32 may wait for it (idempotency.max_waiting_per_tenant) and
        replay its answer, the rest are refused 429 idempotency_waiters_exceeded."""
        first = self.rid("key_waiters")
        body = chat_body(first, 80, max_tokens=40, temperature=0.7)
        extra = {
            "x-sim-output-tokens": "40",
            "x-sim-itl-ms": "50",
            "idempotency-key": f"wait-{first}",
        }
        running = asyncio.create_task(
            self.client.post(ABUSER, first, "key_waiters:first", body, extra=extra)
        )
        await asyncio.sleep(0.4)  # the first one runs
        dups = await asyncio.gather(
            *(
                self.client.post(
                    ABUSER, self.rid("key_waiters"), "key_waiters:duplicate", body, extra=extra
                )
                for _ in range(WAITER_DUPLICATES)
            )
        )
        return [await running, *dups]

    # ---------------------------------------------------------------- bodies and streams

    async def huge_over_context(self) -> Outcome:
        rid = self.rid("huge_over_context")
        body = {"model": MODEL, "messages": [{"role": "user", "content": rid + self.huge_text}]}
        return await self.client.post(ABUSER, rid, "huge_over_context", body)

    async def huge_at_bound(self) -> Outcome:
        rid = self.rid("huge_at_bound")
        text = rid + self.edge_text[len(rid) :]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 64,
        }
        return await self.client.post(ABUSER, rid, "huge_at_bound", body)

    async def huge_padded(self) -> Outcome:
        """A 5 MB body whose prompt is ~300 tokens: JSON whitespace around it."""
        rid = self.rid("huge_padded_small_prompt")
        small = json.dumps(chat_body(rid, 300, max_tokens=64, ignore_eos=True))
        raw = ("{" + " " * (5 * MB) + small[1:]).encode()
        return await self.client.post(ABUSER, rid, "huge_padded_small_prompt", raw)

    async def huge_over_buffer(self) -> Outcome:
        rid = self.rid("huge_over_envoy_buffer")
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.over_buffer_text}]}
        return await self.client.post(ABUSER, rid, "huge_over_envoy_buffer", body)

    async def instant_cancel(self) -> Outcome:
        rid = self.rid("instant_cancel")
        stream = self.rng.random() < 0.5
        body = chat_body(rid, self.rng.randint(200, 1500), max_tokens=400, ignore_eos=True)
        if stream:
            body["stream"] = True
        delay = self.rng.choice([0.0, 0.0, 0.002, 0.02, 0.1, 0.3])
        return await self.client.instant_cancel(ABUSER, rid, body, delay)

    async def cut_mid_stream(self) -> Outcome:
        rid = self.rid("cut_mid_stream")
        body = chat_body(rid, 500, max_tokens=800, ignore_eos=True, stream=True)
        return await self.client.post(
            ABUSER, rid, "cut_mid_stream", body, cut_after_chunks=self.rng.randint(1, 40)
        )

    async def no_max_tokens(self) -> Outcome:
        rid = self.rid("no_max_tokens_ignore_eos")
        body = chat_body(rid, 1000, ignore_eos=True)
        if self.seq % 2:
            body["max_tokens"] = None
        if self.rng.random() < 0.5:
            body["stream"] = True
        return await self.client.post(ABUSER, rid, "no_max_tokens_ignore_eos", body)

    async def kv_hog(self) -> Outcome:
        """A 3,000-token prompt and 1,000 forced output tokens, streamed: ~4,000 KV tokens
        held for ~3 s; several at once fill the backend's budget."""
        rid = self.rid("kv_hog_stream")
        body = chat_body(rid, 3000, max_tokens=1000, ignore_eos=True, stream=True)
        return await self.client.post(ABUSER, rid, "kv_hog_stream", body)

    async def h2_trailers(self) -> Outcome:
        rid = self.rid("h2_trailers")
        return await self.client.h2_trailers(ABUSER, rid, chat_body(rid, 200, max_tokens=32))

    async def big_logprobs_n4(self) -> Outcome:
        """n=4 x 1,200 tokens x top_logprobs 20, non-streamed: a ~7 MB JSON answer."""
        rid = self.rid("big_logprobs_n4")
        body = chat_body(
            rid, 100, n=4, max_tokens=1200, ignore_eos=True, logprobs=True, top_logprobs=20
        )
        return await self.client.post(ABUSER, rid, "big_logprobs_n4", body)

    async def big_sse_event(self) -> Outcome:
        """One ~4 MB SSE event: 3,000 tokens with top_logprobs 20 merged into one event."""
        rid = self.rid("big_sse_event")
        body = chat_body(
            rid, 100, max_tokens=3000, ignore_eos=True, logprobs=True, top_logprobs=20, stream=True
        )
        return await self.client.post(
            ABUSER, rid, "big_sse_event", body, extra={"x-sim-chunk-tokens": "3000"}
        )

    async def abandoned_stream(self) -> Outcome:
        rid = self.rid("abandoned_stream")
        body = chat_body(
            rid, 200, max_tokens=1500, ignore_eos=True, logprobs=True, top_logprobs=20, stream=True
        )
        return await self.client.post(ABUSER, rid, "abandoned_stream", body, abandon_s=8.0)


async def abuser(
    client: Client, plan: Plan, rng: random.Random, shared: Shared | None = None
) -> None:
    abuse = Abuse(client, rng, shared, answer_attack=plan.answer_layer == "attack")
    actions = abuse.actions()
    deck = [fn for _, weight, fn in actions for _ in range(weight)]
    deadline = time.monotonic() + plan.duration_s
    budget = plan.max_requests // (len(normal_tenants(plan)) + 1)
    counter = {"n": 0}

    async def worker() -> None:
        order: list[Callable[[], Awaitable[Any]]] = []
        while time.monotonic() < deadline and counter["n"] < budget:
            if not order:
                order = deck[:]
                rng.shuffle(order)
            counter["n"] += 1
            await order.pop()()
            await asyncio.sleep(rng.uniform(0.05, 0.4))

    async def first_pass() -> None:
        # Every action once, in order, alongside the workers: a short run still tries each.
        for _, _, fn in actions:
            if time.monotonic() >= deadline:
                break
            counter["n"] += 1
            await fn()

    await asyncio.gather(first_pass(), *(worker() for _ in range(plan.abuser_workers)))


# --------------------------------------------------------------------------- observation


@dataclass
class Observer:
    """Polls the simulator's /sim/stats (its `served` list keeps only the last 1,000
    sequences, so it is read every second and merged by id) and kvgate's KV in flight."""

    stack: Stack
    session: aiohttp.ClientSession
    served: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_stats: dict[str, Any] = field(default_factory=dict)
    kvgate_kv_max: float = 0.0
    sim_kv_max_sampled: int = 0
    served_overflow: bool = False

    async def poll_once(self) -> None:
        async with self.session.get(f"{self.stack.sim_url}/sim/stats") as resp:
            stats = await resp.json()
        served = stats.pop("served")
        if served and len(served) >= 1000 and served[0]["id"] not in self.served:
            self.served_overflow = True  # entries may have been lost between two polls
        for entry in served:
            self.served[entry["id"]] = entry
        self.last_stats = stats
        self.sim_kv_max_sampled = max(self.sim_kv_max_sampled, int(stats["kv_tokens_used"]))
        metrics = await self.metrics()
        self.kvgate_kv_max = max(
            self.kvgate_kv_max, metrics.get(("kvgate_kv_tokens_in_flight", BACKEND), 0.0)
        )

    async def metrics(self) -> dict[tuple[str, str], float]:
        async with self.session.get(self.stack.kvgate_metrics_url) as resp:
            text = await resp.text()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, s.labels.get("backend", ""))] = float(s.value)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.poll_once()
            except (aiohttp.ClientError, TimeoutError) as exc:
                print(f"poll failed: {exc!r}", file=sys.stderr)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)


@dataclass
class RedisObserver:
    """Samples the private Redis every second: INFO memory (used_memory, its peak,
    maxmemory), the number of keys, and each tenant's answer-store quota use (the
    `~total` the answer store's scripts keep per tenant and namespace)."""

    port: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    quota_max: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def sample_once(self) -> dict[str, Any]:
        import redis  # the server harness's client library

        with redis.Redis(port=self.port, socket_timeout=2) as r:
            info = r.info("memory")
            quotas: dict[str, int] = {}
            for name in r.scan_iter(match="*:idemq|*|s", count=1000):
                total = r.hget(name, "~total")
                label = name.decode().split(":idemq|", 1)[1].removesuffix("|s")
                quotas[label] = int(total or 0)
            sample = {
                "t_s": round(time.monotonic() - self.started, 1),
                "used_memory": int(info["used_memory"]),
                "used_memory_peak": int(info["used_memory_peak"]),
                "maxmemory": int(info["maxmemory"]),
                "keys": int(r.dbsize()),
                "quota_bytes": quotas,
            }
        for label, used in quotas.items():
            self.quota_max[label] = max(self.quota_max.get(label, 0), used)
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.sample_once)
            except Exception as exc:  # a failed look is reported, never fatal
                print(f"redis poll failed: {exc!r}", file=sys.stderr)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        last = self.samples[-1]
        used = [x["used_memory"] for x in self.samples]
        return {
            "maxmemory": last["maxmemory"],
            "maxmemory_policy": "noeviction",
            "answer_store_stop_line": int(last["maxmemory"] * 0.8),
            "used_memory_start": used[0],
            "used_memory_peak_sampled": max(used),
            "used_memory_final": last["used_memory"],
            "info_used_memory_peak": last["used_memory_peak"],
            "keys_final": last["keys"],
            "keys_max": max(x["keys"] for x in self.samples),
            "samples": len(self.samples),
            "quota_bytes_max": dict(sorted(self.quota_max.items())),
            "quota_bytes_final": dict(sorted(last["quota_bytes"].items())),
            "quota_limit_bytes": ANSWER_QUOTA_BYTES,
        }


async def fetch_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return await resp.json(content_type=None)


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return await resp.text()


def decision_histogram(text: str) -> dict[str, Any]:
    """kvgate_decision_seconds (all tenants), by outcome: count and bucket-bound p50/p99."""
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        if family.name != "kvgate_decision_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets[s.labels["outcome"]].append((float(s.labels["le"]), float(s.value)))
    merged: dict[float, float] = defaultdict(float)
    for rows in buckets.values():
        for le, count in rows:
            merged[le] += count
    buckets["all"] = sorted(merged.items())

    def quantile(rows: list[tuple[float, float]], q: float) -> float:
        rows = sorted(rows)
        total = rows[-1][1] if rows else 0.0
        for le, count in rows:
            if total and count >= q * total:
                return le
        return math.nan

    return {
        outcome: {
            "count": int(sorted(rows)[-1][1]) if rows else 0,
            "p50_le_ms": quantile(rows, 0.5) * 1000,
            "p99_le_ms": quantile(rows, 0.99) * 1000,
        }
        for outcome, rows in sorted(buckets.items())
    }


def ext_proc_phases(entry: dict[str, Any]) -> dict[str, float]:
    """Envoy's ext_proc filter state, e.g. 'rh:980:0,rb:1:935:0,sh:280:0,sb:6:2397:0,...':
    request headers / body latency in microseconds (body: count, total, status)."""
    out: dict[str, float] = {}
    for part in str(entry.get("ext_proc") or "").split(","):
        bits = part.split(":")
        if bits[0] in ("rh", "sh") and len(bits) >= 2 and bits[1].isdigit():
            out[bits[0]] = int(bits[1]) / 1e6
        elif bits[0] in ("rb", "sb") and len(bits) >= 3 and bits[2].isdigit():
            out[bits[0]] = int(bits[2]) / 1e6
    return out


def settled_lines(log_text: str) -> list[dict[str, Any]]:
    """kvgate's DEBUG "settled" lines: one per settled request, with its charge."""
    lines = []
    for line in log_text.splitlines():
        if '"msg": "settled"' in line:
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return lines


# --------------------------------------------------------------------------- ledger vs served


def served_by_rule(
    record: dict[str, Any], seqs: list[dict[str, Any]], gateway_saw_headers: bool
) -> tuple[int, int, str] | None:
    """What the simulator served for one HTTP request, as kvgate's billing rule
    (src/kvgate/lifecycle/billing.py, cut rule backend_work) defines the charge:
    - non-2xx from the backend: nothing;
    - every sequence finished: the prompt (once per request, as vLLM's usage) plus every
      token generated;
    - cut, streamed, after the backend's 200 headers reached the gateway: the prompt plus
      the tokens the simulator WROTE to its socket (`completion_tokens_sent`); kvgate can
      only count what reached it, so a difference here is tokens in flight at the cut;
    - cut, non-streamed (no headers yet): the prompt (the prefill was done);
    - cut, streamed, before the headers reached the gateway: nothing.
    "Reached the gateway" is Envoy's fact (`gateway_saw_headers`: its access log shows an
    ext_proc response-headers phase or a 200), not the simulator's: the simulator records
    status 200 once it has written its headers, and 499 (its handler's throwaway answer)
    when a later write fails, even when Envoy had closed the connection before either
    (a request read late from a connection Envoy already reset).
    Returns (prompt, output, how) or None when the simulator's record of a sequence is
    missing."""
    if not seqs:
        return None
    status = record.get("status")
    stream = bool((record.get("body") or {}).get("stream"))
    prompt = int(seqs[0]["prompt_tokens"])
    accepted = status in (200, CLIENT_GONE)
    if status is not None and not accepted:
        return 0, 0, f"upstream_{status}"
    if all(s["finished"] for s in seqs) and status != CLIENT_GONE:
        return prompt, sum(int(s["completion_tokens_generated"]) for s in seqs), "completed"
    if stream:
        if accepted and gateway_saw_headers:
            return prompt, sum(int(s["completion_tokens_sent"]) for s in seqs), "cut_stream"
        return 0, 0, "cut_stream_before_headers"
    return prompt, 0, "cut_non_streamed"


def gateway_saw_headers(entry: dict[str, Any] | None) -> bool:
    if entry is None:
        return False
    return "sh" in ext_proc_phases(entry) or entry.get("response_code") == 200


def compare(
    tenant_of: dict[str, str],
    action_of: dict[str, str],
    sim_requests: list[dict[str, Any]],
    served: dict[str, dict[str, Any]],
    settled: list[dict[str, Any]],
    usage: dict[str, Any],
    access: list[dict[str, Any]],
    *,
    normals: list[str] | None = None,
    outcomes: list[Outcome] | None = None,
) -> dict[str, Any]:
    """Per tenant: kvgate's ledger against what the simulator served (tokens; requests
    against settled lines) and, with `outcomes`, the ledger's cache hits against the hits
    its clients got (a free hit is booked as a hit, not a request; an idempotent replay is
    neither: it is counted here from the clients' side only)."""
    access_of = {e.get("request_id"): e for e in access}
    charged: dict[str, dict[str, Any]] = {}
    dup_settled: list[str] = []
    for line in settled:
        rid = line["request_id"]
        if rid in charged:
            dup_settled.append(rid)
        charged[rid] = line
    by_rid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in sim_requests:
        if rec["path"] == CHAT and rec.get("request_id"):
            by_rid[rec["request_id"]].append(rec)

    tenants = [*(normals or NORMAL_TENANTS), ABUSER]
    fields = ("requests", "prompt_tokens", "output_tokens", "cache_hits", "cache_saved_tokens")
    ledger = {t: dict.fromkeys(fields, 0) for t in tenants}
    for entry in usage.get("tenants", []):
        if entry["tenant"] in ledger:
            for k in ledger[entry["tenant"]]:
                ledger[entry["tenant"]][k] = int(entry["this_month"].get(k, 0))
    client_hits: Counter[str] = Counter()
    client_replays: Counter[str] = Counter()
    for o in outcomes or []:
        if o.status == 200 and o.replayed:
            client_replays[o.tenant] += 1
        elif o.status == 200 and o.cache == "hit":
            client_hits[o.tenant] += 1

    per_tenant: dict[str, dict[str, Any]] = {}
    mismatches: list[dict[str, Any]] = []
    tenant_header_mismatch: list[str] = []
    for tenant in tenants:
        rids = [r for r, t in tenant_of.items() if t == tenant]
        served_p = served_o = charged_p = charged_o = reached = settled_n = 0
        how_counts: Counter[str] = Counter()
        unknown: list[str] = []
        # Differences of the two kinds the rule's documentation names (README "What is
        # charged when", docs/hostile-tenant.md), as charged minus served, and any other.
        edge_p = edge_o = 0
        edges: Counter[str] = Counter()
        unexplained = 0
        for rid in rids:
            recs = by_rid.get(rid, [])
            line = charged.get(rid)
            if line is not None:
                settled_n += 1
                charged_p += int(line["prompt_tokens"])
                charged_o += int(line["output_tokens"])
            if len(recs) > 1:
                mismatches.append({"rid": rid, "problem": f"reached the backend {len(recs)}x"})
            if not recs:
                if line is not None and (line["prompt_tokens"] or line["output_tokens"]):
                    edge = (
                        "non_streamed_cut_before_the_backend_read_it"
                        if line.get("cause") == "disconnected" and not line["output_tokens"]
                        else ""
                    )
                    if edge:
                        edges[edge] += 1
                        edge_p += int(line["prompt_tokens"])
                    else:
                        unexplained += 1
                    mismatches.append(
                        {
                            "rid": rid,
                            "tenant": tenant,
                            "action": action_of[rid],
                            "problem": "charged but never reached the backend",
                            "edge": edge or "unexplained",
                            "kvgate": line,
                        }
                    )
                continue
            reached += 1
            rec = recs[0]
            if rec["headers"].get("x-kvgate-tenant") != tenant:
                tenant_header_mismatch.append(rid)
            n = int((rec.get("body") or {}).get("n") or 1)
            # The simulator names a sequence as vLLM does: chatcmpl-<x-request-id>[-<choice>].
            ids = [f"chatcmpl-{rid}-{i}" for i in range(n)] if n > 1 else [f"chatcmpl-{rid}"]
            seqs = [served[i] for i in ids if i in served]
            rule = served_by_rule(
                rec, seqs if len(seqs) == len(ids) else [], gateway_saw_headers(access_of.get(rid))
            )
            if rule is None:
                unknown.append(rid)
                continue
            p, o, how = rule
            how_counts[how] += 1
            served_p += p
            served_o += o
            got = (int(line["prompt_tokens"]), int(line["output_tokens"])) if line else (0, 0)
            if got != (p, o):
                edge = ""
                if how == "cut_stream" and got[0] == p and got[1] < o:
                    # Written by the engine, never passed through kvgate: in Envoy's
                    # buffers when the client left.
                    edge = "cut_stream_tokens_in_flight"
                    edges[edge] += 1
                    edge_o += got[1] - o
                else:
                    unexplained += 1
                mismatches.append(
                    {
                        "rid": rid,
                        "tenant": tenant,
                        "edge": edge or "unexplained",
                        "action": action_of[rid],
                        "served": {"prompt": p, "output": o, "how": how},
                        "charged": {
                            "prompt": got[0],
                            "output": got[1],
                            "cause": line["cause"] if line else None,
                        },
                        "sim_status": rec.get("status"),
                        "envoy": {
                            k: (access_of.get(rid) or {}).get(k)
                            for k in ("response_code", "response_flags", "ext_proc")
                        },
                        "sim_seqs": [
                            {
                                k: s[k]
                                for k in (
                                    "id",
                                    "completion_tokens_generated",
                                    "completion_tokens_sent",
                                    "finished",
                                    "aborted",
                                    "finish_reason",
                                )
                            }
                            for s in seqs
                        ],
                    }
                )
        led = ledger[tenant]
        per_tenant[tenant] = {
            "sent": len(rids),
            "reached_backend": reached,
            "settled_by_kvgate": settled_n,
            "ledger": led,
            "kvgate_settled_sum": {"prompt_tokens": charged_p, "output_tokens": charged_o},
            "served": {"prompt_tokens": served_p, "output_tokens": served_o},
            "served_how": dict(how_counts),
            "sim_record_missing": unknown,
            "ledger_equals_served": (
                not unknown
                and led["prompt_tokens"] == served_p
                and led["output_tokens"] == served_o
            ),
            "documented_edges": dict(edges),
            "documented_edges_charged_minus_served": {
                "prompt_tokens": edge_p,
                "output_tokens": edge_o,
            },
            "unexplained_differences": unexplained,
            "ledger_equals_served_but_documented_edges": (
                not unknown
                and not unexplained
                and led["prompt_tokens"] - edge_p == served_p
                and led["output_tokens"] - edge_o == served_o
            ),
            "ledger_equals_settled_lines": (
                led["prompt_tokens"] == charged_p
                and led["output_tokens"] == charged_o
                and led["requests"] == settled_n
            ),
            "client_cache_hits": client_hits[tenant],
            "client_idempotent_replays": client_replays[tenant],
            "ledger_cache_hits_equal_client_hits": (
                outcomes is None or led["cache_hits"] == client_hits[tenant]
            ),
        }
    return {
        "per_tenant": per_tenant,
        "mismatches": mismatches,
        "duplicate_settlements": dup_settled,
        "tenant_header_mismatch": tenant_header_mismatch,
    }


# --------------------------------------------------------------------------- report


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 2) if values else math.nan


def summarize(
    client: Client,
    access: list[dict[str, Any]],
    metrics_text: str,
    stats: dict[str, Any],
    ledger_check: dict[str, Any],
    observer: Observer,
    plan: Plan,
    wall_s: float,
) -> dict[str, Any]:
    by_rid = {e.get("request_id"): e for e in access}
    normal = [o for o in client.outcomes if o.tenant != ABUSER]
    abusive = [o for o in client.outcomes if o.tenant == ABUSER]

    kinds: Counter[str] = Counter()
    for o in normal:
        kinds[o.kind if o.kind != "refused" else f"refused_429:{o.code}"] += 1
    rb = [ext_proc_phases(by_rid[o.rid]).get("rb") for o in normal if o.rid in by_rid]
    rh_rb = [
        sum(ext_proc_phases(by_rid[o.rid]).get(k, 0.0) for k in ("rh", "rb"))
        for o in normal
        if o.rid in by_rid
    ]
    rb_values = [v for v in rb if v is not None]
    rb_plain = [
        v
        for o in normal
        if o.tenant in NORMAL_TENANTS and o.rid in by_rid
        for v in [ext_proc_phases(by_rid[o.rid]).get("rb")]
        if v is not None
    ]
    sh = [
        ext_proc_phases(by_rid[o.rid]).get("sh")
        for o in normal
        if o.stream and o.kind == "ok" and o.rid in by_rid
    ]
    sh_values = [v for v in sh if v is not None]
    stream_headers = [
        o.headers_s for o in normal if o.stream and o.kind == "ok" and o.headers_s is not None
    ]
    unary_total = [
        o.total_s for o in normal if not o.stream and o.kind == "ok" and o.total_s is not None
    ]
    abuser_counts: dict[str, Counter[str]] = defaultdict(Counter)
    for o in abusive:
        label = o.kind
        if o.status is not None and o.kind not in ("client_cancelled", "client_abandoned"):
            label = f"{o.status} {o.code}".strip() if o.code else f"{o.status} {o.kind}"
        if o.status == 200 and o.replayed:
            label += " (replayed)"
        elif o.status == 200 and o.cache in ("hit", "miss"):
            label += f" (cache {o.cache})"
        abuser_counts[o.action][label] += 1
    envoy_codes = Counter(str(e.get("response_code")) for e in access)
    envoy_504 = [e.get("request_id") for e in access if e.get("response_code") == 504]
    normal_errors = {
        k: v for k, v in kinds.items() if k != "ok" and not k.startswith("refused_429")
    }
    return {
        "plan": asdict(plan),
        "wall_s": round(wall_s, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "backend": {
            "kv_budget_tokens": KV_BUDGET,
            "preemptions": stats["preemptions"],
            "peak_kv_tokens_used": stats["peak_kv_tokens_used"],
            "peak_blocks_used": stats["peak_blocks_used"],
            "peak_running": stats["peak_running"],
            "kvgate_kv_in_flight_max_sampled": observer.kvgate_kv_max,
            "sim_sequences": stats["requests_total"],
            "sim_aborted": stats["aborted_total"],
            "served_list_may_have_overflowed": observer.served_overflow,
        },
        "normal": {
            "requests": len(normal),
            "outcomes": dict(sorted(kinds.items())),
            "errors": normal_errors,
            "error_examples": [asdict(o) for o in normal if o.kind in normal_errors][:10],
            "decision_envoy_rb_ms": {
                "n": len(rb_values),
                "p50": ms(rb_values, 50),
                "p99": ms(rb_values, 99),
                "max": ms(rb_values, 100),
            },
            "decision_envoy_rb_ms_normal_1_to_4": {
                "n": len(rb_plain),
                "p50": ms(rb_plain, 50),
                "p99": ms(rb_plain, 99),
                "max": ms(rb_plain, 100),
            },
            "decision_envoy_rh_plus_rb_ms": {
                "n": len(rh_rb),
                "p50": ms(rh_rb, 50),
                "p99": ms(rh_rb, 99),
                "max": ms(rh_rb, 100),
            },
            "stream_response_headers_phase_ms": {
                "n": len(sh_values),
                "p50": ms(sh_values, 50),
                "p99": ms(sh_values, 99),
                "max": ms(sh_values, 100),
            },
            "stream_time_to_headers_ms": {
                "n": len(stream_headers),
                "p50": ms(stream_headers, 50),
                "p99": ms(stream_headers, 99),
                "max": ms(stream_headers, 100),
            },
            "unary_total_ms": {
                "n": len(unary_total),
                "p50": ms(unary_total, 50),
                "p99": ms(unary_total, 99),
                "max": ms(unary_total, 100),
            },
        },
        "kvgate_decision_seconds_all_tenants": decision_histogram(metrics_text),
        "abuser": {
            "requests": len(abusive),
            "by_action": {a: dict(sorted(c.items())) for a, c in sorted(abuser_counts.items())},
        },
        "envoy": {
            "response_codes": dict(sorted(envoy_codes.items())),
            "504_request_ids": envoy_504,
        },
        "ledger": ledger_check,
        "checks": {
            "preemptions_zero": stats["preemptions"] == 0,
            "peak_kv_within_budget": stats["peak_kv_tokens_used"] <= KV_BUDGET,
            "normal_no_errors": not normal_errors,
            "no_envoy_504": not envoy_504,
            "ledger_equals_served_every_tenant": all(
                t["ledger_equals_served"] for t in ledger_check["per_tenant"].values()
            ),
            "ledger_equals_served_but_documented_edges_every_tenant": all(
                t.get("ledger_equals_served_but_documented_edges", True)
                for t in ledger_check["per_tenant"].values()
            ),
            "ledger_equals_settled_lines_every_tenant": all(
                t["ledger_equals_settled_lines"] for t in ledger_check["per_tenant"].values()
            ),
            "ledger_cache_hits_equal_client_hits": all(
                t.get("ledger_cache_hits_equal_client_hits", True)
                for t in ledger_check["per_tenant"].values()
            ),
        },
    }


def metric_by_label(text: str, family_name: str, label: str) -> dict[str, float]:
    """One counter family's samples summed by one label."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for s in family.samples:
            if s.name.endswith("_total") or s.name == family_name:
                out[s.labels.get(label, "")] += float(s.value)
    return dict(sorted(out.items()))


def add_answer_layer(
    summary: dict[str, Any], client: Client, plan: Plan, shared: Shared, metrics_text: str
) -> None:
    """The answer layer's own numbers: the sharer's hits (never on a sampled request),
    kvgate's answer-layer counters, and the checks on Redis memory and quotas."""
    if plan.answer_layer == "off":
        return
    mine = [o for o in client.outcomes if o.tenant == SHARER]
    sampled = [o for o in mine if o.action.startswith("share_sampled")]
    after_abuser = [o for o in sampled if o.action == "share_sampled_after_abuser"]
    deterministic = [o for o in mine if o.action == "share_deterministic"]
    layer: dict[str, Any] = {
        "mode": plan.answer_layer,
        "config": {
            "response_cache": {
                "enabled": True,
                "scope": "model",
                "hit_charge": "free",
                "tenant_max_bytes": ANSWER_QUOTA_BYTES,
            },
            "idempotency": {
                "tenant_max_bytes": ANSWER_QUOTA_BYTES,
                "max_waiting_per_tenant": 32,
                "max_wait_s": 10,
                "retention_s": 86400,
            },
            "opted_in_tenants": [SHARER, ABUSER],
            "abuser_rpm": ANSWER_ABUSER_RPM,
        },
        "sharer": {
            "requests": len(mine),
            "sampled": len(sampled),
            "sampled_on_a_sample_the_abuser_read_to_the_end": len(after_abuser),
            "sampled_hits": sum(1 for o in sampled if o.cache == "hit"),
            "sampled_cache_header": dict(Counter(o.cache or "-" for o in sampled)),
            "deterministic": len(deterministic),
            "deterministic_cache_header": dict(Counter(o.cache or "-" for o in deterministic)),
        },
        "abuser_samples_read_to_the_end": len(shared.abuser_kept_samples),
        "kvgate_counters": {
            "kvgate_idempotent_requests_total": metric_by_label(
                metrics_text, "kvgate_idempotent_requests", "result"
            ),
            "kvgate_response_cache_total": metric_by_label(
                metrics_text, "kvgate_response_cache", "result"
            ),
            "kvgate_answers_not_stored_total": metric_by_label(
                metrics_text, "kvgate_answers_not_stored", "reason"
            ),
        },
    }
    summary["answer_layer"] = layer
    checks = summary["checks"]
    checks["sharer_never_hit_on_a_sampled_request"] = layer["sharer"]["sampled_hits"] == 0
    red = summary.get("redis")
    if red:
        checks["redis_peak_below_maxmemory"] = red["info_used_memory_peak"] < red["maxmemory"]
        checks["answer_quotas_held"] = all(
            v <= ANSWER_QUOTA_BYTES for v in red["quota_bytes_max"].values()
        )


def markdown(summary: dict[str, Any]) -> str:
    b = summary["backend"]
    n = summary["normal"]
    lines = [
        "| backend | value |",
        "|---|---|",
        f"| preemptions (simulator) | {b['preemptions']} |",
        f"| peak KV tokens used (simulator) / budget | {b['peak_kv_tokens_used']:,} / "
        f"{b['kv_budget_tokens']:,} |",
        f"| peak running sequences | {b['peak_running']} |",
        f"| kvgate KV in flight, max sampled (1 s) | {b['kvgate_kv_in_flight_max_sampled']:,.0f} |",
        f"| engine sequences / aborted | {b['sim_sequences']} / {b['sim_aborted']} |",
        "",
        "| normal tenants | p50 | p99 | max | n |",
        "|---|---|---|---|---|",
    ]
    for label, key in (
        ("decision: Envoy's ext_proc request-body phase (ms)", "decision_envoy_rb_ms"),
        (
            "decision: request-body phase, normal-1..4 only (ms)",
            "decision_envoy_rb_ms_normal_1_to_4",
        ),
        ("decision: request headers + body phases (ms)", "decision_envoy_rh_plus_rb_ms"),
        (
            "streamed: Envoy's ext_proc response-headers phase (ms)",
            "stream_response_headers_phase_ms",
        ),
        ("client time to response headers, streamed (ms)", "stream_time_to_headers_ms"),
        ("client total latency, non-streamed (ms)", "unary_total_ms"),
    ):
        v = n.get(key)
        if v is None:
            continue
        lines.append(f"| {label} | {v['p50']} | {v['p99']} | {v['max']} | {v['n']} |")
    lines += ["", "| normal tenants' outcomes | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in n["outcomes"].items()]
    for kind in ("envoy_504", "empty_body", "non_json_error_body"):
        if kind not in n["outcomes"]:
            lines.append(f"| {kind} | 0 |")
    lines += ["", "| kvgate_decision_seconds (all tenants) | count | p50 ≤ (ms) | p99 ≤ (ms) |"]
    lines.append("|---|---|---|---|")
    for outcome, v in summary["kvgate_decision_seconds_all_tenants"].items():
        lines.append(f"| {outcome} | {v['count']} | {v['p50_le_ms']:g} | {v['p99_le_ms']:g} |")
    lines += ["", "| abusive tenant: action | outcomes |", "|---|---|"]
    for action, counts in summary["abuser"]["by_action"].items():
        lines.append(f"| {action} | {', '.join(f'{k}: {v}' for k, v in counts.items())} |")
    lines += [
        "",
        "| tenant | sent | reached backend | ledger requests | ledger prompt / output | "
        "served prompt / output | ledger = served |",
        "|---|---|---|---|---|---|---|",
    ]
    for tenant, t in summary["ledger"]["per_tenant"].items():
        led, srv = t["ledger"], t["served"]
        lines.append(
            f"| {tenant} | {t['sent']} | {t['reached_backend']} | {led['requests']} | "
            f"{led['prompt_tokens']:,} / {led['output_tokens']:,} | "
            f"{srv['prompt_tokens']:,} / {srv['output_tokens']:,} | "
            f"{'yes' if t['ledger_equals_served'] else 'NO'} |"
        )
    edged = {
        tenant: t
        for tenant, t in summary["ledger"]["per_tenant"].items()
        if t.get("documented_edges") or t.get("unexplained_differences")
    }
    if edged:
        lines += [
            "",
            "| tenant | differences (charged - served) | kind | unexplained |",
            "|---|---|---|---|",
        ]
        for tenant, t in edged.items():
            d = t["documented_edges_charged_minus_served"]
            kinds = ", ".join(f"{k}: {v}" for k, v in t["documented_edges"].items())
            lines.append(
                f"| {tenant} | prompt {d['prompt_tokens']:+,}, output {d['output_tokens']:+,} | "
                f"{kinds} | {t['unexplained_differences']} |"
            )
    if any("cache_hits" in t["ledger"] for t in summary["ledger"]["per_tenant"].values()):
        lines += [
            "",
            "| tenant | ledger cache hits | client cache hits | client idempotent replays | "
            "ledger tokens saved |",
            "|---|---|---|---|---|",
        ]
        for tenant, t in summary["ledger"]["per_tenant"].items():
            led = t["ledger"]
            lines.append(
                f"| {tenant} | {led.get('cache_hits', 0)} | {t.get('client_cache_hits', 0)} | "
                f"{t.get('client_idempotent_replays', 0)} | {led.get('cache_saved_tokens', 0):,} |"
            )
    red = summary.get("redis")
    if red:
        lines += [
            "",
            "| Redis (sampled every 1 s) | bytes | MiB |",
            "|---|---|---|",
        ]
        for label, key in (
            ("maxmemory (noeviction)", "maxmemory"),
            ("answer store stop line (0.8 x maxmemory)", "answer_store_stop_line"),
            ("used_memory at start", "used_memory_start"),
            ("used_memory, peak sampled", "used_memory_peak_sampled"),
            ("used_memory, final", "used_memory_final"),
            ("INFO memory used_memory_peak", "info_used_memory_peak"),
        ):
            lines.append(f"| {label} | {red[key]:,} | {red[key] / MIB:.2f} |")
        lines.append(f"| keys, max / final | {red['keys_max']:,} / {red['keys_final']:,} | |")
        lines += [
            "",
            f"| answer-store quota use (limit {red['quota_limit_bytes'] / MIB:g} MiB per "
            "tenant and namespace) | max bytes | final bytes |",
            "|---|---|---|",
        ]
        for label, v in red["quota_bytes_max"].items():
            lines.append(f"| {label} | {v:,} | {red['quota_bytes_final'].get(label, 0):,} |")
    layer = summary.get("answer_layer")
    if layer:
        sh = layer["sharer"]
        lines += [
            "",
            f"| sharer ({SHARER}) | value |",
            "|---|---|",
            f"| sampled requests (each question once) | {sh['sampled']} |",
            "| ... on a question the abuser had sampled to the end | "
            f"{sh['sampled_on_a_sample_the_abuser_read_to_the_end']} |",
            f"| ... x-kvgate-cache | {sh['sampled_cache_header']} |",
            f"| sampled requests answered by a hit | **{sh['sampled_hits']}** |",
            f"| deterministic popular questions | {sh['deterministic']} |",
            f"| ... x-kvgate-cache | {sh['deterministic_cache_header']} |",
        ]
        lines += ["", "| kvgate counter | by result / reason |", "|---|---|"]
        for name, values in layer["kvgate_counters"].items():
            text = ", ".join(f"{k}: {v:g}" for k, v in values.items()) or "-"
            lines.append(f"| {name} | {text} |")
    lines += ["", "| check | passed |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["checks"].items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def redis_server(work: Path, maxmemory_mb: int) -> RedisServer:
    """A private redis-server on a free port, bounded as docs/redis.md recommends for kvgate:
    --maxmemory and --maxmemory-policy noeviction (nothing of kvgate's is ever evicted; at
    the bound writes fail, so kvgate's answer store stops short of it)."""
    server = RedisServer(work)
    server.process.argv += [
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "noeviction",
    ]
    return server


def kvgate_overrides(plan: Plan, redis_url: str | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {"server": {"log_level": "DEBUG"}}
    if redis_url is not None:
        overrides["store"] = redis_url
        overrides["redis"] = {"key_prefix": REDIS_KEY_PREFIX}
    if plan.answer_layer != "off":
        overrides["response_cache"] = {
            "enabled": True,
            "scope": "model",
            "hit_charge": "free",
            "tenant_max_bytes": ANSWER_QUOTA_BYTES,
        }
        overrides["idempotency"] = {
            "enabled": True,
            "tenant_max_bytes": ANSWER_QUOTA_BYTES,
            "max_waiting_per_tenant": 32,
            "max_wait_s": 10,
        }
    return overrides


def build_stack(out_dir: Path, plan: Plan, redis_url: str | None = None) -> Stack:
    answer_layer = plan.answer_layer != "off"
    tenants: list[dict[str, Any]] = [
        {"name": t, "api_key": key_of(t), "limits": NORMAL_LIMITS} for t in NORMAL_TENANTS
    ]
    opted_in = {"cache_sharing": True, "response_cache_sampled": True}
    if answer_layer:
        tenants.append(
            {"name": SHARER, "api_key": key_of(SHARER), "limits": NORMAL_LIMITS, **opted_in}
        )
    abuser_limits = dict(ABUSER_LIMITS)
    if answer_layer:
        abuser_limits["rpm"] = ANSWER_ABUSER_RPM
    tenants.append(
        {
            "name": ABUSER,
            "api_key": key_of(ABUSER),
            "limits": abuser_limits,
            **(opted_in if answer_layer else {}),
        }
    )
    tenants.append({"name": WARMUP, "api_key": key_of(WARMUP), **opted_in})
    work = out_dir / "stack"
    return Stack(
        tenants=tenants,
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": CONTEXT,
                "default_max_new_tokens": DEFAULT_MAX_NEW,
                "backend": BACKEND,
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": BLOCK,
                "max_concurrent_requests": 64,
            }
        ],
        sim=SimOptions(
            num_gpu_blocks=KV_BLOCKS,
            block_size=BLOCK,
            max_model_len=CONTEXT,
            ttft_ms=TTFT_MS,
            itl_ms=ITL_MS,
            extra_args=["--request-history", "100000", "--log-level", "warning"],
        ),
        kvgate_overrides=kvgate_overrides(plan, redis_url),
        work_dir=work,
        keep_work_dir=True,
    )


async def run(plan: Plan, out_dir: Path) -> dict[str, Any]:
    work = out_dir / "stack"
    if work.exists():
        shutil.rmtree(work)
    redis = redis_server(work / "redis", plan.redis_maxmemory_mb) if plan.store == "redis" else None
    if redis is not None:
        redis.start()
    try:
        return await run_stack(plan, out_dir, redis)
    finally:
        if redis is not None:
            redis.stop()  # after the stack: kvgate settles into it on shutdown


async def warm_up(client: Client, access: Callable[[], list[dict[str, Any]]]) -> list[Any]:
    """One request at a time by the warm-up tenant (plain, streamed, keyed, deterministic
    twice: a cache miss then a hit), before any load: a fresh kvgate's first decision is
    slow (tokenizer and store paths touched for the first time), and with Redis a Redis
    call that waits behind it past redis.timeout_s makes the replica apply its failure
    policy for everyone. Returned with Envoy's request-body phase per request."""
    bodies: list[tuple[dict[str, Any], dict[str, str]]] = [
        (chat_body("warmup-0", 100, max_tokens=8), {}),
        (chat_body("warmup-1", 100, max_tokens=8, stream=True), {}),
        (chat_body("warmup-2", 100, max_tokens=8), {"idempotency-key": "warmup-key"}),
        (chat_body("warmup-3", 100, max_tokens=8, temperature=0), {}),
        (chat_body("warmup-3", 100, max_tokens=8, temperature=0), {}),
    ]
    results: list[Outcome] = []
    for i, (body, extra) in enumerate(bodies):
        out = await client.post(WARMUP, f"warmup-{i:02d}", "warmup", body, extra=extra)
        results.append(out)
        await asyncio.sleep(0.3)
    # Not the run's: out of the outcomes, tenants and checks.
    client.outcomes = [o for o in client.outcomes if o.tenant != WARMUP]
    await asyncio.sleep(0.5)  # Envoy's access log
    phases = {e.get("request_id"): ext_proc_phases(e) for e in access()}
    return [
        {
            "rid": o.rid,
            "status": o.status,
            "code": o.code,
            "cache": o.cache,
            "total_ms": round((o.total_s or 0) * 1000, 1),
            "envoy_rb_ms": round(phases.get(o.rid, {}).get("rb", math.nan) * 1000, 2),
        }
        for o in results
    ]


async def run_stack(plan: Plan, out_dir: Path, redis: RedisServer | None) -> dict[str, Any]:
    stack = build_stack(out_dir, plan, redis.url if redis is not None else None)
    shared = Shared()
    with stack:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            client = Client(stack, session)
            warmup = await warm_up(client, stack.access_log) if plan.warmup else []
            observer = Observer(stack, session)
            stop = asyncio.Event()
            poller = asyncio.create_task(observer.run(stop))
            redis_obs = RedisObserver(redis.port) if redis is not None else None
            redis_poller = (
                asyncio.create_task(redis_obs.run(stop)) if redis_obs is not None else None
            )
            rng = random.Random(plan.seed)
            started = time.monotonic()
            load = asyncio.gather(
                *(
                    normal_tenant(
                        client,
                        t,
                        plan,
                        random.Random(f"{plan.seed}-{t}"),
                        shared if t == SHARER else None,
                    )
                    for t in normal_tenants(plan)
                ),
                abuser(client, plan, rng, shared),
            )
            try:
                await asyncio.wait_for(load, timeout=plan.duration_s + plan.drain_s)
            except TimeoutError:
                print("drain timeout: stragglers cancelled", file=sys.stderr)
            wall = time.monotonic() - started
            # Quiesce: kvgate holds nothing, the simulator runs nothing.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                await observer.poll_once()
                held = (await observer.metrics()).get(("kvgate_kv_tokens_in_flight", BACKEND), 0)
                if held == 0 and observer.last_stats.get("running") == 0:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)  # Envoy flushes its access log every 0.1 s
            await observer.poll_once()
            stop.set()
            await poller
            if redis_poller is not None and redis_obs is not None:
                await redis_poller
                await asyncio.to_thread(redis_obs.sample_once)  # the final reading
            stats = observer.last_stats
            sim_requests = (
                await fetch_json(session, f"{stack.sim_url}/sim/requests?limit=100000")
            )["requests"]
            usage = await fetch_json(session, f"{stack.kvgate_http_url}/admin/usage")
            metrics_text = await fetch_text(session, stack.kvgate_metrics_url)
        assert stack.kvgate is not None
        settled = settled_lines(stack.kvgate.log_text())
        access = [
            e for e in stack.access_log() if not str(e.get("request_id", "")).startswith("warmup-")
        ]
        raw = {
            "sim_requests": sim_requests,
            "sim_served": observer.served,
            "sim_stats": stats,
            "usage": usage,
            "kvgate_metrics": metrics_text,
        }
        (out_dir / "raw.json").write_text(json.dumps(raw), encoding="utf-8")
        ledger_check = compare(
            client.tenant_of,
            client.action_of,
            sim_requests,
            observer.served,
            settled,
            usage,
            access,
            normals=normal_tenants(plan),
            outcomes=client.outcomes,
        )
        summary = summarize(client, access, metrics_text, stats, ledger_check, observer, plan, wall)
        if redis_obs is not None:
            summary["redis"] = redis_obs.summary()
            raw["redis_samples"] = redis_obs.samples
            (out_dir / "raw.json").write_text(json.dumps(raw), encoding="utf-8")
        add_answer_layer(summary, client, plan, shared, metrics_text)
        summary["logs"] = str(stack.log_dir)
        summary["warmup"] = warmup
        (out_dir / "outcomes.jsonl").write_text(
            "".join(json.dumps(asdict(o)) + "\n" for o in client.outcomes), encoding="utf-8"
        )
    return summary


def recompute(out_dir: Path) -> dict[str, Any]:
    """Redo the ledger comparison from a finished run's saved files (outcomes.jsonl,
    raw.json, the kvgate and Envoy logs under stack/logs) without sending any load; the
    summary's other numbers are kept as they were measured."""
    summary: dict[str, Any] = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    raw = json.loads((out_dir / "raw.json").read_text(encoding="utf-8"))
    tenant_of: dict[str, str] = {}
    action_of: dict[str, str] = {}
    for line in (out_dir / "outcomes.jsonl").read_text(encoding="utf-8").splitlines():
        o = json.loads(line)
        tenant_of[o["rid"]] = o["tenant"]
        action_of[o["rid"]] = o["action"]
    logs = out_dir / "stack" / "logs"
    settled = settled_lines((logs / "kvgate.log").read_text(encoding="utf-8", errors="replace"))
    access = []
    for line in (logs / "envoy.log").read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                access.append(json.loads(line))
    outcomes = [
        Outcome(**json.loads(line))
        for line in (out_dir / "outcomes.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    summary["ledger"] = compare(
        tenant_of,
        action_of,
        raw["sim_requests"],
        raw["sim_served"],
        settled,
        raw["usage"],
        access,
        normals=normal_tenants(summary.get("plan")),
        outcomes=outcomes,
    )
    per_tenant = summary["ledger"]["per_tenant"].values()
    checks = summary["checks"]
    checks["ledger_equals_served_every_tenant"] = all(t["ledger_equals_served"] for t in per_tenant)
    checks["ledger_equals_served_but_documented_edges_every_tenant"] = all(
        t["ledger_equals_served_but_documented_edges"] for t in per_tenant
    )
    checks["ledger_equals_settled_lines_every_tenant"] = all(
        t["ledger_equals_settled_lines"] for t in per_tenant
    )
    checks["ledger_cache_hits_equal_client_hits"] = all(
        t["ledger_cache_hits_equal_client_hits"] for t in per_tenant
    )
    summary["ledger_recomputed_from_saved_run"] = True
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=75.0, help="seconds of arrivals")
    parser.add_argument("--normal-rate", type=float, default=1.5, help="req/s per normal tenant")
    parser.add_argument("--abuser-workers", type=int, default=4)
    parser.add_argument("--max-requests", type=int, default=3000)
    parser.add_argument("--drain", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--store",
        choices=["memory", "redis"],
        default="memory",
        help="redis: a private redis-server (--maxmemory, noeviction) as kvgate's store",
    )
    parser.add_argument("--redis-maxmemory-mb", type=int, default=REDIS_MAXMEMORY_MB)
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="send the load to a fresh kvgate, without the warm-up requests",
    )
    parser.add_argument(
        "--answer-layer",
        choices=["off", "baseline", "attack"],
        default="off",
        help="baseline: response cache (scope model) + idempotency, a sharing normal tenant, "
        "the abuser opted in; attack: baseline + the abuser's answer-layer actions",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="no load: redo the ledger comparison from the saved run in --out",
    )
    args = parser.parse_args(argv)
    plan = Plan(
        duration_s=args.duration,
        normal_rate=args.normal_rate,
        abuser_workers=args.abuser_workers,
        max_requests=args.max_requests,
        drain_s=args.drain,
        seed=args.seed,
        store=args.store,
        answer_layer=args.answer_layer,
        redis_maxmemory_mb=args.redis_maxmemory_mb,
        warmup=not args.no_warmup,
    )
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = recompute(out_dir) if args.recompute else asyncio.run(run(plan, out_dir))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    (out_dir / "summary.md").write_text(markdown(summary), encoding="utf-8")
    print(json.dumps(summary, indent=2))
    print(f"\nwrote {out_dir / 'summary.json'} and {out_dir / 'summary.md'}", file=sys.stderr)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
