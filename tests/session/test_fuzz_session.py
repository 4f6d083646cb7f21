"""Property-based fuzzing of the per-stream state machine (Hypothesis).

Each example plays one to three interleaved ext_proc streams against one running kvgate,
straight into StreamSession as the servicer would (no gRPC in between, for speed): random
values of every header and body field kvgate reads, random Envoy message orders (headers
only, the body twice, the answer before the request body, trailers, end_of_stream flags)
and the stream's end (close(): client gone, or kvgate shutting down) at any point. Each
stream speaks one of the APIs kvgate meters or answers: OpenAI chat completions and
completions, Anthropic Messages (and its count_tokens, which kvgate answers itself) and
OpenAI Responses, with valid and hostile bodies of that API (tests/session/fuzz_support.py).
A scripted backend answers admitted requests in the API's grammar: status, SSE events
(named, with garbage between, cut or unterminated) or a JSON body, with or without usage,
in random chunks.

Whatever happens, after every example:
- kvgate itself never answered 5xx and counted no internal error; its refusals are in the
  path's API's shape (Anthropic's ``{"type": "error", ...}`` on /v1/messages*, OpenAI's
  elsewhere);
- every reply is of the kind Envoy asked for (or an immediate response);
- a count_tokens request is answered with a count or refused, never admitted, and holds
  nothing once answered;
- a Responses request that refers to a stored conversation is never admitted;
- once the streams are closed and their settlements have landed, the store holds nothing:
  no KV or request in flight on the backend, no tenant concurrency, no lease renewed;
- the ledger grew by exactly what the scripted backend served, as the billing rule prices
  it (one request per admitted stream; the backend's usage, or the counted text, or the
  worst case, by how the answer ended).

The budget is fixed (derandomized, a set number of examples): `make test` runs the same
examples every time, in a few tens of seconds at most. `--hypothesis-show-statistics`
shows how the examples ended (per API: answered with which code and param or error type,
admitted and settled how).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvgate.app import KvgateServer
from kvgate.config import parse_config
from kvgate.extproc.handlers import Phase
from kvgate.extproc.session import StreamSession
from kvgate.lifecycle.billing import CutRequestCharge, ResponseReading, charged_usage
from kvgate.policy import ActualUsage, SettleCause
from tests.session.conftest import API_KEY, make_config
from tests.session.fuzz_support import (
    ANTHROPIC_ERROR_TYPES,
    ANY_JSON,
    CHAT_TEMPLATE_KWARGS,
    COUNT_TOKENS,
    COUNT_TOKENS_PATH,
    HELD_EVENT_BYTES,
    INTS,
    JSON_LEAF,
    JSON_TYPES,
    MESSAGES,
    MESSAGES_PATH,
    MODEL,
    PERCENT,
    RAW_BODIES,
    RESPONSES,
    RESPONSES_PATH,
    SSE_TYPES,
    WORDS,
    Answer,
    ApiGrammar,
    SseScript,
    anthropic_answers,
    mostly,
    responses_answers,
    sometimes,
    stateful,
)

TENANT = "acme"
PROFILE = "kvgate-session-fuzz"
# Split across the APIs by API_WEIGHTS (each example: one to three streams).
EXAMPLES = 750
settings.register_profile(
    PROFILE,
    derandomize=True,  # the same examples on every run: a fixed budget, no flakes
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    server: KvgateServer

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def restart(self) -> None:
        """A new kvgate: what a failed example left behind (a leak, say) must not fail the
        examples after it, nor Hypothesis's replays while it shrinks the failure."""
        self.run(self.server.stop())
        self.server = start_server(self.loop)


def fuzz_config() -> dict[str, Any]:
    config = make_config(kv_budget_tokens=24_000, max_concurrent_requests=8)
    tenant = config["tenants"][0]
    tenant["allowed_priorities"] = [5, -1]
    tenant["limits"] = {"concurrency": {"limit": 2}}
    # A decision that waits is kvgate's 503; here nothing may time out on a busy machine.
    config["server"]["decision_timeout_s"] = 30
    # A duplicate Idempotency-Key waits for the first stream, which this one task drives:
    # give up at once (409) instead of stalling the example.
    config["idempotency"] = {"enabled": True, "max_wait_s": 0.01}
    return config


def start_server(loop: asyncio.AbstractEventLoop) -> KvgateServer:
    server = KvgateServer(parse_config(fuzz_config()))
    loop.run_until_complete(server.start())
    return server


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    loop = asyncio.new_event_loop()
    rig = Rig(loop, start_server(loop))
    try:
        yield rig
    finally:
        rig.run(rig.server.stop())
        loop.close()


# --------------------------------------------------------------------------- strategies

ODD_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\t",
        "--5",
        "---1",
        "-",
        "+1",
        " 1 ",
        "\u00b2",
        "\u0663",
        "\uff15",
        "1" * 40,
        "5",
        "-1",
        "0",
        "\u3000",
        "\u00a0x",
        "null",
        "\x00",
        "\u202e",
        "é",
        "a\u0301",
    ]
)
HEADER_TEXT = ODD_TEXT | st.text(max_size=12)
HEADER_BYTES = HEADER_TEXT.map(str.encode) | st.binary(max_size=12)
# Almost numbers: signs, spaces, Unicode digits, separators, sizes.
NUMBERISH = (
    ODD_TEXT | st.text(alphabet="0123456789-+ _.e\u00b2\u0663\uff15\u2212", min_size=1, max_size=6)
).map(str.encode)
AUTHORIZATIONS = mostly(
    st.just({"authorization": f"Bearer {API_KEY}"}),
    st.sampled_from(
        [
            {"authorization": f"bearer \t{API_KEY} "},
            {"x-api-key": API_KEY},
            {"x-api-key": f" {API_KEY}\u3000"},
            {"authorization": f"Basic {API_KEY}"},
            {"authorization": "Bearer sk-wrong"},
            {"authorization": "Bearer"},
            {"authorization": f"Bearer {API_KEY}", "x-api-key": "sk-wrong"},
            {},
        ]
    ),
)
ODD_PATHS = st.sampled_from(
    [
        "/v1/chat/completions?stream=true",
        "/v1/models",
        "/v1/models/qwen2.5-demo",
        "/v1/kvgate/usage",
        "/v1/embeddings",
        "/",
        "",
        "/v1/chat/completions/",
        "/V1/COMPLETIONS",
        "/v1/messages?beta=true",
        "/v1/messages/count_tokens?beta=true",
        "/v1/messages/",
        "/V1/MESSAGES",
        "/v1/messages/batches",
        "/v1/messages/count_tokens/",
        "/v1/responses?stream=true",
        "/v1/responses/resp_1",
        "/v1/responses/resp_1/cancel",
        "/v1/responses/resp_1/input_items",
        "/v1/conversations",
    ]
) | st.text(max_size=10)
METHODS = mostly(st.just("POST"), st.sampled_from(["GET", "HEAD", "post", "PUT", ""]))

MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": WORDS}
)
ODD_MESSAGE = st.sampled_from(
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "wizard", "content": "x"},
        {"role": 1, "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": [{"type": "text"}]},
        {"role": "user", "content": [{"text": "x"}]},
        {"role": "user", "content": ["x"]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": 5}}]},
        {"role": "assistant", "content": "x", "tool_calls": "x"},
        {"role": "tool", "content": "x", "tool_call_id": 3},
        {"role": "user", "content": "x", "name": ["x"]},
        {"role": "assistant", "content": "x", "reasoning_content": "y"},
    ]
)
CHAT_MESSAGES = (
    st.lists(MESSAGE, min_size=1, max_size=3)
    | st.lists(MESSAGE | ODD_MESSAGE, min_size=1, max_size=3)
    | ANY_JSON
)
PROMPTS = (
    WORDS
    | st.lists(WORDS, min_size=1, max_size=3)
    | st.lists(st.integers(min_value=-2, max_value=200_000), min_size=1, max_size=4)
    | st.lists(st.lists(st.integers(0, 1000), max_size=3), min_size=1, max_size=2)
    | st.sampled_from([[], [[]], [1.5], ["a", 1], [[1], "a"], [True]])
    | ANY_JSON
)
TOOLS = st.sampled_from(
    [
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        [{"type": "function", "function": {"name": "f", "description": "d"}}],
        [{"type": "function", "function": 5}],
        [{"type": "function"}],
        [{"function": {"name": None}}],
        [{}],
        [1],
        "f",
        {},
        [],
    ]
)
# Every body field kvgate reads, each with valid and odd values (absent when not drawn).
BODY_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "gpt-4o", "", " qwen2.5-demo"]) | JSON_LEAF,
    "messages": CHAT_MESSAGES,
    "prompt": PROMPTS,
    "max_tokens": INTS | st.none(),
    "max_completion_tokens": INTS | st.none(),
    "n": INTS | st.none(),
    "best_of": INTS,
    "stream": st.booleans() | st.sampled_from(["true", 1, None]),
    "stream_options": st.sampled_from(
        [{"include_usage": True}, {"include_usage": False}, {}, {"include_usage": "yes"}, "x"]
    )
    | st.none(),
    "tools": TOOLS | st.none(),
    "temperature": st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 0.0, -1, 2, "0", True, None]),
    "min_tokens": INTS,
    "logprobs": st.booleans() | INTS | st.none(),
    "top_logprobs": INTS,
    "chat_template_kwargs": CHAT_TEMPLATE_KWARGS | st.none(),
    "echo": st.booleans() | st.sampled_from([1, "yes"]),
    "add_generation_prompt": st.booleans() | st.sampled_from([0, "no"]),
    "continue_final_message": st.booleans() | st.sampled_from([1, "no"]),
    "use_beam_search": st.booleans(),
    "prompt_embeds": st.sampled_from(["AAAA", None]),
    "chat_template": st.sampled_from(["{{ messages }}", None]),
}


@st.composite
def openai_valid_bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A request kvgate admits (when the limits allow): the base the odd values go into."""
    body: dict[str, Any] = {"model": MODEL}
    if chat:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(WORDS | st.lists(WORDS, min_size=1, max_size=2))
    optional: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.integers(1, 400) | st.none(),
        "n": st.integers(1, 2),
        "temperature": st.sampled_from([0, 0.7]),
        "min_tokens": st.integers(0, 3),
        "logprobs": st.booleans() if chat else st.integers(0, 5),
    }
    if chat:
        optional["max_completion_tokens"] = st.integers(1, 400)
        optional["tools"] = TOOLS.filter(lambda t: isinstance(t, list) and t[:1] != [1])
        optional["chat_template_kwargs"] = st.sampled_from([{}, {"enable_thinking": True}])
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[name] = draw(optional[name])
    body["stream"] = draw(st.booleans())
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


OPENAI_CORE = ("model", "messages", "prompt", "max_tokens")
CHAT = ApiGrammar(
    "chat", "/v1/chat/completions", BODY_FIELDS, OPENAI_CORE, openai_valid_bodies(chat=True)
)
COMPLETIONS = ApiGrammar(
    "completions", "/v1/completions", BODY_FIELDS, OPENAI_CORE, openai_valid_bodies(chat=False)
)
GRAMMARS = {
    grammar.path: grammar for grammar in (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)
}
# How often a stream speaks each API: the example budget split across the paths.
API_WEIGHTS = [CHAT] * 5 + [COMPLETIONS] * 3 + [MESSAGES] * 6 + [RESPONSES] * 6 + [COUNT_TOKENS] * 2


# What a body is, by the twentieth: valid (70%), a medley of its API's fields and odd values
# (20%), raw bytes (5%), any JSON (5%).
BODY_KINDS = ["valid"] * 14 + ["fields"] * 4 + ["raw", "odd_json"]


@st.composite
def bodies(draw: st.DrawFn, grammar: ApiGrammar, clean: bool = False) -> bytes:
    """A request body of `grammar`'s API; `clean`: a valid one (a field with an odd value one
    time in five)."""
    kind = draw(PERCENT.map(lambda i: BODY_KINDS[i // 5]))
    if clean or kind == "valid":
        body = draw(grammar.valid)
        odd_fields = 1 if clean else 2
        if not clean or sometimes(draw, 20):
            names = st.lists(
                st.sampled_from(sorted(grammar.fields)), unique=True, max_size=odd_fields
            )
            for name in draw(names):
                body[name] = draw(grammar.fields[name])
        return json.dumps(body).encode()
    if kind == "raw":
        return draw(RAW_BODIES)
    if kind == "odd_json":
        return json.dumps(draw(ANY_JSON)).encode()
    body = {}
    names = draw(st.lists(st.sampled_from(sorted(grammar.fields)), unique=True, max_size=7))
    for name in [*grammar.core, *names]:
        if name in body or (name not in names and sometimes(draw, 10)):
            continue
        body[name] = draw(grammar.fields[name])
    extra = draw(st.dictionaries(st.text(max_size=6), ANY_JSON, max_size=2))
    return json.dumps({**extra, **body}).encode()


@dataclass(frozen=True)
class Msg:
    """One message Envoy sends; `close` ends the stream instead (client gone, Envoy timeout,
    or kvgate shutting down)."""

    kind: str  # request_headers ... response_trailers, or "close"
    headers: tuple[tuple[str, bytes], ...] = ()
    body: bytes = b""
    end_of_stream: bool = False
    shutting_down: bool = False


@st.composite
def request_headers(draw: st.DrawFn, grammar: ApiGrammar, clean: bool) -> Msg:
    """A request's headers for `grammar`'s API; `clean`: ones kvgate admits (a valid key,
    path and method, and well-formed optional headers), so that the body and the answer get
    their turn."""
    if clean:
        path = grammar.path
        if grammar.anthropic_errors and sometimes(draw, 20):
            path += "?beta=true"  # as the anthropic SDK's beta client sends it
        # Anthropic's SDK sends its key as x-api-key.
        anthropic_key = grammar.anthropic_errors and draw(st.booleans())
        key = ("x-api-key", API_KEY) if anthropic_key else ("authorization", f"Bearer {API_KEY}")
        values = {":path": path.encode(), ":method": b"POST", key[0]: key[1].encode()}
    else:
        values = {
            ":path": draw(mostly(st.just(grammar.path), ODD_PATHS)).encode(),
            ":method": draw(METHODS).encode(),
        }
        for name, value in draw(AUTHORIZATIONS).items():
            values[name] = value.encode()
    for name, header in grammar.extra_headers.items():
        if sometimes(draw, 50):
            values[name] = draw(header)
    valid_priority = st.sampled_from([b"5", b"-1", b"0", b" 5\t"])
    optional = {
        "kvgate-priority": valid_priority if clean else valid_priority | NUMBERISH,
        # A few shared keys: duplicates replay, wait (409) or mismatch (422).
        "idempotency-key": st.sampled_from([b"key-1", b"key-2"])
        | st.uuids().map(lambda u: str(u).encode())
        if clean
        else mostly(
            st.sampled_from([b"key-1", b"key-2"]) | st.uuids().map(lambda u: str(u).encode()),
            HEADER_BYTES | st.just(b"k" * 256),
        ),
        "x-request-id": mostly(st.just(b"req-1"), HEADER_BYTES),
        "content-type": st.sampled_from(
            [b"application/json", b"text/plain", b"", b"application/json; charset=latin-1"]
        )
        | HEADER_BYTES,
        "traceparent": st.sampled_from(
            [b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b"garbage"]
        ),
        "x-kvgate-backend": st.just(b"evil"),
        "x-kvgate-destination": st.just(b"10.0.0.1:80"),
    }
    headers = list(values.items())
    for name in sorted(optional):
        if sometimes(draw, 40):
            headers.append((name, draw(optional[name])))
    if clean and sometimes(draw, 30):
        # One odd value in otherwise clean headers: each reaches its own check.
        name = draw(st.sampled_from(["kvgate-priority", "idempotency-key", "x-request-id"]))
        headers = [(k, v) for k, v in headers if k != name]
        headers.append((name, draw(NUMBERISH if name == "kvgate-priority" else HEADER_BYTES)))
    if sometimes(draw, 10):  # a header twice: the first value wins
        name = draw(st.sampled_from(["kvgate-priority", "idempotency-key", "authorization"]))
        headers.append((name, draw(NUMBERISH | HEADER_BYTES)))
    return Msg(
        "request_headers",
        headers=tuple(headers),
        end_of_stream=not clean and sometimes(draw, 7),
    )


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


@st.composite
def openai_answers(draw: st.DrawFn, asked_stream: bool) -> Answer:
    """A chat or completions answer: SSE chunks (the last with usage) or one JSON body."""
    status = draw(mostly(st.just(200), st.sampled_from([201, 400, 429, 500, 503])))
    # A stream when one was asked for, mostly (a backend may answer otherwise).
    streamed = asked_stream != sometimes(draw, 10)
    content_type = draw(SSE_TYPES if streamed else JSON_TYPES)
    usage = (draw(st.integers(0, 3000)), draw(st.integers(0, 300)))
    if not streamed:
        document: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        }
        if status >= 400:
            document = {"error": {"message": "engine says no", "type": "x", "code": status}}
        body = json.dumps(document).encode()
        if status < 400 and not sometimes(draw, 20):
            prompt, completion = usage
            numbers = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            tail = f',"usage":{json.dumps(numbers)}}}'.encode()
            usage_at = len(body) - 1  # where the usage member (its comma) starts
            body = body[:-1] + tail
            # A JSON body is cut only before its usage key: the usage scanner's verdict on a
            # body cut inside it is its own business, not this test's. Read once whole.
            return Answer(
                status,
                content_type,
                body,
                json_usage=usage,
                usage_end=len(body),
                cut_before=usage_at,
            )
        return Answer(status, content_type, body)
    script = SseScript()
    if draw(st.booleans()):
        script.raw(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    chat = draw(st.booleans())
    for word in draw(mostly(st.lists(WORDS, min_size=1, max_size=5), st.just([]))):
        choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
        script.raw(sse({"choices": [choice]}), text=word, content=True)
    if not sometimes(draw, 20):
        prompt, completion = usage
        numbers = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        script.raw(sse({"choices": [], "usage": numbers}), prompt=prompt, output=completion)
    if draw(st.booleans()):
        script.raw(sse("[DONE]"))
    return script.answer(status, content_type)


def answers(grammar: ApiGrammar, asked_stream: bool) -> st.SearchStrategy[Answer]:
    """The scripted backend's answer, in the grammar of the API the request speaks."""
    if grammar.anthropic_errors:  # count_tokens' answer is never asked for, nor metered
        return anthropic_answers(asked_stream)
    if grammar is RESPONSES:
        return responses_answers(asked_stream)
    return openai_answers(asked_stream)


@st.composite
def answer_messages(draw: st.DrawFn, answer: Answer) -> list[Msg]:
    """The answer as Envoy hands it over: headers, the body in chunks, maybe trailers."""
    headers: list[tuple[str, bytes]] = [
        (":status", str(answer.status).encode()),
        ("content-type", answer.content_type.encode()),
    ]
    if draw(st.booleans()):
        headers.append(("content-length", str(len(answer.body)).encode()))
    if sometimes(draw, 6):  # a body-less answer
        return [Msg("response_headers", headers=tuple(headers), end_of_stream=True)]
    messages = [Msg("response_headers", headers=tuple(headers))]
    body = answer.body
    last_cut = answer.cut_before if answer.cut_before > 0 else len(body)
    cuts = draw(st.lists(st.integers(1, max(1, last_cut)), max_size=4))
    for item in answer.events:
        if item.oversized and draw(st.booleans()):  # a chunk ends past what the meter holds
            cuts.append(item.start + HELD_EVENT_BYTES + draw(st.integers(1, 64)))
    cuts = sorted(set(cuts))
    edges = [0, *[c for c in cuts if c < len(body)], len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(edges)] or [b""]
    with_trailers = sometimes(draw, 10)
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        messages.append(Msg("response_body", body=chunk, end_of_stream=last and not with_trailers))
    if with_trailers:
        messages.append(Msg("response_trailers"))
    return messages


@dataclass
class Plan:
    messages: list[Msg]
    answer: Answer
    # The path as kvgate reads it (the query string aside): its API's grammar and errors.
    path: str
    # The API whose grammar the body and the answer are written in (its name).
    api: str

    @property
    def admitted_body(self) -> bytes:
        """The body the decision reads: the first one (a second is no more body)."""
        return next(m.body for m in self.messages if m.kind == "request_body")


def path_only(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").split("?", 1)[0]


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    grammar = draw(st.sampled_from(API_WEIGHTS))
    # The agent APIs' streams are admitted more often: the header checks they share with
    # chat and completions get their odd values there, their answer grammars get the turns.
    clean = not sometimes(draw, 40 if grammar in (CHAT, COMPLETIONS) else 25)
    messages = [draw(request_headers(grammar, clean))]
    path = path_only(dict(messages[0].headers)[":path"])
    grammar = GRAMMARS.get(path, grammar)
    body = draw(bodies(grammar, clean))
    answer = draw(answers(grammar, asked_stream=b'"stream": true' in body))
    early = st.sampled_from(
        [
            Msg("response_headers", headers=((":status", b"200"),)),
            Msg("response_body", body=b"data: {}\n\n", end_of_stream=True),
            Msg("request_trailers"),
            Msg("response_trailers"),
        ]
    )
    if sometimes(draw, 12):  # the answer (or trailers) before the request body
        messages.append(draw(early))
    messages.append(Msg("request_body", body=body, end_of_stream=not sometimes(draw, 15)))
    extra = draw(PERCENT)
    if extra >= 92:  # the body twice
        messages.append(Msg("request_body", body=draw(bodies(grammar)), end_of_stream=True))
    elif extra >= 84:  # HTTP/2 request trailers
        messages.append(Msg("request_trailers"))
    messages.extend(draw(answer_messages(answer)))
    if sometimes(draw, 8):  # trailers after the end
        messages.append(draw(st.sampled_from([Msg("request_trailers"), Msg("response_trailers")])))
    # The stream may end (client gone, Envoy timeout) after any message.
    ending = draw(st.sampled_from(["whole"] * 6 + ["cut"] * 3 + ["headers only"]))
    if ending == "cut":
        cut = draw(st.integers(1, len(messages) - 1))
        messages = [*messages[:cut], Msg("close", shutting_down=sometimes(draw, 20))]
    elif ending == "headers only":
        messages = messages[:1]
    return Plan(messages, answer, path, grammar.name)


@st.composite
def examples(draw: st.DrawFn) -> tuple[list[Plan], list[int]]:
    """Streams and the order their messages interleave in (a stream index per step)."""
    streams = draw(st.lists(plans(), min_size=1, max_size=3))
    order = [i for i, plan in enumerate(streams) for _ in plan.messages]
    order = draw(st.permutations(order)) if len(streams) > 1 else order
    return streams, order


# --------------------------------------------------------------------------- driving


def envoy_message(msg: Msg) -> pb.ProcessingRequest:
    def header_map() -> base_pb2.HeaderMap:
        return base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in msg.headers]
        )

    if msg.kind in ("request_headers", "response_headers"):
        http = pb.HttpHeaders(headers=header_map(), end_of_stream=msg.end_of_stream)
        return pb.ProcessingRequest(**{msg.kind: http})
    if msg.kind in ("request_body", "response_body"):
        body = pb.HttpBody(body=msg.body, end_of_stream=msg.end_of_stream)
        return pb.ProcessingRequest(**{msg.kind: body})
    return pb.ProcessingRequest(**{msg.kind: pb.HttpTrailers()})


@dataclass
class StreamRun:
    """One stream's session and what the scripted backend served it after admission."""

    session: StreamSession
    plan: Plan
    closed: bool = False
    shut_down: bool = False  # closed by kvgate's shutdown
    # The answer's messages kvgate read after admitting, up to and including its end.
    served: list[Msg] = field(default_factory=list)
    ended: bool = False


async def answer(session: StreamSession, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """kvgate's reply, as the servicer gets it: a decision that may wait (an Idempotency-Key
    held by another stream) first sends Envoy a message-timeout extension."""
    if not session.wants_interim(message):
        reply = await session.handle(message)
        assert reply is not None, message.WhichOneof("request")
        return reply
    replies = [reply async for reply in session.handle_with_interim(message)]
    assert replies, message.WhichOneof("request")
    *interim, reply = replies
    assert len(interim) <= 1
    assert all(r.HasField("override_message_timeout") for r in interim)
    return reply


def is_end(msg: Msg) -> bool:
    return msg.kind in ("response_headers", "response_body") and msg.end_of_stream


ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)


def check_immediate(plan: Plan, immediate: pb.ImmediateResponse) -> None:
    """An answer kvgate made itself: never a 5xx of its own, and in the path's API's shape
    (a count_tokens count, or a refusal in Anthropic's shape on /v1/messages*, OpenAI's
    elsewhere)."""
    status = immediate.status.code
    api = plan.api if plan.path in GRAMMARS else "other path"
    if immediate.details == "kvgate_idempotent_replay":  # the backend's own stored answer
        event(f"{api}: answered {status} {immediate.details}")
        return
    body = json.loads(immediate.body)
    assert status < 500, (plan.path, status, immediate.details, immediate.body[:300])
    if plan.path == COUNT_TOKENS_PATH and status == 200:
        assert immediate.details == "kvgate_anthropic_count_tokens", immediate.details
        count = body["input_tokens"]
        assert type(count) is int and count > 0, body
        assert body["context_management"] == {"original_input_tokens": count}, body
        event(f"{api}: answered 200 with a count")
        return
    if status < 400:  # the usage report
        assert immediate.details == "kvgate_usage", (status, immediate.details)
        return
    if plan.path in ANTHROPIC_PATHS:
        assert body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"}, body
        assert type(error["message"]) is str and error["message"], body
        expected = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error")
        assert error["type"] == expected, (status, body)
        # Its field, as Anthropic's messages start ("messages.0.content: ...").
        label = f"{error['type']} {error['message'].split(':')[0].split('.')[0][:24]}"
    else:
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert type(error["message"]) is str and type(error["type"]) is str, body
        label = error["param"]
    event(f"{api}: answered {status} {immediate.details} {label}")


async def in_flight(rig: Rig) -> tuple[int, int, int]:
    """What the store holds now: KV tokens and requests in flight, tenant concurrency."""
    kv = requests = 0
    for status in await rig.server.store.backend_status():
        kv += status.kv_tokens_in_flight
        requests += status.requests_in_flight
    tenant_state = rig.server.store._tenants.get(TENANT)
    scopes = tenant_state.scopes.values() if tenant_state is not None else ()
    return kv, requests, sum(scope.in_flight for scope in scopes)


async def drive(rig: Rig, streams: list[Plan], order: list[int]) -> list[StreamRun]:
    runs = [StreamRun(StreamSession(rig.server.services), plan) for plan in streams]
    position = [0] * len(runs)
    for index in order:
        run = runs[index]
        msg = run.plan.messages[position[index]]
        position[index] += 1
        if run.closed:
            continue
        if msg.kind == "close":
            run.session.close(shutting_down=msg.shutting_down)
            run.closed, run.shut_down = True, msg.shutting_down
            continue
        admitted_before = run.session.ticket is not None
        counting = run.plan.path == COUNT_TOKENS_PATH
        held_before = await in_flight(rig) if counting else None
        reply = await answer(run.session, envoy_message(msg))
        answered = reply.WhichOneof("response")
        assert answered in (msg.kind, "immediate_response"), (msg.kind, answered)
        if answered == "immediate_response":
            check_immediate(run.plan, reply.immediate_response)
        if counting:
            # Answered by kvgate itself: nothing admitted, nothing reserved, even for a while
            # (other streams' settlements may only free what they held meanwhile).
            assert run.session.ticket is None
            assert held_before is not None
            assert all(a <= b for a, b in zip(await in_flight(rig), held_before, strict=True))
        if admitted_before and not run.ended and msg.kind.startswith("response_"):
            run.served.append(msg)
            run.ended = is_end(msg)
    for run in runs:
        if not run.closed:
            run.session.close(shutting_down=False)  # the gRPC stream always ends
    return runs


def served_reading(run: StreamRun) -> tuple[SettleCause, ResponseReading, str]:
    """What the scripted backend served this stream, as the meter should have read it:
    the cause its settlement has, the reading and the answer text. The usage is the last
    prompt and output the served events reported (Anthropic's come from message_start and
    message_delta, OpenAI's and Responses' from one event), or the JSON body's once
    delivered far enough."""
    answer = run.plan.answer
    status, content_type = 0, ""
    delivered = b""
    chunk_ends: list[int] = []
    for msg in run.served:
        if msg.kind == "response_headers":
            fields = dict(msg.headers)
            status = int(fields[":status"])
            content_type = fields.get("content-type", b"").decode()
        elif msg.kind == "response_body":
            delivered += msg.body
            chunk_ends.append(len(delivered))
    accepted = 200 <= status < 300
    usage: ActualUsage | None = None
    text = ""
    content_events = 0
    truncated = False  # the meter could not keep all of the answer's text
    streamed_answer = content_type.startswith("text/event-stream")
    if streamed_answer:
        prompt: int | None = None
        output: int | None = None
        for item in answer.events:
            # An unterminated last event is read when the stream ends, not when it is cut.
            if item.end > len(delivered) or (item.at_finish and not run.ended):
                break
            content_events += item.content
            split = any(item.start + HELD_EVENT_BYTES < b < item.end for b in chunk_ends)
            if item.oversized == "always" or (item.oversized == "when split" and split):
                truncated = True
            elif not truncated:
                text += item.text
            prompt = item.prompt if item.prompt is not None else prompt
            output = item.output if item.output is not None else output
        if accepted and prompt is not None and output is not None:
            usage = ActualUsage(prompt_tokens=prompt, output_tokens=output)
    elif accepted and answer.json_usage is not None and len(delivered) >= answer.usage_end:
        prompt, completion = answer.json_usage
        usage = ActualUsage(prompt_tokens=prompt, output_tokens=completion)
    if run.ended:
        cause = SettleCause.COMPLETED if accepted else SettleCause.UPSTREAM_ERROR
    else:
        cause = SettleCause.SHUTDOWN if run.shut_down else SettleCause.DISCONNECTED
    assert run.session.ticket is not None
    reading = ResponseReading(
        accepted=accepted,
        streamed=run.session.ticket.request.stream,
        usage=usage,
        content_events=content_events,
        output_text_complete=streamed_answer and not truncated,
        visible_text=bool(text),
    )
    return cause, reading, text


async def expected_charge(rig: Rig, run: StreamRun) -> ActualUsage:
    ticket = run.session.ticket
    assert ticket is not None
    cause, reading, text = served_reading(run)
    if reading.usage is None and text and reading.accepted:
        counted = await rig.server.tokenizers.count_text(ticket.model, text)
        reading = ResponseReading(
            accepted=reading.accepted,
            streamed=reading.streamed,
            counted_output_tokens=counted,
            content_events=reading.content_events,
            output_text_complete=reading.output_text_complete,
            visible_text=reading.visible_text,
        )
    charged, _ = charged_usage(cause, reading, ticket.reservation, CutRequestCharge.BACKEND_WORK)
    return charged


def internal_errors(rig: Rig) -> float:
    return sum(
        sample.value
        for metric in rig.server.metrics.internal_errors.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def ledger(rig: Rig) -> tuple[int, int, int]:
    totals = (await rig.server.store.usage_totals()).get((TENANT, MODEL))
    if totals is None:
        return 0, 0, 0
    return totals.requests, totals.prompt_tokens, totals.output_tokens


async def settled(rig: Rig) -> None:
    """Every settlement's store write has landed."""
    services = rig.server.services
    for _ in range(200):
        await services.tasks.drain(timeout_s=5)
        if not services.tasks._running:
            return
        await asyncio.sleep(0)


async def left_behind(rig: Rig) -> list[str]:
    """What the store still holds once every stream is closed and settled: KV or requests
    on the backend, tenant concurrency or money, lease renewals. Nothing, always."""
    store = rig.server.store
    held = [
        f"backend {status.name}: {status.kv_tokens_in_flight} KV tokens, "
        f"{status.requests_in_flight} requests"
        for status in await store.backend_status()
        if status.kv_tokens_in_flight or status.requests_in_flight
    ]
    tenant_state = store._tenants.get(TENANT)  # the memory store's own ledger of the tenant
    if tenant_state is not None:
        held += [
            f"tenant scope {key}: {scope.in_flight} in flight"
            for key, scope in tenant_state.scopes.items()
            if scope.in_flight
        ]
        held += [f"tenant money {k}: {v}" for k, v in tenant_state.reserved.items() if v]
    if len(rig.server.services.leases):
        held.append(f"{len(rig.server.services.leases)} leases renewed")
    return held


async def play(rig: Rig, streams: list[Plan], order: list[int]) -> None:
    errors_before = internal_errors(rig)
    ledger_before = await ledger(rig)
    runs = await drive(rig, streams, order)
    await settled(rig)

    assert internal_errors(rig) == errors_before
    for run in runs:
        assert run.session.phase is not Phase.FORWARDED and not run.session.phase.unsettled
    assert await left_behind(rig) == []
    # The ledger grew by what the backend served, as the billing rule prices it; never by
    # a count_tokens request.
    admitted = [run for run in runs if run.session.ticket is not None]
    for run in admitted:
        assert run.plan.path != COUNT_TOKENS_PATH
        if run.plan.path == RESPONSES_PATH:
            assert stateful(run.plan.admitted_body) is None, run.plan.admitted_body
        cause, reading, text = served_reading(run)
        event(
            f"{run.plan.api}: admitted, settled {cause.value}, "
            f"usage read: {reading.usage is not None}, answer text: {bool(text)}"
        )
    charges = [await expected_charge(rig, run) for run in admitted]
    requests, prompt, output = await ledger(rig)
    assert requests - ledger_before[0] == len(admitted)
    assert prompt - ledger_before[1] == sum(c.prompt_tokens for c in charges)
    assert output - ledger_before[2] == sum(c.output_tokens for c in charges)


# Room for Hypothesis to shrink a failure (it gives up after 300 s of shrinking) and print
# it, beyond the suite's 300 s per test: a passing run takes a few tens of seconds.
@pytest.mark.timeout(900)
@settings(settings.get_profile(PROFILE))
@given(example=examples())
def test_odd_input_in_any_order_never_fails_kvgate_nor_leaks(
    rig: Rig, example: tuple[list[Plan], list[int]]
) -> None:
    streams, order = example
    try:
        rig.run(play(rig, streams, order))
    except BaseException:
        # A leak would fail every example after this one, and Hypothesis's replays of it.
        if rig.run(left_behind(rig)):
            rig.restart()
        raise
