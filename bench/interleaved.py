"""Added latency and CPU per request, one request in flight, arms interleaved request by request.

    .venv/bin/python -m bench.interleaved                          # the chat cases, default counts
    .venv/bin/python -m bench.interleaved --cases 1k,1k-messages,1k-responses  # the APIs, paired
    .venv/bin/python -m bench.interleaved --iterations 20,100k=4   # a quick pass (~5 min)
    .venv/bin/python -m bench.interleaved --cases 1k,stream --arms envoy,noop,kvgate,kvgate-redis
    .venv/bin/python -m bench.interleaved --kvgate-args="--log-level warning"
    .venv/bin/python -m bench.interleaved --cases 1k --arms envoy,noop,kvgate,kvgate-keys

Starts the stack of bench/stack.py (simulator, one Envoy per arm, kvgate, the no-op ext_proc)
and sends ONE request at a time: arm A request 1, arm B request 1, arm C request 1, arm A
request 2, ..., the arm order rotated at every step (ABC, BCA, CAB, ...) so no arm is always
first after a pause and slow drifts of a noisy machine fall on every arm alike. Each arm
keeps one keep-alive connection. The simulator answers at once except in `stream`.

Cases (chat completions, `max_tokens` 16 unless stated; the `-messages` and `-responses` ones
on the Anthropic Messages and OpenAI Responses APIs):

| case         | request                                                                   |
|--------------|---------------------------------------------------------------------------|
| 1k           | one user message of ~1,000 tokens, a unique prefix per request            |
| conversation | 12 turns of a fresh agent-like conversation per iteration: ~1.5k-token    |
|              | system prompt, +~2k tokens of history per turn (turn k resends all of it  |
|              | + a new user message); reported per turn and over prompts >= 16k tokens   |
| 100k         | one user message of ~100,000 tokens, unique per request (8 per arm)       |
| stream       | `stream: true`, 32 tokens, the simulator at 10 ms/token, one stream in    |
|              | flight; every inter-token gap as read by the client (bench/loadgen.py's   |
|              | SSE clock: events arriving in one read share its timestamp)               |
| 1k-messages, | 1k and conversation on `POST /v1/messages` and `POST /v1/responses`: the  |
| conversation-| same prompt sizes and history growth in each API's request shape, the     |
| messages,    | conversations' history an agent's (tool_use / tool_result,                |
| 1k-responses,| function_call / function_call_output), output capped at 16                |
| conversation-| (bench/api_cases.py); reported as their chat case, plus a table of        |
| responses    | kvgate's added p50 and CPU per request per API beside chat's (the ratio)  |
| conversation-| the agent conversation of those two on chat completions (assistant        |
| chat-tools   | tool_calls, tool messages, tools): chat's reference for the same shape    |
| 1k-embeddings| the 1k text as one input of `POST /v1/embeddings` on the simulator's      |
|              | embedding model (nothing generated); compared with 1k like the others     |

A case and the same case on the other APIs (1k, 1k-messages, 1k-responses) run together,
interleaved the same way: step j of each, the cases' order rotated every step, so the APIs'
comparison is paired like the arms' (`--sequential` runs every case alone instead).

Per case and arm: n, failures (every non-200 / transport error / short stream is printed),
latency p50/p90/p99, added p50 over `envoy` (arm p50 minus envoy p50, and the median of the
paired per-step differences), CPU per request of the gateway process (kvgate or the no-op
ext_proc) and of the arm's Envoy, and kvgate CPU / noop CPU.

CPU per request is measured around each request: the sum of the process's threads'
/proc/<pid>/task/*/schedstat run time (ns resolution; /proc/<pid>/stat counts 10 ms ticks)
from just before the request is sent until `--pause-ms` after its response ended, so work
kvgate does after the response (settling) is counted and the idle time while other arms run
is not. The whole-case /proc/<pid>/stat delta divided by the arm's requests (idle time
included) is reported alongside as a cross-check.

Options: `--cases 1k,conversation,100k,stream` (the default; the API cases are asked for by
name, or `--cases all`); `--iterations 200` (all cases but 100k) or per case
`--iterations 20,100k=4,stream=50` (defaults 1k=200, conversation=20, 100k=8, stream=100,
the API cases as their chat case); `--arms envoy,noop,kvgate[,kvgate-redis]` (Redis at
127.0.0.1:6379, or `--redis-url`); `--kvgate-args` passed to `kvgate serve`; `--out DIR`
(default var/bench/interleaved-<date>). It writes `interleaved.csv` (one row per request),
`interleaved-gaps.csv` (every inter-token gap) and `interleaved.md` (the tables and the
targets), and keeps the processes' logs in DIR/stack/logs.

API keys as data: `--arms ...,kvgate-keys` adds kvgate exactly as the kvgate arm but with the
client's key not in the YAML: one of 1,000,000 keys (`--directory-keys`) in the embedded key
directory (a SQLite file in DIR/stack, filled before kvgate starts, ~20 s);
`kvgate-keys-redis` the same in the Redis directory beside kvgate-redis (asked for by name:
1M keys take ~300 MB of that Redis while the run lasts). The report then shows each keys
arm's added p50 and CPU per request beside its reference arm's (kvgate, or kvgate-redis) and
the ratio, and the directory's fill and lookup times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime as dt
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.api_cases import (
    PATHS,
    TOOL_DEFINITION_TOKENS,
    WIRE_API,
    AgentConversation,
    api_headers,
    prompt_tokens_of,
    single_body,
)
from bench.cpu import process_cpu_seconds, threads_cpu_seconds
from bench.loadgen import _StreamClock
from bench.prompts import prompt_text
from bench.provenance import git_output
from bench.stack import (
    DIRECTORY_KEYS,
    MODEL,
    REPO_ROOT,
    Arm,
    BenchStack,
    KeyStoreFill,
    SimSettings,
)
from bench.stats import percentile
from vllm_sim.tokenization import SINGLE_TOKEN_WORDS

CHAT_CASES = ("1k", "conversation", "100k", "stream")
OTHER_APIS = ("messages", "responses")
# The 1k and conversation cases again on the other APIs: "<chat case>-<api>".
API_CASES = tuple(f"{case}-{api}" for api in OTHER_APIS for case in ("1k", "conversation"))
# The agent conversation of the two others on chat completions: chat's reference for the shape.
API_CASES += ("conversation-chat-tools",)
# The 1k text as one embedding input (POST /v1/embeddings): kvgate's cost on a request that
# generates nothing, beside chat's 1k.
POOLING_CASES = ("1k-embeddings",)
API_CASES += POOLING_CASES
# The APIs compared with chat's (the 20 % target).
COMPARED_APIS = (*OTHER_APIS, "embeddings")
CASES = CHAT_CASES + API_CASES
DEFAULT_ITERATIONS = {"1k": 200, "conversation": 20, "100k": 8, "stream": 100}
DEFAULT_ITERATIONS |= {case: DEFAULT_ITERATIONS[case.split("-")[0]] for case in API_CASES}
# New arms go last: an arm's index is part of its prompts' markers (the same length in all).
ALLOWED_ARMS = (
    "direct",
    "envoy",
    "noop",
    "kvgate",
    "kvgate-redis",
    "kvgate-keys",
    "kvgate-keys-redis",
)
# The keys arms and the arm each is compared with (the same kvgate, the key in the YAML).
KEYS_ARM_REFERENCES = {"kvgate-keys": "kvgate", "kvgate-keys-redis": "kvgate-redis"}
REFERENCE = "envoy"
NOOP = "noop"

MAX_TOKENS = 16
STREAM_TOKENS = 32
STREAM_ITL_MS = 10.0
# The conversation: a ~1.5k system prompt, then each turn adds a ~500-token user message and
# a ~1.5k-token assistant answer (tool output, code): turn k sends ~2k x k tokens.
TURNS = 12
SYSTEM_TOKENS = 1500
USER_TOKENS = 500
ASSISTANT_TOKENS = 1500
LONG_HISTORY = 16_000  # prompt tokens from which a turn counts as "long" in the aggregate

# The targets, evaluated for every kvgate arm (see targets_table).
TARGET_CPU_RATIO = 1.5
TARGET_1K_OVER_NOOP_MS = 0.5
TARGET_CONV_OVER_NOOP_MS = 2.0
TARGET_100K_ADDED_MS = 25.0
TARGET_STREAM_GAP_P99_MS = 0.5
# kvgate's added p50 and CPU per request on another API, over chat's in the same case.
TARGET_API_OVER_CHAT = 1.2


def case_api(case: str) -> str:
    """The API a case is sent on: chat, messages or responses."""
    _, _, api = case.partition("-")
    return api or "chat"


def case_base(case: str) -> str:
    """The chat case a case repeats on another API (itself on chat)."""
    return case.partition("-")[0]


# --------------------------------------------------------------------------- CPU


def gateway_role(arm: Arm) -> str | None:
    """The role in arm.pids of the ext_proc server (kvgate or the no-op one)."""
    for role in ("kvgate", "extproc"):
        if role in arm.pids:
            return role
    return None


def cpu_snapshot(arm: Arm) -> dict[str, float]:
    return {role: threads_cpu_seconds(pid) for role, pid in arm.pids.items()}


# --------------------------------------------------------------------------- requests


@dataclass
class Sample:
    case: str
    iteration: int
    turn: int  # 0 outside the conversation
    arm: str
    step: int  # position in the interleaved sequence (pairs arms' requests)
    latency_s: float = math.nan
    status: int = 0
    error: str = ""
    prompt_tokens: int | None = None
    ttft_s: float = math.nan
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # role -> seconds for this request

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Request:
    body: bytes
    stream: bool = False
    api: str = "chat"


def _session() -> aiohttp.ClientSession:
    # limit=1: one keep-alive connection per arm, reused by every request of the arm.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1, use_dns_cache=False),
        timeout=aiohttp.ClientTimeout(total=300),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


async def read_answer(resp: aiohttp.ClientResponse, clock: _StreamClock | None) -> bytes:
    """A 200 stream is fed to `clock` as it arrives (token gaps); anything else is read
    whole and returned."""
    if clock is not None and resp.status == 200:
        async for chunk in resp.content.iter_any():
            clock.feed(chunk, time.perf_counter())
        return b""
    return await resp.read()


async def send(
    session: aiohttp.ClientSession, arm: Arm, request: Request, sample: Sample, pause_s: float
) -> None:
    clock = _StreamClock() if request.stream else None
    raw = b""
    before = cpu_snapshot(arm)
    start = time.perf_counter()
    try:
        url = arm.base_url + PATHS[request.api]
        headers = api_headers(request.api, arm.api_key)
        async with session.post(url, data=request.body, headers=headers) as resp:
            sample.status = resp.status
            raw = await read_answer(resp, clock)
        sample.latency_s = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    # Work the gateway does after the response (settling) belongs to this request.
    await asyncio.sleep(pause_s)
    after = cpu_snapshot(arm)
    sample.cpu_s = {role: after[role] - before.get(role, 0.0) for role in after}
    if sample.error:
        return
    if sample.status != 200:
        sample.error = f"http {sample.status}: {raw[:200].decode(errors='replace')}"
    elif clock is not None:
        sample.tokens = clock.n
        sample.gaps = clock.gaps
        if clock.first is not None:
            sample.ttft_s = clock.first - start
        if clock.n < STREAM_TOKENS:
            sample.error = f"short stream: {clock.n} of {STREAM_TOKENS} token events"
    else:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            sample.prompt_tokens = prompt_tokens_of(request.api, json.loads(raw))


# --------------------------------------------------------------------------- bodies


def _body(messages: list[dict[str, str]], *, max_tokens: int, stream: bool = False) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def _words(rng: random.Random, n: int) -> str:
    # Random single-token words: distinct text per message, so no cache keyed on a message
    # (or on a prefix of one) sees it before, and ~1 token per word.
    return " ".join(rng.choices(SINGLE_TOKEN_WORDS, k=n))


class Bodies:
    """Request bodies per case; every marker embeds the run id, the arm and the iteration."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._text_1k = prompt_text(1000)
        self._text_100k = prompt_text(100_000)
        self._conversations: dict[tuple[int, str], list[dict[str, str]]] = {}
        self._agents: dict[tuple[str, int, str], AgentConversation] = {}

    def marker(self, case: str, arm: str, iteration: int) -> str:
        # The arm's index, not its name: the same prompt length in every arm.
        return f"[{self.run_id} {case} {ALLOWED_ARMS.index(arm)} {iteration}]"

    def single(self, case: str, arm: str, iteration: int) -> Request:
        # The unique marker leads the message: a unique prefix for any prefix cache.
        text = self._text_100k if case == "100k" else self._text_1k
        content = f"{self.marker(case, arm, iteration)} {text}"
        api = case_api(case)
        if api != "chat":
            return Request(single_body(api, MODEL, content, MAX_TOKENS), api=api)
        stream = case == "stream"
        max_tokens = STREAM_TOKENS if stream else MAX_TOKENS
        return Request(
            _body([{"role": "user", "content": content}], max_tokens=max_tokens, stream=stream),
            stream,
        )

    def conversation_turn(self, arm: str, iteration: int, turn: int, api: str = "chat") -> Request:
        if api != "chat":
            return self._agent_turn(api, arm, iteration, turn)
        key = (iteration, arm)
        if key not in self._conversations:
            # A new conversation per (iteration, arm), built once and resent verbatim turn
            # after turn, as a client resends its history.
            self._conversations.pop((iteration - 1, arm), None)
            rng = random.Random(f"{self.run_id}/{iteration}/{arm}")
            system = f"{self.marker('conversation', arm, iteration)} You are an agent. " + _words(
                rng, SYSTEM_TOKENS
            )
            messages = [{"role": "system", "content": system}]
            for k in range(TURNS):
                messages.append({"role": "user", "content": _words(rng, USER_TOKENS)})
                if k < TURNS - 1:
                    messages.append({"role": "assistant", "content": _words(rng, ASSISTANT_TOKENS)})
            self._conversations[key] = messages
        # turn k (1-based): the system prompt, k-1 exchanges, the k-th user message.
        messages = self._conversations[key][: 2 * turn]
        return Request(_body(messages, max_tokens=MAX_TOKENS))

    def _agent_turn(self, api: str, arm: str, iteration: int, turn: int) -> Request:
        """A turn of the conversation on another API: the same system prompt and user
        messages' sizes, the assistant's answers an agent's steps (bench/api_cases.py)."""
        key = (api, iteration, arm)
        if key not in self._agents:
            self._agents.pop((api, iteration - 1, arm), None)
            rng = random.Random(f"{self.run_id}/{api}/{iteration}/{arm}")
            case = f"conversation-{api}"
            # The tools' definitions stand for part of the system prompt's size.
            system = f"{self.marker(case, arm, iteration)} You are an agent. " + _words(
                rng, SYSTEM_TOKENS - TOOL_DEFINITION_TOKENS
            )
            self._agents[key] = AgentConversation(
                rng, _words, system=system, turns=TURNS, user_tokens=USER_TOKENS
            )
        tag = f"{ALLOWED_ARMS.index(arm)}x{iteration}".replace("-", "m")
        body = self._agents[key].body(api, MODEL, turn, MAX_TOKENS, tag)
        return Request(body, api=WIRE_API[api])


# --------------------------------------------------------------------------- a case


@dataclass
class CaseRun:
    name: str
    samples: list[Sample] = field(default_factory=list)
    # pid role -> whole-case /proc/<pid>/stat delta, per arm
    whole_cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)
    gateway: dict[str, str | None] = field(default_factory=dict)  # arm -> its gateway's role
    wall_s: float = 0.0
    together: list[str] = field(default_factory=list)  # the cases run interleaved with it


def rotated(items: Sequence[str], k: int) -> list[str]:
    k %= len(items)
    return [*items[k:], *items[:k]]


Step = tuple[int, int, Callable[[str], Request]]


async def run_cases(
    runs: Sequence[CaseRun],
    stack: BenchStack,
    arms: list[str],
    steps: Sequence[Sequence[Step]],
    warmup: Sequence[Sequence[Step]],
    pause_s: float,
) -> None:
    """Each step: (iteration, turn, arm -> request); every arm sends it, in rotated order.

    Several cases (a chat case and the same case on the other APIs) run interleaved step by
    step: step j of every case, the cases' order rotated each step, each case's step sent by
    every arm in an order rotated at every case-step; so a drift of the machine falls on the
    APIs alike and their comparison is paired as the arms' is. The whole-case CPU (idle
    included) is then left out: it cannot be told apart per case.

    Fills `runs` as it goes, so an interrupted case keeps what it measured."""
    for run in runs:
        run.gateway = {a: gateway_role(stack.arms[a]) for a in arms}
        run.together = [r.name for r in runs if r is not run]
    sessions = {a: _session() for a in arms}
    order = list(range(len(runs)))
    try:
        for j in range(max(map(len, warmup), default=0)):
            for c in order:
                if j < len(warmup[c]):
                    iteration, turn, make = warmup[c][j]
                    for arm in arms:
                        sample = Sample(runs[c].name, iteration, turn, arm, -1)
                        await send(sessions[arm], stack.arms[arm], make(arm), sample, pause_s)
        start_cpu = {a: _proc_cpu(stack.arms[a]) for a in arms}
        wall0 = time.perf_counter()
        k = 0  # case-steps sent: the arms' rotation
        for j in range(max(map(len, steps), default=0)):
            for c in (order[(i + j) % len(order)] for i in order):
                if j >= len(steps[c]):
                    continue
                run = runs[c]
                iteration, turn, make = steps[c][j]
                for arm in rotated(arms, k):
                    # Built before the clock starts: body encoding is the client's cost.
                    request = make(arm)
                    sample = Sample(run.name, iteration, turn, arm, j)
                    await send(sessions[arm], stack.arms[arm], request, sample, pause_s)
                    if sample.error:
                        where = f"{run.name} it{iteration} t{turn} {arm}"
                        print(f"  FAIL {where}: {sample.error}", flush=True)
                    run.samples.append(sample)
                k += 1
        wall = time.perf_counter() - wall0
        for run in runs:
            run.wall_s = wall
        if len(runs) == 1:
            for arm in arms:
                end = _proc_cpu(stack.arms[arm])
                runs[0].whole_cpu_s[arm] = {r: end[r] - start_cpu[arm].get(r, 0.0) for r in end}
    finally:
        for session in sessions.values():
            await session.close()


def _proc_cpu(arm: Arm) -> dict[str, float]:
    return {role: process_cpu_seconds(pid) for role, pid in arm.pids.items()}


def case_steps(case: str, bodies: Bodies, iterations: int, *, warmup: bool) -> list[Step]:
    # Warm-up iterations are negative: their markers never collide with measured ones.
    first = -iterations if warmup else 0
    out: list[Step] = []
    for i in range(first, first + iterations):
        if case_base(case) == "conversation":
            api = case_api(case)
            for turn in range(1, TURNS + 1):
                out.append(
                    (
                        i,
                        turn,
                        lambda arm, i=i, t=turn, api=api: bodies.conversation_turn(arm, i, t, api),
                    )
                )
        else:
            out.append((i, 0, lambda arm, i=i: bodies.single(case, arm, i)))
    return out


# --------------------------------------------------------------------------- statistics


@dataclass
class ArmStats:
    n: int
    fail: int
    p50: float  # ms
    p90: float
    p99: float
    gateway_cpu_ms: float  # per request; NaN when the arm has no gateway
    envoy_cpu_ms: float
    other_cpu_ms: float  # redis, when the arm has it
    whole_gateway_cpu_ms: float
    gap_n: int = 0
    gap_p50: float = math.nan
    gap_p99: float = math.nan
    ttft_p50: float = math.nan


def _ms(values: Iterable[float]) -> list[float]:
    return [v * 1e3 for v in values]


def arm_stats(run: CaseRun, arm: str, samples: list[Sample]) -> ArmStats:
    mine = [s for s in samples if s.arm == arm]
    ok = [s for s in mine if s.ok]
    lat = _ms(s.latency_s for s in ok)
    n = len(mine)

    def cpu(role: str | None) -> float:
        if role is None or not mine or role not in mine[0].cpu_s:
            return math.nan
        return sum(s.cpu_s.get(role, 0.0) for s in mine) / n * 1e3

    role = run.gateway.get(arm)
    whole = run.whole_cpu_s.get(arm, {})
    runs_all = [s for s in run.samples if s.arm == arm]
    gaps = _ms(g for s in ok for g in s.gaps)
    return ArmStats(
        n=len(ok),
        fail=n - len(ok),
        p50=percentile(lat, 50),
        p90=percentile(lat, 90),
        p99=percentile(lat, 99),
        gateway_cpu_ms=cpu(role),
        envoy_cpu_ms=cpu("envoy"),
        other_cpu_ms=cpu("redis"),
        whole_gateway_cpu_ms=(
            whole[role] / len(runs_all) * 1e3 if role in whole and runs_all else math.nan
        ),
        gap_n=len(gaps),
        gap_p50=percentile(gaps, 50),
        gap_p99=percentile(gaps, 99),
        ttft_p50=percentile(_ms(s.ttft_s for s in ok), 50),
    )


def paired_added_p50(samples: list[Sample], arm: str) -> float:
    """Median over steps of (arm latency - envoy latency) of the same step."""
    ref = {(s.iteration, s.turn): s.latency_s for s in samples if s.arm == REFERENCE and s.ok}
    diffs = [
        (s.latency_s - ref[(s.iteration, s.turn)]) * 1e3
        for s in samples
        if s.arm == arm and s.ok and (s.iteration, s.turn) in ref
    ]
    return percentile(diffs, 50)


# --------------------------------------------------------------------------- report


def fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def latency_table(
    run: CaseRun, arms: list[str], samples: list[Sample]
) -> tuple[str, dict[str, ArmStats]]:
    stats = {a: arm_stats(run, a, samples) for a in arms}
    ref = stats.get(REFERENCE)
    noop = stats.get(NOOP)
    lines = [
        "| arm | n | fail | p50 ms | p90 ms | p99 ms | added p50 | paired added p50 "
        "| gateway CPU ms/req | Envoy CPU ms/req | gateway CPU / noop | gateway CPU whole-case |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, st in stats.items():
        added = st.p50 - ref.p50 if ref else math.nan
        paired = paired_added_p50(samples, arm) if arm != REFERENCE else 0.0
        ratio = st.gateway_cpu_ms / noop.gateway_cpu_ms if noop else math.nan
        extra = f" (+ redis {fmt(st.other_cpu_ms, 3)})" if not math.isnan(st.other_cpu_ms) else ""
        lines.append(
            f"| {arm} | {st.n} | {st.fail} | {fmt(st.p50)} | {fmt(st.p90)} | {fmt(st.p99)} "
            f"| {fmt(added)} | {fmt(paired)} | {fmt(st.gateway_cpu_ms, 3)}{extra} "
            f"| {fmt(st.envoy_cpu_ms, 3)} | {fmt(ratio)} | {fmt(st.whole_gateway_cpu_ms, 3)} |"
        )
    return "\n".join(lines), stats


def conversation_tables(
    run: CaseRun, arms: list[str], long_turns: list[int] | None = None
) -> tuple[str, dict[str, ArmStats]]:
    """Per turn, then the long turns together: `long_turns`, or the run's own turns whose
    prompt is >= LONG_HISTORY tokens (the API cases take the chat case's, the same turns)."""
    others = [a for a in arms if a != REFERENCE]
    gateways = [a for a in arms if run.gateway.get(a)]
    head = ["turn", "prompt tokens", f"{REFERENCE} p50 ms"]
    head += [f"{a} added p50" for a in others]
    head += [f"{a} CPU ms/req" for a in gateways]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for turn in range(1, TURNS + 1):
        samples = [s for s in run.samples if s.turn == turn]
        stats = {a: arm_stats(run, a, samples) for a in arms}
        tokens = [s.prompt_tokens for s in samples if s.prompt_tokens]
        ref = stats[REFERENCE].p50
        row = [str(turn), f"{int(np.median(tokens)):,}" if tokens else "n/a", fmt(ref)]
        row += [fmt(stats[a].p50 - ref) for a in others]
        row += [fmt(stats[a].gateway_cpu_ms, 3) for a in gateways]
        lines.append("| " + " | ".join(row) + " |")
    per_turn = "\n".join(lines)
    own = long_turns is None
    if long_turns is None:
        long_turns = _long_turns(run)
    long = [s for s in run.samples if s.turn in long_turns]
    agg, stats = latency_table(run, arms, long)
    turns = f"{min(long_turns)}-{max(long_turns)}" if long_turns else "none"
    which = (
        f"Turns whose prompt (the history resent + the new user message) is >= "
        f"{LONG_HISTORY:,} tokens (turns {turns})"
        if own
        else f"The chat conversation's turns of >= {LONG_HISTORY:,} tokens (turns {turns})"
    )
    text = f"Per turn (p50 over iterations):\n\n{per_turn}\n\n{which}, all together:\n\n{agg}"
    return text, stats


def _long_turns(run: CaseRun) -> list[int]:
    turns = []
    for turn in range(1, TURNS + 1):
        tokens = [s.prompt_tokens for s in run.samples if s.turn == turn and s.prompt_tokens]
        if tokens and np.median(tokens) >= LONG_HISTORY:
            turns.append(turn)
    return turns


def stream_table(run: CaseRun, arms: list[str]) -> tuple[str, dict[str, ArmStats]]:
    stats = {a: arm_stats(run, a, run.samples) for a in arms}
    ref = stats.get(REFERENCE)
    noop = stats.get(NOOP)
    lines = [
        "| arm | streams | fail | gaps | gap p50 ms | gap p99 ms | added gap p50 "
        "| added gap p99 | TTFT p50 ms | added TTFT p50 | stream p50 ms "
        "| gateway CPU ms/stream | Envoy CPU ms/stream | gateway CPU / noop |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, st in stats.items():
        ratio = st.gateway_cpu_ms / noop.gateway_cpu_ms if noop else math.nan
        lines.append(
            f"| {arm} | {st.n} | {st.fail} | {st.gap_n} | {fmt(st.gap_p50)} | {fmt(st.gap_p99)} "
            f"| {fmt(st.gap_p50 - ref.gap_p50 if ref else math.nan)} "
            f"| {fmt(st.gap_p99 - ref.gap_p99 if ref else math.nan)} | {fmt(st.ttft_p50)} "
            f"| {fmt(st.ttft_p50 - ref.ttft_p50 if ref else math.nan)} | {fmt(st.p50)} "
            f"| {fmt(st.gateway_cpu_ms, 3)} | {fmt(st.envoy_cpu_ms, 3)} | {fmt(ratio)} |"
        )
    return "\n".join(lines), stats


def _verdict(measured: float, limit: float, unit: str) -> tuple[str, str]:
    if math.isnan(measured) or math.isnan(limit):
        return "n/a", ""
    spare = limit - measured
    if spare >= 0:
        return "met", f"{spare:.2f} {unit} to spare"
    return "missed", f"over by {-spare:.2f} {unit}"


def _added(stats: dict[str, dict[str, ArmStats]], case: str, arm: str) -> float:
    st = stats.get(case, {})
    if arm not in st or REFERENCE not in st:
        return math.nan
    return st[arm].p50 - st[REFERENCE].p50


def _cpu(stats: dict[str, dict[str, ArmStats]], case: str, arm: str) -> float:
    st = stats.get(case, {})
    return st[arm].gateway_cpu_ms if arm in st else math.nan


def _ratio(value: float, ref: float) -> float:
    """value / ref; NaN unless both are > 0 (an added p50 <= 0 is below what the run
    resolves, and a ratio to it means nothing)."""
    if math.isnan(value) or math.isnan(ref) or value <= 0 or ref <= 0:
        return math.nan
    return value / ref


def _within(ratio: float) -> str:
    return "n/a" if math.isnan(ratio) else ("yes" if ratio <= TARGET_API_OVER_CHAT else "no")


def api_table(
    stats: dict[str, dict[str, ArmStats]],
    paired: dict[str, dict[str, float]],
    prompt_tokens: dict[str, float],
    arms: list[str],
) -> str:
    """Per kvgate arm and case: kvgate's added p50 and CPU per request on each API beside
    chat's, and the ratio to chat's (the target: <= 1.2, i.e. at most 20 % above chat).

    Also the paired added p50 and kvgate's CPU over the no-op server's in the same case
    (which takes out a drift of the machine between cases), each as a ratio to chat's, and
    in the conversation the CPU over chat-tools' (chat with the same agent history)."""
    lines = [
        "| arm | case | API | prompt tokens p50 | added p50 ms | / chat | paired added p50 ms "
        "| / chat | CPU ms/req | / chat | CPU / noop CPU | / chat | CPU / chat-tools' "
        "| within 20 % of chat (added p50, CPU) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arm in (a for a in arms if a.startswith("kvgate")):
        for base in ("1k", "conversation"):
            for api in ("chat", "chat-tools", *COMPARED_APIS):
                case = base if api == "chat" else f"{base}-{api}"
                if case not in stats:
                    continue

                def row(case: str, arm: str = arm) -> tuple[float, float, float, float]:
                    cpu = _cpu(stats, case, arm)
                    noop = _cpu(stats, case, NOOP)
                    pair = paired.get(case, {}).get(arm, math.nan)
                    return _added(stats, case, arm), pair, cpu, cpu / noop if noop else math.nan

                mine = row(case)
                if api == "chat":
                    ratios = (math.nan,) * 4
                    verdict = "(reference)"
                else:
                    chat = row(base)
                    ratios = (
                        _ratio(mine[0], chat[0]),
                        _ratio(mine[1], chat[1]),
                        _ratio(mine[2], chat[2]),
                        _ratio(mine[3], chat[3]),
                    )
                    verdict = f"{_within(ratios[0])}, {_within(ratios[2])}"
                tools_case = f"{base}-chat-tools"
                over_tools = math.nan
                if api in OTHER_APIS and tools_case in stats:
                    over_tools = _ratio(mine[2], _cpu(stats, tools_case, arm))
                lines.append(
                    f"| {arm} | {base} | {api} | {fmt(prompt_tokens.get(case, math.nan), 0)} "
                    f"| {fmt(mine[0])} | {fmt(ratios[0])} | {fmt(mine[1])} | {fmt(ratios[1])} "
                    f"| {fmt(mine[2], 3)} | {fmt(ratios[2])} | {fmt(mine[3])} | {fmt(ratios[3])} "
                    f"| {fmt(over_tools)} | {verdict} |"
                )
    return "\n".join(lines)


def keys_tables(
    stats: dict[str, dict[str, ArmStats]],
    paired: dict[str, dict[str, float]],
    arms: list[str],
    stores: dict[str, KeyStoreFill],
) -> str:
    """The keys arms beside their reference arm (the key in the YAML): added p50 (plain and
    paired) and gateway CPU per request, each with the ratio keys / reference; then how each
    directory was filled and what a lookup on it costs outside kvgate."""
    lines = [
        "| case | arm | reference | added p50 ms | ref. | ratio | paired added p50 ms | ref. "
        "| ratio | gateway CPU ms/req | ref. | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, ref in KEYS_ARM_REFERENCES.items():
        if arm not in arms:
            continue
        if ref not in arms:
            ref = "kvgate"
        for case in stats:
            pair = paired.get(case, {})
            added, ref_added = _added(stats, case, arm), _added(stats, case, ref)
            pair_arm, pair_ref = pair.get(arm, math.nan), pair.get(ref, math.nan)
            cpu, ref_cpu = _cpu(stats, case, arm), _cpu(stats, case, ref)
            lines.append(
                f"| {case} | {arm} | {ref} | {fmt(added)} | {fmt(ref_added)} "
                f"| {fmt(_ratio(added, ref_added))} | {fmt(pair_arm)} | {fmt(pair_ref)} "
                f"| {fmt(_ratio(pair_arm, pair_ref))} | {fmt(cpu, 3)} | {fmt(ref_cpu, 3)} "
                f"| {fmt(_ratio(cpu, ref_cpu))} |"
            )
    lines += [
        "",
        "| arm | store | keys | fill s | store size MB | directory with | open ms "
        "| first lookup ms (median) | cached lookup ms | unknown key ms |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for arm, fill in stores.items():
        size = fmt(fill.size_bytes / 1e6, 0) if fill.size_bytes is not None else "n/a"
        for label, ms in fill.lookups.items():
            lines.append(
                f"| {arm} | {fill.store} | {fill.keys:,} | {fmt(fill.fill_s, 1)} | {size} "
                f"| {label} | {fmt(ms['open_ms'], 3)} | {fmt(ms['first_lookup_ms'], 3)} "
                f"| {fmt(ms['cached_lookup_ms'], 4)} | {fmt(ms['unknown_lookup_ms'], 3)} |"
            )
    return "\n".join(lines)


def targets_table(stats: dict[str, dict[str, ArmStats]], arms: list[str]) -> str:
    lines = [
        "| target | arm | measured | limit | met | margin |",
        "|---|---|---:|---:|---|---|",
    ]

    def added(case: str, arm: str) -> float:
        st = stats.get(case, {})
        if arm not in st or REFERENCE not in st:
            return math.nan
        return st[arm].p50 - st[REFERENCE].p50

    nan = math.nan
    for arm in (a for a in arms if a.startswith("kvgate")):
        one = stats.get("1k", {})
        cpu = one[arm].gateway_cpu_ms if arm in one else nan
        noop_cpu = one[NOOP].gateway_cpu_ms if NOOP in one else nan
        st = stats.get("stream", {})
        gap = st[arm].gap_p99 - st[REFERENCE].gap_p99 if arm in st and REFERENCE in st else nan
        long_k = LONG_HISTORY // 1000
        rows: list[tuple[str, float, float, str]] = [
            (
                "gateway CPU per 1k request <= 1.5 x noop",
                cpu / noop_cpu if noop_cpu else nan,
                TARGET_CPU_RATIO,
                "x",
            ),
            (
                "added p50, 1k <= noop added + 0.5 ms",
                added("1k", arm),
                added("1k", NOOP) + TARGET_1K_OVER_NOOP_MS,
                "ms",
            ),
            (
                f"added p50, conversation turns >= {long_k}k tokens <= noop added + 2 ms",
                added("conversation", arm),
                added("conversation", NOOP) + TARGET_CONV_OVER_NOOP_MS,
                "ms",
            ),
            ("added p50, 100k <= 25 ms", added("100k", arm), TARGET_100K_ADDED_MS, "ms"),
            ("stream: added gap p99 <= 0.5 ms", gap, TARGET_STREAM_GAP_P99_MS, "ms"),
        ]
        for case in (c for c in API_CASES if c in stats and case_api(c) in COMPARED_APIS):
            base = case_base(case)
            rows += [
                (
                    f"added p50, {case} <= 1.2 x {base}'s",
                    _ratio(_added(stats, case, arm), _added(stats, base, arm)),
                    TARGET_API_OVER_CHAT,
                    "x",
                ),
                (
                    f"gateway CPU per request, {case} <= 1.2 x {base}'s",
                    _ratio(_cpu(stats, case, arm), _cpu(stats, base, arm)),
                    TARGET_API_OVER_CHAT,
                    "x",
                ),
            ]
        for text, measured, limit, unit in rows:
            met, margin = _verdict(measured, limit, unit)
            lines.append(
                f"| {text} | {arm} | {fmt(measured)} {unit} | {fmt(limit)} {unit} "
                f"| {met} | {margin} |"
            )
    return "\n".join(lines)


def write_csv(out: Path, runs: list[CaseRun]) -> None:
    roles = ("kvgate", "extproc", "envoy", "redis")
    with (out / "interleaved.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "case",
                "iteration",
                "turn",
                "arm",
                "step",
                "status",
                "latency_ms",
                "prompt_tokens",
                "ttft_ms",
                "tokens",
                "error",
                *(f"{r}_cpu_ms" for r in roles),
            ]
        )
        for run in runs:
            for s in run.samples:
                w.writerow(
                    [
                        s.case,
                        s.iteration,
                        s.turn,
                        s.arm,
                        s.step,
                        s.status,
                        f"{s.latency_s * 1e3:.3f}",
                        s.prompt_tokens or "",
                        "" if math.isnan(s.ttft_s) else f"{s.ttft_s * 1e3:.3f}",
                        s.tokens or "",
                        s.error,
                        *(f"{s.cpu_s[r] * 1e3:.4f}" if r in s.cpu_s else "" for r in roles),
                    ]
                )
    with (out / "interleaved-gaps.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["case", "iteration", "arm", "gap_index", "gap_ms"])
        for run in runs:
            for s in run.samples:
                for i, gap in enumerate(s.gaps):
                    w.writerow([s.case, s.iteration, s.arm, i, f"{gap * 1e3:.3f}"])


# --------------------------------------------------------------------------- main


def parse_iterations(spec: str) -> dict[str, int]:
    out = dict(DEFAULT_ITERATIONS)
    for part in filter(None, spec.split(",")):
        if "=" in part:
            case, _, n = part.partition("=")
            if case not in CASES:
                raise ValueError(f"unknown case {case!r}")
            out[case] = int(n)
        else:  # a bare number: every case but 100k (each of those takes seconds)
            for case in CASES:
                if case != "100k":
                    out[case] = int(part)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=",".join(CHAT_CASES), help=f"subset of {','.join(CASES)}, or all"
    )
    parser.add_argument("--iterations", default="", help="N, or case=N,... (see the docstring)")
    parser.add_argument("--arms", default="envoy,noop,kvgate", help=",".join(ALLOWED_ARMS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kvgate-args", default="", help="extra `kvgate serve` arguments")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--directory-keys",
        type=int,
        default=DIRECTORY_KEYS,
        help="keys in the keys arms' directory (the client's among them)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded steps per case")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run every case alone (default: a case and its other-API variants interleaved)",
    )
    parser.add_argument(
        "--pause-ms", type=float, default=2.0, help="after each response, before the next send"
    )
    args = parser.parse_args(argv)

    cases = list(CASES) if args.cases == "all" else [c for c in args.cases.split(",") if c]
    arms = [a for a in args.arms.split(",") if a]
    if bad := (set(cases) - set(CASES)) | (set(arms) - set(ALLOWED_ARMS)):
        parser.error(f"unknown cases/arms: {sorted(bad)}")
    if REFERENCE not in arms:
        parser.error("the envoy arm is the reference and cannot be left out")
    try:
        iterations = parse_iterations(args.iterations)
    except ValueError as exc:
        parser.error(str(exc))

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out: Path = args.out or REPO_ROOT / "var" / "bench" / f"interleaved-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "-m", "bench.interleaved", *given])
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run

    stack = BenchStack(
        out / "stack",
        arms=tuple(arms),
        redis_url=args.redis_url,
        sim=SimSettings(ttft_ms=0.0, itl_ms=0.0),
        kvgate_args=tuple(shlex.split(args.kvgate_args)),
    )
    stack.directory_size = max(args.directory_keys, 1)
    bodies = Bodies(f"{os.getpid():x}{int(time.time()) % 100000:x}")
    runs: list[CaseRun] = []
    pause_s = args.pause_ms / 1e3
    started = time.time()
    try:
        print(f"starting the stack in {out / 'stack'} ...", flush=True)
        stack.start()
        for line in stack.describe():
            print("  " + line, flush=True)
        live = [a for a in arms if a in stack.arms]
        # Non-streamed cases first, while the simulator answers at once. A case and the same
        # case on the other APIs run together, interleaved (unless --sequential).
        groups: dict[str, list[str]] = {}
        for case in sorted(cases, key=lambda c: c == "stream"):
            groups.setdefault(case if args.sequential else case_base(case), []).append(case)
        for group in groups.values():
            if "stream" in group:
                stack.restart_sim(SimSettings(ttft_ms=0.0, itl_ms=STREAM_ITL_MS))
            stack.quiesce(timeout=15.0)
            long_case = case_base(group[0]) in ("conversation", "100k")
            warm = min(args.warmup, 1) if long_case else args.warmup
            todo = ", ".join(f"{c} {iterations[c]}" for c in group)
            print(f"[{time.time() - started:.0f}s] {todo} iterations x {live}", flush=True)
            group_runs = [CaseRun(case) for case in group]
            runs.extend(group_runs)
            runner(
                run_cases(
                    group_runs,
                    stack,
                    live,
                    [case_steps(c, bodies, iterations[c], warmup=False) for c in group],
                    [case_steps(c, bodies, warm, warmup=True) for c in group],
                    pause_s,
                )
            )
            for run in group_runs:
                fails = sum(not s.ok for s in run.samples)
                print(
                    f"  {run.name}: {len(run.samples)} requests in {run.wall_s:.1f}s, "
                    f"{fails} failed",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    finally:
        stack.stop()

    live = [a for a in arms if a in stack.arms]
    sections: list[str] = []
    stats: dict[str, dict[str, ArmStats]] = {}
    titles = {
        "1k": "1k: one ~1,000-token user message, unique prefix",
        "conversation": f"conversation: {TURNS} turns, a fresh conversation per iteration",
        "100k": "100k: one ~100,000-token user message",
        "stream": f"stream: {STREAM_TOKENS} tokens at {STREAM_ITL_MS:g} ms/token, "
        "one stream in flight",
    }
    api_names = {"messages": "Anthropic Messages", "responses": "OpenAI Responses"}
    for api in OTHER_APIS:
        where = f"`POST /v1/{api}` ({api_names[api]})"
        titles[f"1k-{api}"] = f"1k-{api}: one ~1,000-token user message on {where}"
        titles[f"conversation-{api}"] = (
            f"conversation-{api}: {TURNS} turns of an agent's conversation on {where}"
        )
    titles["1k-embeddings"] = (
        "1k-embeddings: the ~1,000-token text as one input of `POST /v1/embeddings` (nothing "
        "generated)"
    )
    titles["conversation-chat-tools"] = (
        f"conversation-chat-tools: the agent's conversation ({TURNS} turns) on chat completions "
        "(tool_calls, tool messages)"
    )
    chat_conversation = next((r for r in runs if r.name == "conversation"), None)
    chat_long = _long_turns(chat_conversation) if chat_conversation else None
    prompt_tokens: dict[str, float] = {}
    paired: dict[str, dict[str, float]] = {}
    for run in runs:
        measured = run.samples
        if case_base(run.name) == "conversation":
            long_turns = None if run.name == "conversation" else chat_long
            table, stats[run.name] = conversation_tables(run, live, long_turns)
            turns = long_turns if long_turns is not None else _long_turns(run)
            measured = [s for s in run.samples if s.turn in turns]
            counted = [s.prompt_tokens for s in measured if s.prompt_tokens]
            if counted:
                prompt_tokens[run.name] = float(np.median(counted))
        elif run.name == "stream":
            table, stats[run.name] = stream_table(run, live)
        else:
            table, stats[run.name] = latency_table(run, live, run.samples)
        paired[run.name] = {a: paired_added_p50(measured, a) for a in live if a != REFERENCE}
        tokens = [s.prompt_tokens for s in run.samples if s.prompt_tokens]
        size = f", prompt {int(np.median(tokens)):,} tokens (p50)" if tokens else ""
        with_ = f" (interleaved with {', '.join(run.together)})" if run.together else ""
        if tokens and run.name not in prompt_tokens:
            prompt_tokens[run.name] = float(np.median(tokens))
        sections.append(
            f"## {titles[run.name]}\n\n{iterations[run.name]} iterations, "
            f"{len(run.samples)} requests in {run.wall_s:.0f} s{with_}{size}.\n\n{table}\n"
        )
    if any(c in stats for c in API_CASES):
        order = (
            "Each API case ran interleaved with its chat case, step by step (the arms "
            "interleaved within each step), so the ratios are paired like the arms."
            if any(r.together for r in runs if r.name in API_CASES)
            else "The cases ran one after another (the arms interleaved within each), so a "
            "ratio to chat also carries any drift of the machine between cases."
        )
        sections.append(
            "## kvgate per API beside chat\n\n"
            "kvgate's added p50 (its p50 minus envoy's, same case) and its CPU per request on "
            "each API, beside chat's from the same run, and the ratio to chat's; the target "
            f"is a ratio <= {TARGET_API_OVER_CHAT:g} (at most 20 % above chat; cheaper "
            "meets it). conversation: the chat conversation's turns of "
            f">= {LONG_HISTORY:,} tokens on every API. {order} kvgate's CPU over the no-op "
            "server's in the same case is a second way to take out a drift of the machine. "
            "chat-tools: the Messages and Responses conversation (an agent's, with tool calls "
            "and tool output) sent as chat completions, the chat reference for the same "
            "request shape. A ratio of added p50s is n/a when either is <= 0 (below what the "
            "run resolves).\n\n"
            f"{api_table(stats, paired, prompt_tokens, live)}\n"
        )
    if any(a in KEYS_ARM_REFERENCES for a in live):
        sections.append(
            f"## API keys as data: the client's key one of {stack.directory_size:,} in the key "
            "directory, beside the key in the YAML\n\n"
            "Each keys arm is kvgate exactly as its reference arm (kvgate: memory state "
            "store, embedded SQLite key file; kvgate-redis: the Redis directory) except that "
            "the client's key is not in the YAML but one of the directory's keys; the "
            "reference's key is in the YAML (3 tenants' keys there). The warm-up sends the "
            "first request, so the measured ones find the key in kvgate's lookup cache; the "
            "generation poll (one store read per 0.25 s) runs throughout. Ratio: keys arm / "
            "reference (n/a when either is <= 0).\n\n"
            "The second table: the directory's store filled before kvgate started (one key "
            "through the directory's `create`, the rest written in bulk), and a directory "
            "opened on it in the bench process, with only that key and with all: open (start "
            "and the first generation read), the first lookup of stored keys, a cached lookup, "
            "an unknown key's.\n\n"
            f"{keys_tables(stats, paired, live, stack.key_stores)}\n"
        )
    skipped = "".join(f"\nSkipped arm {a}: {why}." for a, why in stack.skipped.items())
    dirty = " + uncommitted src/ changes" if git_output("status", "--porcelain", "src") else ""
    md = "\n".join(
        [
            "# kvgate interleaved benchmark\n",
            f"`{command}`\n",
            f"{dt.datetime.now().isoformat(timespec='seconds')}; "
            f"commit {git_output('rev-parse', '--short', 'HEAD')}"
            f"{dirty}; "
            f"{os.cpu_count()} CPUs; {time.time() - started:.0f} s. Arms {', '.join(live)}; "
            f"kvgate args `{args.kvgate_args}`.{skipped}\n",
            "One request in flight; arms interleaved request by request, the order rotated "
            "every step. Latency: send to the last byte at the client, ms. Added p50: the "
            "arm's p50 minus envoy's; paired: the median of per-step differences. CPU: the "
            "process's thread run time (schedstat) from the send until "
            f"{args.pause_ms:g} ms after the response, per request; whole-case: the "
            "/proc/<pid>/stat delta over the case / the arm's requests (idle included; n/a for "
            "cases run interleaved with others). "
            "Failed requests are left out of the latencies, not of the CPU.\n",
            *sections,
            "## Targets\n",
            "Added = arm p50 minus envoy p50 (stream: gap p99 minus envoy's gap p99).\n",
            targets_table(stats, live),
            "",
        ]
    )
    if runs:
        write_csv(out, runs)
    (out / "interleaved.md").write_text(md, encoding="utf-8")
    print(md)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
