"""Agent workloads on the two agent APIs kvgate meters besides chat, Anthropic Messages
(`POST /v1/messages`) and OpenAI Responses (`POST /v1/responses`), through the real Envoy
-> kvgate -> simulator stack, with the official `anthropic` and `openai` SDKs and a raw
HTTP client.

For each API:

- a 12-turn agent conversation (a long system prompt / instructions, four tools, every
  turn resending the whole history: the model's answers, its tool calls and their long
  outputs, then a new user message) that grows past 16,000 prompt tokens: on every turn
  the prompt kvgate counted and reserved is the engine's `input_tokens`, and at the end
  the tenant's ledger (and the model's line in it, and kvgate's token counters) is the sum
  of the engine's usage;
- a burst of concurrent long requests whose worst cases together exceed the backend's KV
  budget: kvgate admits what fits, refuses the rest with a 429 in the API's own shape
  (the SDK's RateLimitError), and the engine never preempts; the same burst sent straight
  to the engine does preempt;
- streams the client cuts at seeded random points: each is charged what
  docs/limits-and-billing.md ("What is charged when") says for a cut stream -- the prompt
  (the engine's count) plus the output kvgate saw streamed -- and nothing stays in flight.

Each test books to its own tenant, so its ledger holds exactly what the test sent.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_reset,
    sim_stats,
    wait_until,
)
from tests.e2e.agent_support import (
    SETTLE_TIMEOUT_S,
    TOOLS,
    CutStream,
    Served,
    access_entry,
    assert_nothing_in_flight,
    cut_stream,
    ledger,
    metered,
    prose,
    reservation,
    system_prompt,
    tool_call,
    tool_output,
    user_message,
    wait_ledger,
)

MODEL = DEFAULT_MODEL_NAME
BACKEND = DEFAULT_BACKEND
MAX_CONTEXT = 32_768  # kvgate's max_context and the engine's max_model_len
KV_BUDGET = 48_000  # kvgate's budget for the backend = the engine's 3,000 blocks x 16
KV_BLOCK = 16
SIM_BLOCKS = KV_BUDGET // KV_BLOCK

APIS = ("messages", "responses")
TENANTS = [f"{test}-{api}" for test in ("agent", "burst", "cut") for api in APIS]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[{"name": name, "api_key": f"sk-{name}"} for name in TENANTS],
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": MAX_CONTEXT,
                "default_max_new_tokens": 1024,
                "backend": BACKEND,
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": KV_BLOCK,
                "max_concurrent_requests": 256,
            }
        ],
        sim=SimOptions(num_gpu_blocks=SIM_BLOCKS, block_size=KV_BLOCK, max_model_len=MAX_CONTEXT),
    ) as running:
        yield running


def anthropic_sdk(stack: Stack, tenant: str) -> Anthropic:
    return Anthropic(
        base_url=stack.base_url, api_key=stack.api_key(tenant), max_retries=0, timeout=60.0
    )


def openai_sdk(stack: Stack, tenant: str) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=stack.api_key(tenant),
        max_retries=0,
        timeout=60.0,
    )


def assert_ledger_is_served(stack: Stack, tenant: str, served: Served) -> None:
    """The tenant's whole ledger, its line for the model and kvgate's token counters are
    exactly the engine's usage summed over what it served."""
    booked = wait_ledger(stack, tenant, MODEL, served.requests)
    assert booked == {"total": served.as_dict(), "model": served.as_dict()}, (booked, served)
    tokens = {"prompt_tokens": served.prompt_tokens, "output_tokens": served.output_tokens}
    assert metered(stack, tenant, MODEL) == tokens


# --------------------------------------------------------------------------- 1. conversations

TURNS = 12
TURN_MAX_NEW = 48
LATE_PROMPT_TOKENS = 16_000


@dataclass
class Turn:
    number: int
    streamed: bool
    kvgate: int  # the prompt kvgate counted (access log)
    engine: int  # the engine's usage.input_tokens
    reserved: int  # the KV kvgate reserved (access log)
    output: int  # the engine's usage.output_tokens


def check_turn(stack: Stack, turn: Turn, request_id: str) -> None:
    entry = access_entry(stack, request_id)
    turn.kvgate = int(entry["prompt_tokens"])
    turn.reserved = int(entry["reserved_tokens"])
    assert turn.kvgate == turn.engine, turn
    assert turn.reserved == reservation(turn.engine, TURN_MAX_NEW, KV_BLOCK), turn
    assert 0 < turn.output <= TURN_MAX_NEW, turn


def check_conversation(turns: list[Turn]) -> None:
    prompts = [t.engine for t in turns]
    assert len(turns) == TURNS
    assert prompts == sorted(prompts) and len(set(prompts)) == TURNS, prompts  # it grows
    assert prompts[-1] >= LATE_PROMPT_TOKENS, prompts
    assert prompts[-1] + TURN_MAX_NEW <= MAX_CONTEXT, prompts
    assert [t.kvgate for t in turns] == prompts
    print("turns (n, streamed, kvgate, engine, reserved, output):")
    for t in turns:
        print(
            f"  {t.number:2d} {t.streamed!s:5} {t.kvgate:6d} {t.engine:6d} {t.reserved:6d} "
            f"{t.output}"
        )


def test_messages_agent_conversation_counts_every_turn_as_the_engine(stack: Stack) -> None:
    tenant = "agent-messages"
    system = system_prompt()
    tools: list[Any] = [tool.anthropic() for tool in TOOLS]
    history: list[Any] = []
    turns: list[Turn] = []
    served = Served()
    with anthropic_sdk(stack, tenant) as client:
        for number in range(1, TURNS + 1):
            if number == 1:
                content: Any = user_message(number)
            else:
                content = [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{number - 1:02d}",
                        "content": [{"type": "text", "text": tool_output(number - 1)}],
                    },
                    {"type": "text", "text": user_message(number)},
                ]
            history.append({"role": "user", "content": content})
            request: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": TURN_MAX_NEW,
                "system": system,
                "tools": tools,
                "messages": list(history),
            }
            streamed = number % 2 == 0
            if streamed:
                with client.messages.stream(**request) as stream:
                    message = stream.get_final_message()
                    request_id = stream.response.headers["x-request-id"]
            else:
                raw = client.messages.with_raw_response.create(**request)
                message = raw.parse()
                request_id = raw.headers["x-request-id"]
            usage = message.usage
            turn = Turn(number, streamed, 0, usage.input_tokens, 0, usage.output_tokens)
            check_turn(stack, turn, request_id)
            turns.append(turn)
            served.add(usage.input_tokens, usage.output_tokens)
            # The agent keeps the model's answer and the tool call it acts on.
            reply = "".join(block.text for block in message.content if block.type == "text")
            assert reply
            name, args = tool_call(number)
            history.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": reply},
                        {
                            "type": "tool_use",
                            "id": f"toolu_{number:02d}",
                            "name": name,
                            "input": args,
                        },
                    ],
                }
            )
    check_conversation(turns)
    assert_ledger_is_served(stack, tenant, served)
    print(f"ledger {tenant}: {served.as_dict()}")
    assert_nothing_in_flight(stack)


def test_responses_agent_conversation_counts_every_turn_as_the_engine(stack: Stack) -> None:
    tenant = "agent-responses"
    instructions = system_prompt()
    tools: list[Any] = [tool.responses() for tool in TOOLS]
    items: list[Any] = []
    turns: list[Turn] = []
    served = Served()
    with openai_sdk(stack, tenant) as client:
        for number in range(1, TURNS + 1):
            if number > 1:
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": f"call_{number - 1:02d}",
                        "output": tool_output(number - 1),
                    }
                )
            items.append({"type": "message", "role": "user", "content": user_message(number)})
            request: dict[str, Any] = {
                "model": MODEL,
                "max_output_tokens": TURN_MAX_NEW,
                "instructions": instructions,
                "tools": tools,
                "input": list(items),
            }
            streamed = number % 2 == 0
            if streamed:
                raw_stream = client.responses.with_raw_response.create(**request, stream=True)
                request_id = raw_stream.headers["x-request-id"]
                events = list(raw_stream.parse())
                assert events[-1].type in ("response.completed", "response.incomplete")
                response = events[-1].response
            else:
                raw = client.responses.with_raw_response.create(**request)
                response = raw.parse()
                request_id = raw.headers["x-request-id"]
            usage = response.usage
            assert usage is not None
            turn = Turn(number, streamed, 0, usage.input_tokens, 0, usage.output_tokens)
            check_turn(stack, turn, request_id)
            turns.append(turn)
            served.add(usage.input_tokens, usage.output_tokens)
            # The agent resends the model's output items, then the call it acts on.
            assert response.output_text
            items += [item.model_dump(exclude_none=True) for item in response.output]
            name, args = tool_call(number)
            items.append(
                {
                    "type": "function_call",
                    "call_id": f"call_{number:02d}",
                    "name": name,
                    "arguments": json.dumps(args),
                }
            )
    check_conversation(turns)
    assert_ledger_is_served(stack, tenant, served)
    print(f"ledger {tenant}: {served.as_dict()}")
    assert_nothing_in_flight(stack)


# --------------------------------------------------------------------------- 2. KV burst

# Ten concurrent requests of a ~5,200-token prompt allowed 1,024 new tokens, which the
# engine is told to generate in full. Each reserves ~6,250 KV tokens: seven fit the
# 48,000-token budget, three do not (the test derives the numbers from the engine's
# count). The engine (3,000 blocks) admits nine of the ten prompts at once when it sees
# them all, and their growth then overflows its cache: it preempts. A 500 ms prefill makes
# sure every request arrives before any grows.
BURST = 10
BURST_MAX_NEW = 1024
BURST_WORDS = 5_200
BURST_HEADERS = {
    "x-sim-output-tokens": str(BURST_MAX_NEW),
    "x-sim-itl-ms": "2",
    "x-sim-ttft-ms": "500",
}


def burst_text(i: int) -> str:
    # Prompts of the same length: the same text after a different one-token word.
    tag = (
        "river",
        "mill",
        "road",
        "town",
        "market",
        "harvest",
        "weather",
        "water",
        "trees",
        "evening",
    )[i]
    return f"Summarise the notes on the {tag}.\n" + prose(BURST_WORDS, seed=7)


def burst_body(api: str, i: int) -> dict[str, Any]:
    if api == "messages":
        return {
            "model": MODEL,
            "max_tokens": BURST_MAX_NEW,
            "messages": [{"role": "user", "content": burst_text(i)}],
        }
    return {"model": MODEL, "max_output_tokens": BURST_MAX_NEW, "input": burst_text(i)}


@dataclass
class Outcome:
    request_id: str
    prompt: int = 0  # the engine's input_tokens (admitted)
    output: int = 0
    error: Any = None  # the SDK's RateLimitError (refused)


def send_burst_request(stack: Stack, api: str, i: int, start: threading.Barrier) -> Outcome:
    tenant = f"burst-{api}"
    body = burst_body(api, i)
    start.wait(timeout=30)
    if api == "messages":
        with anthropic_sdk(stack, tenant) as client:
            try:
                raw = client.messages.with_raw_response.create(**body, extra_headers=BURST_HEADERS)
            except anthropic.RateLimitError as refused:
                return Outcome(refused.response.headers["x-request-id"], error=refused)
            usage = raw.parse().usage
            return Outcome(raw.headers["x-request-id"], usage.input_tokens, usage.output_tokens)
    with openai_sdk(stack, tenant) as oclient:
        try:
            oraw = oclient.responses.with_raw_response.create(**body, extra_headers=BURST_HEADERS)
        except openai.RateLimitError as refused:
            return Outcome(refused.response.headers["x-request-id"], error=refused)
        ousage = oraw.parse().usage
        assert ousage is not None
        return Outcome(oraw.headers["x-request-id"], ousage.input_tokens, ousage.output_tokens)


def run_concurrently(call: Callable[[int, threading.Barrier], Any], n: int) -> list[Any]:
    """call(0..n-1, barrier) at once on n threads; their results in order."""
    start = threading.Barrier(n)
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(call, i, start) for i in range(n)]
        return [future.result(timeout=120) for future in futures]


def check_refusal(api: str, error: Any, reserve: int, fit: int) -> None:
    """A 429 in the API's own shape that names the KV kvgate reserves for the prompt the
    engine counts."""
    assert error.status_code == 429
    free = KV_BUDGET - fit * reserve
    if api == "messages":
        assert isinstance(error, anthropic.RateLimitError)
        body: Any = error.body
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        message = body["error"]["message"]
    else:
        assert isinstance(error, openai.RateLimitError)
        assert error.code == "kv_budget_exhausted", error.body
        message = error.message
    assert f"has {free} of {KV_BUDGET} KV tokens free" in message, message
    assert f"needs {reserve}" in message, message
    assert int(error.response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("api", APIS)
def test_a_kv_saturating_burst_is_admitted_as_far_as_it_fits_and_never_preempts(
    stack: Stack, api: str
) -> None:
    tenant = f"burst-{api}"
    before = kvgate_metrics(stack)
    sim_reset(stack)
    outcomes: list[Outcome] = run_concurrently(
        lambda i, start: send_burst_request(stack, api, i, start), BURST
    )
    admitted = [o for o in outcomes if o.error is None]
    refused = [o for o in outcomes if o.error is not None]
    assert admitted and refused, outcomes

    # Every prompt is the same length by the engine's count; what one reserves follows.
    prompts = {o.prompt for o in admitted}
    assert len(prompts) == 1, prompts
    prompt = prompts.pop()
    reserve = reservation(prompt, BURST_MAX_NEW, KV_BLOCK)
    fit = KV_BUDGET // reserve
    assert BURST * reserve > KV_BUDGET  # the burst's worst case exceeds the budget
    assert (len(admitted), len(refused)) == (fit, BURST - fit), (prompt, reserve)
    for outcome in admitted:
        entry = access_entry(stack, outcome.request_id)
        assert (int(entry["prompt_tokens"]), int(entry["reserved_tokens"])) == (prompt, reserve)
        assert outcome.output == BURST_MAX_NEW
    for outcome in refused:
        check_refusal(api, outcome.error, reserve, fit)

    stats = sim_stats(stack)
    assert stats["preemptions"] == 0, stats
    assert stats["peak_kv_tokens_used"] <= KV_BUDGET, stats
    assert stats["peak_running"] == fit, stats  # the admitted ones really overlapped
    assert len(stats["served"]) == fit
    assert all(s["preemptions"] == 0 and s["finished"] for s in stats["served"])

    assert_nothing_in_flight(stack)
    after = kvgate_metrics(stack)
    rejected = {"outcome": "rejected", "reason": "kv_budget_exhausted"}
    assert after.value("kvgate_requests_total", **rejected) - before.value(
        "kvgate_requests_total", **rejected
    ) == len(refused)
    served = Served()
    for outcome in admitted:
        served.add(outcome.prompt, outcome.output)
    assert_ledger_is_served(stack, tenant, served)
    print(
        f"{api}: prompt {prompt}, reserve {reserve}, admitted {len(admitted)}, refused "
        f"{len(refused)}, preemptions {stats['preemptions']}, peak KV "
        f"{stats['peak_kv_tokens_used']}, ledger {served.as_dict()}"
    )

    # The control: the same burst straight to the engine, which admits what its cache
    # holds now and preempts when the answers grow.
    sim_reset(stack)
    path = "/v1/messages" if api == "messages" else "/v1/responses"

    def direct(i: int, start: threading.Barrier) -> int:
        start.wait(timeout=30)
        resp = httpx.post(
            stack.sim_url + path, json=burst_body(api, i), headers=BURST_HEADERS, timeout=120
        )
        return resp.status_code

    statuses = run_concurrently(direct, BURST)
    assert statuses == [200] * BURST
    control = sim_stats(stack)
    assert control["preemptions"] > 0, control
    print(f"{api}: without kvgate, {control['preemptions']} preemptions")


# --------------------------------------------------------------------------- 3. cut streams


@dataclass(frozen=True)
class Api:
    path: str
    content_event: str  # one per engine output (x-sim-chunk-tokens 1: one token)
    usage_events: tuple[str, ...]  # the events that bring the engine's usage

    def body(self, number: int) -> dict[str, Any]:
        """A streamed agent turn: a system prompt, tools, a tool call and its output."""
        name, args = tool_call(number)
        if self.path == "/v1/messages":
            return {
                "model": MODEL,
                "max_tokens": 512,
                "stream": True,
                "system": system_prompt(600),
                "tools": [tool.anthropic() for tool in TOOLS],
                "messages": [
                    {"role": "user", "content": user_message(number)},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_1", "name": name, "input": args}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": tool_output(number, words=300),
                            },
                            {"type": "text", "text": user_message(number + 1)},
                        ],
                    },
                ],
            }
        return {
            "model": MODEL,
            "max_output_tokens": 512,
            "stream": True,
            "instructions": system_prompt(600),
            "tools": [tool.responses() for tool in TOOLS],
            "input": [
                {"role": "user", "content": user_message(number)},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": name,
                    "arguments": json.dumps(args),
                },
                {
                    "type": "function_call_output",
                    "call_id": "call_1",
                    "output": tool_output(number, words=300),
                },
                {"role": "user", "content": user_message(number + 1)},
            ],
        }

    def headers(self, stack: Stack, tenant: str) -> dict[str, str]:
        if self.path == "/v1/messages":
            return {"x-api-key": stack.api_key(tenant), "anthropic-version": "2023-06-01"}
        return {"authorization": f"Bearer {stack.api_key(tenant)}"}


CUT_APIS = {
    "messages": Api("/v1/messages", "content_block_delta", ("message_delta", "message_stop")),
    "responses": Api(
        "/v1/responses",
        "response.output_text.delta",
        ("response.completed", "response.incomplete"),
    ),
}
CUTS = 9
CUT_SEED = 20_250_611
LIVE_ITL_MS = 40  # a live stream: the client leaves while the engine is generating


@dataclass
class Cut:
    kind: str  # stall-K, events-N or bytes-B
    received: int  # content events (= tokens) the client read
    prompt: int  # the engine's count of the prompt
    sent: int  # tokens the engine wrote
    charged: dict[str, int]  # the ledger's change


def settled_record(stack: Stack) -> dict[str, Any]:
    """The engine's record of the one request it served since the last reset."""
    stats = wait_until(
        lambda: sim_stats(stack), lambda s: len(s["served"]) == 1, timeout=SETTLE_TIMEOUT_S
    )
    assert len(stats["served"]) == 1, stats["served"]
    record: dict[str, Any] = stats["served"][0]
    return record


@pytest.mark.parametrize("api", APIS)
def test_cut_streams_are_charged_as_the_billing_rule_says(stack: Stack, api: str) -> None:
    spec = CUT_APIS[api]
    tenant = f"cut-{api}"
    rng = random.Random(f"{CUT_SEED}-{api}")
    before = kvgate_metrics(stack)
    cuts: list[Cut] = []
    for number in range(CUTS):
        booked = ledger(stack, tenant, MODEL)["total"]
        sim_reset(stack)
        body = spec.body(number)
        headers = spec.headers(stack, tenant)
        kind = ("stall", "events", "bytes")[number % 3]
        if kind == "stall":
            # The engine writes K tokens and hangs; the client reads all K and leaves.
            k = 0 if number == 0 else rng.randint(1, 24)  # the first: headers only
            headers |= {"x-sim-output-tokens": "64", "x-sim-stall-after": str(k)}
            cut: CutStream = cut_stream(
                stack, spec.path, body, headers, events=(spec.content_event, k)
            )
            label = f"stall-{k}"
        else:
            headers |= {"x-sim-output-tokens": "200", "x-sim-itl-ms": str(LIVE_ITL_MS)}
            if kind == "events":
                # The client reads N pieces of text and leaves mid-answer.
                n = rng.randint(1, 30)
                cut = cut_stream(stack, spec.path, body, headers, events=(spec.content_event, n))
                label = f"events-{n}"
            else:
                # The client reads B bytes past the first piece of text (the events that
                # open an answer differ in size between the APIs) and leaves there.
                b = rng.randint(0, 5_000)
                cut = cut_stream(
                    stack, spec.path, body, headers, events=(spec.content_event, 1), more_bytes=b
                )
                label = f"bytes-{b}"
        assert cut.status == 200, cut.raw
        # The usage never reached the client: the stream really was cut.
        assert not any(cut.count(name) for name in spec.usage_events), (label, cut.events)
        received = cut.count(spec.content_event)

        record = settled_record(stack)
        assert record["aborted"] and not record["finished"], record
        now = wait_until(
            lambda: ledger(stack, tenant, MODEL)["total"],
            lambda t, b=booked: t["requests"] == b["requests"] + 1,  # type: ignore[misc]
            timeout=SETTLE_TIMEOUT_S,
        )
        charged = {key: now[key] - booked[key] for key in now}
        cuts.append(
            Cut(label, received, record["prompt_tokens"], record["completion_tokens_sent"], charged)
        )

        # The rule for a stream cut after the backend's 2xx headers: the prompt (the
        # engine did the prefill) and the output kvgate saw, at least what the client
        # read, at most what the engine wrote and one chunk more than the client read.
        assert charged["requests"] == 1, cuts[-1]
        assert charged["prompt_tokens"] == record["prompt_tokens"], cuts[-1]
        if kind == "stall":
            assert received == k == record["completion_tokens_sent"], cuts[-1]
            assert charged["output_tokens"] == k, cuts[-1]
        else:
            sent = record["completion_tokens_sent"]
            assert sent < 200, cuts[-1]
            assert received <= charged["output_tokens"] <= min(sent, received + 1), cuts[-1]
        assert_nothing_in_flight(stack)

    print(f"{api} cuts (kind, client read, engine prompt, engine sent, charged):")
    for c in cuts:
        print(f"  {c.kind:12s} {c.received:3d} {c.prompt:5d} {c.sent:3d} {c.charged}")
    assert any(c.charged["output_tokens"] == 0 for c in cuts)  # a cut before any text
    assert any(c.charged["output_tokens"] > 0 for c in cuts)

    after = kvgate_metrics(stack)
    cause = {"backend": BACKEND, "cause": "disconnected"}
    assert (
        after.value("kvgate_settlements_total", **cause)
        - before.value("kvgate_settlements_total", **cause)
        == CUTS
    )
    name = "kvgate_stream_disconnects_total"
    assert after.total(name) - before.total(name) == CUTS
    served = Served()
    for c in cuts:
        served.add(c.charged["prompt_tokens"], c.charged["output_tokens"])
    assert_ledger_is_served(stack, tenant, served)
    assert_nothing_in_flight(stack)
