"""Large answers are booked exactly, end to end.

client -> real Envoy -> kvgate -> the vLLM simulator. Logprobs (`top_logprobs: 20`), `n`
and `echo` let any client make an answer as large as it likes: a non-streamed body over
Envoy's 8 MiB buffer, or SSE events of several MiB each. Before, kvgate dropped such a body
(booking 0 output tokens) and its stream filter gave up on a 4 MiB event (losing usage and
leaking the injected usage event to a client that had not asked for it). Here the ledger
must equal what the client received (non-streamed) or what the simulator served (streamed),
and a usage event the client did not ask for must never reach it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_API_KEY,
    DEMO_TENANT,
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_stats,
    tenant_totals,
    wait_until,
)

MODEL = DEFAULT_MODEL_NAME
BACKEND = DEFAULT_BACKEND
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# n=4 x 2,000 tokens + a short prompt, and an 8,000-token echoed prompt + 600: both fit a
# 48,000-token budget on a simulator with the same cache, one request at a time.
KV_BUDGET = 48_000
CONTEXT = 32_768
MIB = 1 << 20
HTTP_TIMEOUT = httpx.Timeout(120.0, connect=5.0)
SETTLE_S = 15.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[{"name": DEMO_TENANT, "api_key": DEMO_API_KEY}],
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": CONTEXT,
                "default_max_new_tokens": 256,
                "backend": BACKEND,
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": 16,
                "max_concurrent_requests": 64,
            }
        ],
        sim=SimOptions(num_gpu_blocks=KV_BUDGET // 16, block_size=16, max_model_len=CONTEXT),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(demo_model_dir())


# --------------------------------------------------------------------------- helpers


def ledger(stack: Stack) -> dict[str, int]:
    return tenant_totals(stack, DEMO_TENANT)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


def wait_ledger(stack: Stack, before: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    """The ledger's change since `before`, once it equals `expected` (or as it is after
    SETTLE_S, for the caller's assertion to show)."""
    return wait_until(
        lambda: delta(before, ledger(stack)), lambda d: d == expected, timeout=SETTLE_S
    )


def kv_in_flight(stack: Stack) -> float:
    return kvgate_metrics(stack).value("kvgate_kv_tokens_in_flight", backend=BACKEND)


def wait_idle(stack: Stack) -> None:
    left = wait_until(lambda: kv_in_flight(stack), lambda v: v == 0, timeout=SETTLE_S)
    assert left == 0, f"kvgate still holds {left} KV tokens"


def served(stack: Stack, request_id: str) -> dict[str, int]:
    """What the simulator's engine served for one HTTP request (all its sequences), as a
    ledger entry: its records' ids carry the x-request-id (plus `-<choice>` when n > 1)."""

    def probe() -> list[dict[str, Any]]:
        return [r for r in sim_stats(stack)["served"] if request_id in str(r["id"])]

    records = wait_until(probe, lambda rs: bool(rs), timeout=SETTLE_S)
    assert records, f"the simulator served nothing for {request_id}"
    assert all(r["finished"] and not r["aborted"] for r in records), records
    prompt = {r["prompt_tokens"] for r in records}
    assert len(prompt) == 1, records  # one prompt, fanned out n times
    return {
        "requests": 1,
        "prompt_tokens": prompt.pop(),  # vLLM bills a shared prompt once
        "output_tokens": sum(r["completion_tokens_generated"] for r in records),
    }


@dataclass
class StreamRead:
    status: int
    total_bytes: int
    events: list[str] = field(default_factory=list)  # data payloads, in order

    @property
    def largest_event(self) -> int:
        return max(len(e) for e in self.events)

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def usage_events(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks() if c.get("usage")]


def stream(stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str]) -> StreamRead:
    all_headers = {"authorization": f"Bearer {DEMO_API_KEY}", **headers}
    with (
        httpx.Client(timeout=HTTP_TIMEOUT) as client,
        client.stream("POST", stack.base_url + path, json=body, headers=all_headers) as resp,
    ):
        raw = resp.read()
    text = raw.decode()
    assert resp.status_code == 200, text[:2000]
    assert text.endswith("\n\n"), f"the stream was cut: ...{text[-300:]!r}"
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block[:300]
        events.append(block[len("data: ") :])
    return StreamRead(resp.status_code, len(raw), events)


def chat_stream_body(*, include_usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write down every word you know."}],
        "max_tokens": 6000,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


ECHO_PROMPT = [11, 12, 13, 14] * 3000  # 12,000 prompt tokens, echoed with 20 logprobs each


def echo_stream_body(*, include_usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": ECHO_PROMPT,
        "max_tokens": 600,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 20,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def check_chat_stream(read: StreamRead, counter: PromptCounter, served_output: int) -> None:
    """Intact: role chunk, content and logprobs of every token served, finish, [DONE]."""
    assert read.events[-1] == "[DONE]"
    content: list[str] = []
    logprob_tokens: list[str] = []
    finish = None
    for chunk in read.chunks():
        if not chunk["choices"]:
            continue  # the usage chunk
        [choice] = chunk["choices"]
        content.append(choice["delta"].get("content") or "")
        if choice.get("logprobs"):
            for entry in choice["logprobs"]["content"]:
                assert len(entry["top_logprobs"]) == 20
                logprob_tokens.append(entry["token"])
        finish = choice.get("finish_reason") or finish
    assert finish == "length"
    text = "".join(content)
    assert len(logprob_tokens) == served_output
    assert text == "".join(logprob_tokens)
    assert counter.count_text(text) == served_output


def check_echo_stream(read: StreamRead, served: dict[str, int]) -> None:
    assert read.events[-1] == "[DONE]"
    tokens = 0
    finish = None
    for chunk in read.chunks():
        if not chunk["choices"]:
            continue
        [choice] = chunk["choices"]
        tokens += len(choice["logprobs"]["tokens"])
        finish = choice.get("finish_reason") or finish
    assert finish == "length"
    # The echoed prompt, then every generated token, each with its logprobs.
    assert tokens == served["prompt_tokens"] + served["output_tokens"]


# --------------------------------------------------------------------------- (a) JSON body


def test_non_streamed_answer_over_8_mib_is_booked_exactly(stack: Stack) -> None:
    """~11 MiB of JSON (n=4 x 2,000 tokens x 20 logprobs): the ledger equals the usage
    the client received. Before: the body overflowed the 8 MiB buffer and booked 0."""
    wait_idle(stack)
    before = ledger(stack)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me everything, four times."}],
        "n": 4,
        "max_tokens": 2000,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    resp = httpx.post(
        stack.base_url + CHAT,
        json=body,
        headers={"authorization": f"Bearer {DEMO_API_KEY}", "x-request-id": "large-json"},
        timeout=HTTP_TIMEOUT,
    )
    assert resp.status_code == 200, resp.text[:2000]
    assert len(resp.content) > 8 * MIB, len(resp.content)
    answer = resp.json()
    assert len(answer["choices"]) == 4
    usage = answer["usage"]
    assert usage["completion_tokens"] == 4 * 2000
    expected = {
        "requests": 1,
        "prompt_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
    }
    got = wait_ledger(stack, before, expected)
    assert got == expected
    assert got["output_tokens"] != 0
    assert served(stack, "large-json") == expected
    wait_idle(stack)


# --------------------------------------------------------------------------- (b), (c) SSE


@pytest.mark.parametrize("include_usage", [False, True], ids=["usage-injected", "usage-asked"])
def test_stream_with_multi_mib_events_is_booked_exactly(
    stack: Stack, counter: PromptCounter, include_usage: bool
) -> None:
    """Chat, 6,000 tokens with 20 logprobs each, 4,000 tokens per SSE event: a ~5.7 MiB
    event then a ~2.8 MiB one. Without include_usage the client sees no usage event (kvgate
    injected it and must strip it) and an intact stream; with it, the usage event equals the
    ledger. Either way the ledger equals what the simulator served."""
    wait_idle(stack)
    before = ledger(stack)
    rid = f"large-chat-stream-{'asked' if include_usage else 'injected'}"
    read = stream(
        stack,
        CHAT,
        chat_stream_body(include_usage=include_usage),
        {"x-request-id": rid, "x-sim-chunk-tokens": "4000"},
    )
    assert read.largest_event > 4 * MIB, read.largest_event
    truth = served(stack, rid)
    assert truth["output_tokens"] == 6000
    check_chat_stream(read, counter, truth["output_tokens"])
    usage_events = read.usage_events()
    if not include_usage:
        assert usage_events == [], "the injected usage event reached the client"
    got = wait_ledger(stack, before, truth)
    assert got == truth
    if include_usage:
        [event] = usage_events
        usage = event["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            got["prompt_tokens"],
            got["output_tokens"],
        )
        assert read.events[-2] == json.dumps(event, separators=(",", ":"))
    else:
        assert usage_events == [], "the injected usage event reached the client"
        assert all("usage" not in chunk for chunk in read.chunks())
    wait_idle(stack)


@pytest.mark.parametrize("include_usage", [False, True], ids=["usage-injected", "usage-asked"])
def test_echo_stream_with_a_multi_mib_first_event_is_booked_exactly(
    stack: Stack, include_usage: bool
) -> None:
    """Completions, a 12,000-token prompt echoed with 20 logprobs: a ~6.5 MiB first event."""
    wait_idle(stack)
    before = ledger(stack)
    rid = f"large-echo-stream-{'asked' if include_usage else 'injected'}"
    read = stream(
        stack,
        COMPLETIONS,
        echo_stream_body(include_usage=include_usage),
        {"x-request-id": rid},
    )
    assert read.largest_event > 4 * MIB, read.largest_event
    truth = served(stack, rid)
    assert truth == {"requests": 1, "prompt_tokens": len(ECHO_PROMPT), "output_tokens": 600}
    check_echo_stream(read, truth)
    usage_events = read.usage_events()
    if not include_usage:
        assert usage_events == [], "the injected usage event reached the client"
    got = wait_ledger(stack, before, truth)
    assert got == truth
    if include_usage:
        [event] = usage_events
        usage = event["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            got["prompt_tokens"],
            got["output_tokens"],
        )
    else:
        # Completion chunks carry "usage": null on every chunk (vLLM's wire format); the
        # extra final usage chunk (empty choices) must not reach the client.
        assert usage_events == [], "the injected usage event reached the client"
        assert all(chunk["choices"] for chunk in read.chunks())
    wait_idle(stack)
