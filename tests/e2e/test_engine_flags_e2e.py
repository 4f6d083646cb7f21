"""Engine flags (``models[].engine_flags``) through the real Envoy, with the official SDK.

Two simulators run with the same vLLM server flags: ``--chat-template`` holding Qwen3's real
template (from the llama.cpp sources) in place of the Qwen2.5 directory's own,
``--default-chat-template-kwargs '{"enable_thinking": false}'``,
``--reasoning-effort-map '{"low": "none"}'`` and ``--exclude-tools-when-tool-choice-none``.
kvgate counts the model of one with the matching ``engine_flags`` and the model of the other
with none. The first count equals the engine's ``usage.prompt_tokens`` on every request (and
so do the reservation, the ledger and the comparison metrics); the second is the directory
template's count, and differs from the engine's on every request a flag shapes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvgate.openai import parse_request
from kvgate.tokenize import load_counter
from kvgate.tokenize.counter import CountingApi
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    MetricSamples,
    SimOptions,
    Stack,
    kvgate_metrics,
    sdk_stream_text,
    tenant_totals,
    wait_until,
)
from testbed.hf_templates import TemplatesUnavailable, llama_cpp_templates

FLAGGED = "qwen3-flagged"  # counted with the engine's flags
PLAIN = "qwen3-unflagged"  # the same engine flags, none in kvgate
BACKENDS = {FLAGGED: "vllm-flagged", PLAIN: "vllm-unflagged"}
KV_BLOCK = 16
MAX_TOKENS = 8
CHAT = "/v1/chat/completions"
HIST = "kvgate_prompt_count_error_tokens"
MISMATCHES = "kvgate_prompt_count_mismatches_total"

# The server flags other than the template (the same values on both sides of the check).
SERVER_FLAGS: dict[str, Any] = {
    "default_chat_template_kwargs": {"enable_thinking": False},
    "reasoning_effort_map": {"low": "none"},
    "exclude_tools_when_tool_choice_none": True,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "string"}},
                "required": ["order"],
            },
        },
    }
]
ASK = [
    {"role": "system", "content": "You are a support agent. Answer in one line."},
    {"role": "user", "content": "Where is order 4417? It left the mill on Monday."},
]
TOOL_TURNS = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "lookup_order", "arguments": '{"order": "4417"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": '{"status": "shipped"}'},
]
# Each case: the SDK's own arguments, plus `extra_body` for vLLM's fields.
CASES: dict[str, dict[str, Any]] = {
    # enable_thinking false by default: the empty think block after the generation prompt.
    "plain": {"messages": ASK},
    # tool_choice "none": no tools in the prompt.
    "tools-choice-none": {"messages": ASK, "tools": TOOLS, "tool_choice": "none"},
    "tool-turns-choice-none": {"messages": TOOL_TURNS, "tools": TOOLS, "tool_choice": "none"},
    # Tools with tool_choice "auto" (the default): rendered.
    "tools-choice-auto": {"messages": ASK, "tools": TOOLS},
    # "low" maps to "none": enable_thinking false, where "low" alone would switch it on.
    "effort-low": {"messages": ASK, "reasoning_effort": "low"},
    # The request's own keyword wins over the server's default: with a system message, the
    # ChatML both templates write, which no flag changes.
    "thinking-on": {
        "messages": ASK,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    },
    # Without one, Qwen2.5's template adds its default system prompt and Qwen3's does not.
    "no-system-thinking-on": {
        "messages": ASK[1:],
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    },
    # Named as null: the effort does not switch thinking on, the server's default decides.
    "thinking-null-effort-high": {
        "messages": ASK,
        "reasoning_effort": "high",
        "extra_body": {"chat_template_kwargs": {"enable_thinking": None}},
    },
}


@dataclass(frozen=True)
class Row:
    case: str
    stream: bool
    engine: int  # the engine's usage.prompt_tokens
    kvgate: int  # kvgate's count (Envoy's access log)
    reserved: int  # KV tokens kvgate reserved


@dataclass(frozen=True)
class Outcome:
    rows: list[Row]
    mismatches: float
    # The count error's histogram (kvgate's count minus the engine's): observations at or
    # below each bucket's bound.
    error_buckets: dict[float, float]
    billed_prompt_tokens: int
    billed_requests: int


@pytest.fixture(scope="module")
def qwen3_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's real chat template as a file, the form ``--chat-template`` is usually given."""
    try:
        source = llama_cpp_templates()["Qwen-Qwen3-0.6B"]
    except TemplatesUnavailable as exc:
        pytest.skip(f"real chat templates unavailable: {exc}")
    path = tmp_path_factory.mktemp("templates") / "qwen3.jinja"
    path.write_text(source, encoding="utf-8")
    return path


def _model(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "tokenizer": str(demo_model_dir()),
        "max_context": 32768,
        "default_max_new_tokens": 1024,
        "backend": BACKENDS[name],
        **fields,
    }


@pytest.fixture(scope="module")
def stack(qwen3_template: Path) -> Iterator[Stack]:
    template = str(qwen3_template)
    models = [
        _model(FLAGGED, engine_flags={"chat_template": template, **SERVER_FLAGS}),
        _model(PLAIN),
    ]
    backends = [
        {
            "name": backend,
            "kv_budget_tokens": 48000,
            "kv_block_size": KV_BLOCK,
            "max_concurrent_requests": 64,
        }
        for backend in BACKENDS.values()
    ]
    # Both simulators get the same flags (one simulator per backend).
    sim = SimOptions(chat_template=template, **SERVER_FLAGS)
    with Stack(models=models, backends=backends, sim=sim) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=stack.base_url + "/v1", api_key=stack.api_key(), max_retries=0, timeout=30.0
    ) as sdk:
        yield sdk


def _send(client: OpenAI, model: str, case: dict[str, Any], stream: bool) -> tuple[str, int]:
    """(x-request-id, the engine's usage.prompt_tokens) of one chat through the SDK."""
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **case,
        )
        _, usage = sdk_stream_text(raw.parse())
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=MAX_TOKENS, **case
        )
        usage = raw.parse().usage
    assert usage is not None
    assert usage.completion_tokens == MAX_TOKENS, usage
    return raw.headers["x-request-id"], int(usage.prompt_tokens)


def _access_entry(stack: Stack, rid: str) -> dict[str, Any]:
    return stack.wait_access_log(lambda e: e["request_id"] == rid)


def _run(stack: Stack, client: OpenAI, model: str) -> Outcome:
    """Every case, non-streamed and streamed, against `model`; what kvgate made of them."""
    metrics_before = kvgate_metrics(stack)
    ledger_before = tenant_totals(stack)
    sent = [
        (name, stream, *_send(client, model, case, stream))
        for name, case in CASES.items()
        for stream in (False, True)
    ]
    rows = []
    for name, stream, rid, engine in sent:
        entry = _access_entry(stack, rid)
        rows.append(
            Row(name, stream, engine, int(entry["prompt_tokens"]), int(entry["reserved_tokens"]))
        )
    billed = sum(row.engine for row in rows)
    ledger = wait_until(
        lambda: tenant_totals(stack),
        lambda now: now["prompt_tokens"] - ledger_before["prompt_tokens"] >= billed,
        timeout=15,
    )
    after = kvgate_metrics(stack)
    before_buckets = _error_buckets(metrics_before, model)
    return Outcome(
        rows=rows,
        mismatches=after.value(MISMATCHES, model=model)
        - metrics_before.value(MISMATCHES, model=model),
        error_buckets={
            le: count - before_buckets.get(le, 0.0)
            for le, count in _error_buckets(after, model).items()
        },
        billed_prompt_tokens=ledger["prompt_tokens"] - ledger_before["prompt_tokens"],
        billed_requests=ledger["requests"] - ledger_before["requests"],
    )


def _error_buckets(metrics: MetricSamples, model: str) -> dict[float, float]:
    """The count error histogram's cumulative buckets for `model` (it has no _sum: its
    buckets go below zero)."""
    found: dict[float, float] = {}
    for (name, labels), value in metrics.samples.items():
        tags = dict(labels)
        if name == f"{HIST}_bucket" and tags.get("model") == model:
            found[float(tags["le"])] = value
    return found


def _expected_buckets(rows: list[Row], bounds: Iterable[float]) -> dict[float, float]:
    return {le: float(sum(row.kvgate - row.engine <= le for row in rows)) for le in bounds}


def _table(model: str, rows: list[Row]) -> str:
    lines = [f"{model}: case, stream, kvgate, engine"]
    lines += [f"  {r.case:26} {r.stream!s:5} {r.kvgate:4} {r.engine:4}" for r in rows]
    return "\n".join(lines)


def _directory_count(counter: CountingApi, model: str, case: dict[str, Any]) -> int:
    """kvgate's in-process count of a case with no engine flags: the directory's template."""
    fields = {k: v for k, v in case.items() if k != "extra_body"}
    body = {"model": model, "max_tokens": MAX_TOKENS, **fields, **case.get("extra_body", {})}
    request = parse_request(CHAT, json.dumps(body).encode())
    assert request.messages is not None
    return counter.count_chat(
        request.messages,
        request.tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs,
    )


def test_matching_flags_count_the_prompt_the_engine_renders(stack: Stack, client: OpenAI) -> None:
    outcome = _run(stack, client, FLAGGED)
    print("\n" + _table(FLAGGED, outcome.rows))
    differing = [row for row in outcome.rows if row.kvgate != row.engine]
    assert not differing, _table(FLAGGED, differing)
    # Reserved at the engine's prompt plus the output, in whole KV blocks.
    for row in outcome.rows:
        assert row.reserved == math.ceil((row.engine + MAX_TOKENS) / KV_BLOCK) * KV_BLOCK, row
    n = len(outcome.rows)
    assert outcome.mismatches == 0
    # Every error observed, each exactly 0: none at or below -0.5, all at or below 0.5.
    assert outcome.error_buckets[-0.5] == 0
    assert outcome.error_buckets[0.5] == outcome.error_buckets[math.inf] == n
    assert outcome.billed_requests == n
    assert outcome.billed_prompt_tokens == sum(row.kvgate for row in outcome.rows)
    # The flags are at work on the engine: thinking off by default adds its empty block,
    # which the request's own switch removes (and a switch named as null does not); the map
    # turns "low" into "none", thinking off; tool_choice "none" leaves the tools out; Qwen3's
    # template, unlike the directory's, adds no default system prompt.
    engine = {(row.case, row.stream): row.engine for row in outcome.rows}
    for stream in (False, True):
        assert engine["plain", stream] > engine["thinking-on", stream]
        assert engine["no-system-thinking-on", stream] < engine["thinking-on", stream]
        assert engine["effort-low", stream] == engine["plain", stream]
        assert engine["thinking-null-effort-high", stream] == engine["plain", stream]
        assert engine["tools-choice-none", stream] == engine["plain", stream]
        assert engine["tools-choice-auto", stream] > engine["plain", stream]


def test_without_the_flags_the_counts_differ_from_the_engine(stack: Stack, client: OpenAI) -> None:
    """The same engine flags, none in kvgate: kvgate counts the directory's (Qwen2.5)
    template with vLLM's defaults, and every request that a flag shapes is counted off;
    only the one no flag changes is counted right."""
    counter = load_counter(demo_model_dir(), name=PLAIN)
    outcome = _run(stack, client, PLAIN)
    print("\n" + _table(PLAIN, outcome.rows))
    for row in outcome.rows:
        assert row.kvgate == _directory_count(counter, PLAIN, CASES[row.case]), row
    untouched = [row for row in outcome.rows if row.case == "thinking-on"]
    assert untouched and all(row.kvgate == row.engine for row in untouched), untouched
    off = [row for row in outcome.rows if row.case != "thinking-on"]
    same = [row for row in off if row.kvgate == row.engine]
    assert not same, _table(PLAIN, same)
    assert outcome.mismatches == len(off)
    # Each request's error observed where it falls.
    assert outcome.error_buckets[math.inf] == len(outcome.rows)
    assert outcome.error_buckets == _expected_buckets(outcome.rows, outcome.error_buckets)
    # The bill is the engine's usage either way; only the count (the reservation) is wrong.
    assert outcome.billed_prompt_tokens == sum(row.engine for row in outcome.rows)
