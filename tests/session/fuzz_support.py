"""The session fuzz's grammars (tests/session/test_fuzz_session.py): the primitives its
strategies share, what a scripted backend answer served and how the meter must read it
(``Answer``, ``Event``), and the hostile-but-plausible request bodies and backend answers of
the two agent APIs kvgate meters besides OpenAI's generation APIs: Anthropic Messages
(``/v1/messages``, and ``/v1/messages/count_tokens`` which kvgate answers itself) and OpenAI
Responses (``/v1/responses``).

Each scripted answer records, as it is written, what each of its parts does to the bill:
the text an SSE event adds to the answer text, whether it is a content event, the usage it
reports (Anthropic's prompt comes from ``message_start`` and the output from
``message_delta``; Responses' from its terminal event), and where a JSON body's usage ends.
The test reads those records up to what the backend really served and prices them with
kvgate's billing rule; the bytes themselves are read only by kvgate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import strategies as st

MODEL = "qwen2.5-demo"

# --------------------------------------------------------------------------- primitives

JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
# Answer and prompt text: one token each, and several (so counted text and content events,
# the two floors of a cut stream's bill, differ).
WORDS = st.sampled_from(
    [" hello", " KV", " cache", " 你好", "\n", " 🙂", " Pneumonoultramicroscopic", " ÉÀ🙂🙂"]
)
# Weights by sampled_from over a range: Hypothesis draws integers() far from uniformly (it
# favours small and boundary values), a list's elements about evenly.
PERCENT = st.sampled_from(range(100))
# An answer's words: mostly some (an empty answer now and then).
SOME_WORDS = PERCENT.flatmap(
    lambda i: st.lists(WORDS, min_size=1, max_size=4) if i < 85 else st.just([])
)
INTS = (
    st.integers(min_value=-3, max_value=70)
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.sampled_from([0, 1, 2**31 - 1, 2**31, 32_768, 40_000, 1.0, 1.5, True, False, "16"])
)
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [0, 0.0, -1, 2, "0", True, None]
)
MODELS = st.sampled_from([MODEL, MODEL, MODEL, "gpt-4o", "", " qwen2.5-demo"]) | JSON_LEAF
STREAMS = st.booleans() | st.sampled_from(["true", 1, None])
CHAT_TEMPLATE_KWARGS = st.sampled_from(
    [
        {},
        {"enable_thinking": True},
        {"add_generation_prompt": "yes"},
        {"messages": 1},
        {"tools": 5},
        {"bos_token": 7},
        {"chat_template": "{{ 1 }}"},
        "x",
        [],
    ]
) | st.dictionaries(st.text(max_size=6), ANY_JSON, max_size=2)
# Bodies no API can read, and some that only one cannot.
RAW_BODIES = st.binary(max_size=40) | st.sampled_from(
    [
        b"",
        b"   ",
        b"\xef\xbb\xbf{}",
        b'{"model":',
        b"[]",
        b"null",
        b'{"max_tokens": NaN}',
        b'{"max_tokens": 1e400}',
        b'{"a": "\\ud800"}',
        b"[" * 70 + b"]" * 70,
        b'{"model":"qwen2.5-demo","messages":' + b"[" * 70 + b"]" * 70 + b"}",
        b'{"model":"qwen2.5-demo","input":' + b"[" * 70 + b"]" * 70 + b"}",
        b'{"model":"qwen2.5-demo","max_tokens":' + b"9" * 5000 + b"}",
        b'{"model":"qwen2.5-demo","max_output_tokens":' + b"9" * 5000 + b',"input":"x"}',
        b'{"model":"qwen2.5-demo","max_tokens":8,"messages":[{"role":"user","content":"x"}]',
        b'{"model":"qwen2.5-demo","input":"x"}{"model":"qwen2.5-demo","input":"y"}',
        b"model=qwen2.5-demo&input=hi",
    ]
)


def sometimes(draw: st.DrawFn, percent: int) -> bool:
    """True about `percent` times in a hundred; False for the simplest draw, which the first
    examples and the shrinker favour: they keep to the usual path, as `mostly` does."""
    return draw(PERCENT) >= 100 - percent


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`usual` four times in five, else `odd`: most streams get far enough to be admitted."""
    return PERCENT.flatmap(lambda i: usual if i < 80 else odd)


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Event:
    """One SSE event of a scripted answer and what it does to the bill once the meter has
    read it (its blank line delivered; an unterminated last one at the stream's end)."""

    end: int  # offset in the answer's body where the event ends
    text: str = ""  # answer text the meter keeps from it
    content: bool = False  # a content event: at least one output token
    prompt: int | None = None  # the prompt tokens it reports
    output: int | None = None  # the output tokens it reports
    at_finish: bool = False  # unterminated: read only when the stream ends
    start: int = 0  # offset in the answer's body where the event starts
    # Too large for the meter to keep: "always" (a Responses delta outgrows what is
    # captured), "when split" (a Messages event is skipped as it passes when a chunk ends
    # more than HELD_EVENT_BYTES into it, else read whole). A skipped one is output whose
    # text is not kept, nor any text after it.
    oversized: str = ""


#: The largest event (Messages) or delta (Responses) the meters keep.
HELD_EVENT_BYTES = 64 * 1024


@dataclass(frozen=True)
class Answer:
    """The scripted backend's answer to a forwarded request, and what it served."""

    status: int
    content_type: str
    body: bytes
    # SSE: its events in order.
    events: tuple[Event, ...] = ()
    # JSON: the usage the body reports (prompt, output), when the meter can read it, and
    # how far the body must be delivered for it to be read.
    json_usage: tuple[int, int] | None = None
    usage_end: int = -1
    # The answer is cut into chunks only before this offset (-1: anywhere).
    cut_before: int = -1


class SseScript:
    """An SSE body written event by event, each with its effect on the bill."""

    def __init__(self, newline: bytes = b"\n") -> None:
        self.newline = newline
        self.body = b""
        self.events: list[Event] = []

    def frame(self, lines: list[bytes], **effect: Any) -> None:
        nl = self.newline
        start = len(self.body)
        self.body += nl.join(lines) + nl + nl
        self.events.append(Event(len(self.body), start=start, **effect))

    def named(self, name: str, data: dict[str, Any], **effect: Any) -> None:
        self.frame([b"event: " + name.encode(), b"data: " + dumps(data)], **effect)

    def raw(self, raw: bytes, **effect: Any) -> None:
        """A frame written as is (LF line ends, turned into the script's)."""
        start = len(self.body)
        self.body += raw.replace(b"\n", self.newline)
        self.events.append(Event(len(self.body), start=start, **effect))

    def unterminate(self, keep_newline: bool) -> None:
        """The backend closed the stream without the last event's blank line: the meter
        reads that event only at the stream's end."""
        if not self.events:
            return
        nl = self.newline
        self.body = self.body[: -2 * len(nl)] + (nl if keep_newline else b"")
        self.events[-1] = replace(self.events[-1], end=len(self.body), at_finish=True)

    def answer(self, status: int, content_type: str) -> Answer:
        return Answer(status, content_type, self.body, events=tuple(self.events))


SSE_TYPES = st.sampled_from(
    ["text/event-stream", "text/event-stream; charset=utf-8", "text/event-stream;charset=UTF-8"]
)
JSON_TYPES = st.sampled_from(["application/json", "application/json", "text/plain", ""])
NEWLINES = st.sampled_from([b"\n", b"\n", b"\n", b"\r\n"])
# Frames that change nothing on any stream: comments, fields without data, non-JSON.
NOOP_FRAMES = [
    b": keep-alive\n\n",
    b"retry: 100\nid: 7\n\n",
    b"event: ping\n\n",
    b"data: not json\n\n",
    b"data: [1, 2]\n\n",
    b"data: \n\n",
    b'data: {"type": 5}\n\n',
    b"data: [DONE]\n\n",
]


def json_with_usage(
    document: dict[str, Any], usage: Any, trailer: dict[str, Any] | None = None
) -> tuple[bytes, int]:
    """``document`` serialised with ``usage`` after its members (and ``trailer``'s members
    after it); the body and where the usage value ends."""
    head = dumps(document)[:-1]
    head += (b", " if document else b"") + b'"usage": ' + dumps(usage)
    usage_end = len(head)
    if trailer:
        head += b", " + dumps(trailer)[1:-1]
    return head + b"}", usage_end


# --------------------------------------------------------------------------- Anthropic

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

TEXT_BLOCK = WORDS.map(lambda w: {"type": "text", "text": w})
USER_BLOCK = (
    TEXT_BLOCK
    | WORDS.map(lambda w: {"type": "text", "text": w, "cache_control": {"type": "ephemeral"}})
    | WORDS.map(lambda w: {"type": "tool_result", "tool_use_id": "toolu_1", "content": w})
    | WORDS.map(
        lambda w: {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [{"type": "text", "text": w}],
            "is_error": False,
        }
    )
)
ASSISTANT_BLOCK = (
    TEXT_BLOCK
    | WORDS.map(lambda w: {"type": "thinking", "thinking": w, "signature": "c2ln"})
    | st.just({"type": "redacted_thinking", "data": "ZW5j"})
    | st.sampled_from(
        [{"city": "Paris"}, {}, {"usage": {"input_tokens": 1, "output_tokens": 1}}]
    ).map(lambda i: {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": i})
)
ANTHROPIC_TURN = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": WORDS}),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(USER_BLOCK, min_size=1, max_size=3)}
    ),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": WORDS}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.lists(ASSISTANT_BLOCK, min_size=1, max_size=2)}
    ),
)
ODD_ANTHROPIC_TURN = st.sampled_from(
    [
        {"role": "system", "content": "x"},
        {"role": "wizard", "content": "x"},
        {"role": 1, "content": "x"},
        {"content": "x"},
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "user", "content": 5},
        {"role": "user", "content": []},
        {"role": "user", "content": ["x"]},
        {"role": "user", "content": [{"text": "x"}]},
        {"role": "user", "content": [{"type": "text"}]},
        {"role": "user", "content": [{"type": "text", "text": 5}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]},
        {"role": "user", "content": [{"type": "server_tool_use", "id": "s", "name": "web"}]},
        {
            "role": "user",
            "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png"}}],
        },
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "x"}]},
        {"role": "user", "content": [{"type": "tool_result", "content": [5]}]},
        {"role": "user", "content": [{"type": "tool_result", "content": {"a": 1}}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "content": [{"type": "image", "source": {}}]}],
        },
        {"role": "user", "content": [{"type": "tool_result", "content": [{"type": "text"}]}]},
        {"role": "user", "content": [{"type": "tool_addition", "tool_name": "x"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "", "name": "f"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 1}],
        },
        {"role": "assistant", "content": [{"type": "tool_result", "content": [{"a": 1}]}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": None}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking"}]},
    ]
)
ANTHROPIC_MESSAGES = (
    st.lists(ANTHROPIC_TURN, min_size=1, max_size=3)
    | st.lists(ANTHROPIC_TURN | ODD_ANTHROPIC_TURN, min_size=1, max_size=3)
    | st.sampled_from([[], None, "hi", {"role": "user", "content": "x"}])
    | ANY_JSON
)
ANTHROPIC_TOOLS_OK = [
    [
        {
            "name": "get_weather",
            "description": "Weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    [{"name": "f", "input_schema": {}}],
    [{"type": "custom", "name": "f", "input_schema": {"type": "object"}, "strict": True}],
]

ANTHROPIC_TOOLS = st.sampled_from(
    [
        *ANTHROPIC_TOOLS_OK,
        [{"type": "web_search_20250305", "name": "web_search"}],
        [{"type": "bash_20250124", "name": "bash"}],
        [{"name": "f"}],
        [{"input_schema": {}}],
        [{"name": 5, "input_schema": {}}],
        [{"name": "f", "input_schema": "x"}],
        [{"name": "f", "input_schema": {}, "strict": "yes"}],
        [{"name": "f", "input_schema": {}, "description": 5}],
        [1],
        "f",
        {},
        [],
    ]
)
ANTHROPIC_TOOL_CHOICES = st.sampled_from(
    [
        {"type": "auto"},
        {"type": "any"},
        {"type": "none"},
        {"type": "tool", "name": "get_weather"},
        {"type": "auto", "disable_parallel_tool_use": True},
        {"type": "tool"},
        {"type": "tool", "name": 5},
        {"type": "required"},
        {"type": "auto", "disable_parallel_tool_use": "yes"},
        "auto",
        {},
    ]
)
THINKING = st.sampled_from(
    [
        {"type": "disabled"},
        {"type": "adaptive"},
        {"type": "adaptive", "display": "summarized"},
        {"type": "between_tools"},
        {"type": "enabled", "budget_tokens": 1024},
        {"type": "enabled", "budget_tokens": 100},
        {"type": "enabled", "budget_tokens": 2**40},
        {"type": "enabled", "budget_tokens": "2048"},
        {"type": "enabled"},
        {"type": "adaptive", "display": "loud"},
        {"type": "on"},
        {},
        "enabled",
    ]
)
OUTPUT_CONFIGS = st.sampled_from(
    [
        {"effort": "low"},
        {"effort": "max"},
        {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        {"effort": "ultra"},
        {"effort": 1},
        {"format": {"type": "xml"}},
        {"format": "json"},
        "x",
        {},
    ]
)
SYSTEMS = (
    WORDS
    | st.lists(TEXT_BLOCK, min_size=1, max_size=2)
    | st.sampled_from(
        [
            "",
            [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"}],
            [{"type": "text", "text": ""}],
            [{"type": "image", "source": {}}],
            [{"type": "text"}],
            ["x"],
            [{"type": "fancy", "text": "x"}],
            5,
            {"text": "x"},
        ]
    )
)

# Every Messages body field kvgate reads, each with valid and odd values.
ANTHROPIC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "messages": ANTHROPIC_MESSAGES,
    "max_tokens": INTS | st.none(),
    "system": SYSTEMS,
    "stream": STREAMS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "stop_sequences": st.sampled_from([["\n\nHuman:"], [], "stop", [1], None, [None]]),
    "metadata": st.sampled_from([{"user_id": "u-1"}, {}, "x", [], None]),
    "tools": ANTHROPIC_TOOLS | st.none(),
    "tool_choice": ANTHROPIC_TOOL_CHOICES | st.none(),
    "thinking": THINKING | st.none(),
    "output_config": OUTPUT_CONFIGS | st.none(),
    "min_tokens": INTS,
    "chat_template_kwargs": CHAT_TEMPLATE_KWARGS | st.none(),
    "service_tier": st.sampled_from(["auto", "standard_only", 5]),
    "container": st.sampled_from([None, "cntr_1", {"id": "x"}]),
    "mcp_servers": st.sampled_from([[{"type": "url", "url": "http://x", "name": "x"}], "x"]),
    "kv_transfer_params": st.sampled_from([{"do_remote_decode": True}, "x", None]),
}
# The fields a body without odd values is built around (each may be missing).
ANTHROPIC_CORE = ("model", "messages", "max_tokens")
COUNT_CORE = ("model", "messages")


@st.composite
def anthropic_valid_bodies(draw: st.DrawFn, count: bool = False) -> dict[str, Any]:
    """A Messages body kvgate admits (when the limits allow); ``count``: a count_tokens one
    (no max_tokens, no stream)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": draw(st.lists(ANTHROPIC_TURN, min_size=1, max_size=3)),
    }
    max_tokens = draw(st.integers(1, 400))
    if not count:
        body["max_tokens"] = max_tokens
    optional: dict[str, st.SearchStrategy[Any]] = {
        "system": WORDS | st.lists(TEXT_BLOCK, min_size=1, max_size=2),
        "temperature": st.sampled_from([0, 0.7, 1]),
        "top_p": st.just(0.9),
        "top_k": st.just(40),
        "stop_sequences": st.just(["\n\nHuman:"]),
        "metadata": st.just({"user_id": "u-1"}),
        "tools": st.sampled_from(ANTHROPIC_TOOLS_OK),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}, {"type": "any"}]),
        "thinking": st.sampled_from([{"type": "disabled"}, {"type": "adaptive"}]),
        "output_config": st.just({"effort": "low"}),
        "min_tokens": st.integers(0, 1),
        "service_tier": st.just("auto"),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[name] = draw(optional[name])
    if count:
        if sometimes(draw, 20):
            body["thinking"] = {"type": "enabled", "budget_tokens": 2048}
        return body
    if sometimes(draw, 5):  # thinking with room for it
        body["max_tokens"] = 2048
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    body["stream"] = not sometimes(draw, 40)  # the richer grammar, a bit more often
    return body


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# A tool argument larger than any event or delta the meters hold.
HUGE_ARGUMENT = '{"file": "' + "x" * (HELD_EVENT_BYTES + 4000) + '"}'

ANTHROPIC_GARBAGE = [
    *["noop"] * 4,
    "name only",
    "two data lines",
    "delta without text",
    "delta not an object",
    "negative usage",
    "nested usage",
    "name and type differ",
]


def anthropic_error_body(status: int) -> bytes:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return dumps({"type": "error", "error": {"type": kind, "message": "engine says no"}})


def _anthropic_usage(draw: st.DrawFn, prompt: int, output: int | None) -> tuple[Any, int | None]:
    """A usage object as message_start (``output`` None) or message_delta writes it, and
    the prompt it reports (None: unreadable). Anthropic's prompt is the uncached input plus
    the cache's reads and writes."""
    read, created = draw(st.sampled_from([(0, 0), (0, 0), (0, 0), (7, 0), (0, 120), (3, 5)]))
    usage: dict[str, Any] = {"input_tokens": prompt}
    if read or created or sometimes(draw, 30):
        usage["cache_read_input_tokens"] = read
        usage["cache_creation_input_tokens"] = created
    if sometimes(draw, 20):
        usage["service_tier"] = "standard"
        usage["server_tool_use"] = {"web_search_requests": 0}
    usage["output_tokens"] = 1 if output is None else output
    reported: int | None = prompt + read + created
    if sometimes(draw, 6):  # numbers kvgate must not take
        bad = draw(st.sampled_from(["12", -1, 1.5, True, None]))
        usage["input_tokens"] = bad
        reported = None
    return usage, reported


@st.composite
def anthropic_answers(draw: st.DrawFn, asked_stream: bool) -> Answer:
    status = draw(mostly(st.just(200), st.sampled_from([201, 400, 413, 429, 500, 503, 529])))
    streamed = asked_stream != sometimes(draw, 10)
    prompt, output = draw(st.integers(0, 3000)), draw(st.integers(0, 300))
    if status >= 400 and not (streamed and sometimes(draw, 50)):
        content_type = draw(st.sampled_from(["application/json", "text/plain"]))
        return Answer(status, content_type, anthropic_error_body(status))
    if not streamed:
        return _anthropic_message(draw, status, prompt, output)
    script = SseScript(draw(NEWLINES))

    def garbage() -> None:
        """Now and then, an event a backend or a proxy may slip in, and what it bills."""
        if not sometimes(draw, 10):
            return
        kind = draw(st.sampled_from(ANTHROPIC_GARBAGE))
        word = draw(WORDS)
        delta = {"type": "text_delta", "text": word}
        if kind == "noop":
            script.raw(draw(st.sampled_from(NOOP_FRAMES)))
        elif kind == "name only":  # the kind only in the event's name: still read
            data = {"index": 0, "delta": delta}
            script.named("content_block_delta", data, text=word, content=True)
        elif kind == "two data lines":
            line = dumps({"type": "content_block_delta", "index": 0, "delta": delta})
            cut = line.index(b'"delta"')
            lines = [b"event: content_block_delta", b"data: " + line[:cut], b"data: " + line[cut:]]
            script.frame(lines, text=word, content=True)
        elif kind == "delta without text":  # output all the same
            citation = {"type": "citations_delta", "citation": {"cited_text": "x"}}
            data = {"type": "content_block_delta", "index": 0, "delta": citation}
            script.named("content_block_delta", data, content=True)
        elif kind == "delta not an object":
            data = {"type": "content_block_delta", "index": 0, "delta": "x"}
            script.named("content_block_delta", data)
        elif kind == "negative usage":  # not taken
            data = {"type": "message_delta", "delta": {}, "usage": {"output_tokens": -3}}
            script.named("message_delta", data)
        elif kind == "nested usage":  # where no usage is read
            data = {"type": "ping", "usage": {"input_tokens": 1, "output_tokens": 1}}
            script.named("ping", data)
        else:  # the name says one thing, the data another: the data's type wins
            script.named("message_stop", {"type": "content_block_stop", "index": 0})

    if not sometimes(draw, 5):
        usage, reported = _anthropic_usage(draw, prompt, None)
        start = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": MODEL,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        script.named("message_start", {"type": "message_start", "message": start}, prompt=reported)
    if sometimes(draw, 30):
        script.named("ping", {"type": "ping"})
    garbage()
    kinds = draw(
        mostly(
            st.lists(
                st.sampled_from(["text", "text", "thinking", "tool_use"]), min_size=1, max_size=3
            ),
            st.just([]),
        )
    )
    # A tool's arguments larger than the meter holds, now and then.
    huge = sometimes(draw, 10)
    if huge and "tool_use" not in kinds:
        kinds.insert(draw(st.integers(0, len(kinds))), "tool_use")
    for index, kind in enumerate(kinds):
        block: dict[str, Any]
        if kind == "tool_use":
            name = draw(st.sampled_from(["get_weather", "f"]))
            block = {"type": "tool_use", "id": "toolu_1", "name": name, "input": {}}
            script.named(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
                text=name,
            )
            pieces = draw(st.lists(st.sampled_from(['{"city": ', '"Paris"', "}", ""]), max_size=3))
            if huge:
                pieces.insert(draw(st.integers(0, len(pieces))), HUGE_ARGUMENT)
                huge = False
            for piece in pieces:
                delta = {"type": "input_json_delta", "partial_json": piece}
                script.named(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    text=piece,
                    content=True,
                    oversized="when split" if piece is HUGE_ARGUMENT else "",
                )
                garbage()
        else:
            key = "text" if kind == "text" else "thinking"
            block = {"type": kind, key: ""}
            script.named(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
            for word in draw(SOME_WORDS):
                delta = {"type": f"{kind}_delta", key: word}
                script.named(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    text=word,
                    content=True,
                )
                garbage()
            if kind == "thinking" and draw(st.booleans()):
                delta = {"type": "signature_delta", "signature": "c2ln"}
                script.named(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
        script.named("content_block_stop", {"type": "content_block_stop", "index": index})
    if sometimes(draw, 8):  # the engine failed mid-stream: vLLM's error event ends it
        error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        script.named("error", error)
    else:
        if not sometimes(draw, 15):
            usage, reported = _anthropic_usage(draw, prompt, output)
            effect: dict[str, Any] = {"output": output}
            if sometimes(draw, 6):
                usage["output_tokens"] = draw(st.sampled_from(["5", -1, None, 2.0]))
                effect = {}
            if sometimes(draw, 50):  # Anthropic's own: the output only
                for key in (
                    "input_tokens",
                    "cache_read_input_tokens",
                    "cache_creation_input_tokens",
                ):
                    usage.pop(key, None)
            elif reported is not None:
                effect["prompt"] = reported
            delta = {"stop_reason": "end_turn", "stop_sequence": None}
            script.named(
                "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}, **effect
            )
        garbage()
        if not sometimes(draw, 20):
            script.named("message_stop", {"type": "message_stop"})
    if sometimes(draw, 8):
        script.unterminate(keep_newline=draw(st.booleans()))
    return script.answer(status, draw(SSE_TYPES))


def _anthropic_message(draw: st.DrawFn, status: int, prompt: int, output: int) -> Answer:
    content = draw(
        st.lists(
            TEXT_BLOCK
            | WORDS.map(lambda w: {"type": "thinking", "thinking": w, "signature": "c2ln"})
            | st.sampled_from([{"city": "Paris"}, {"note": '"usage": {"input_tokens": 1}'}]).map(
                lambda i: {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": i}
            ),
            max_size=3,
        )
    )
    document: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": content,
        "stop_reason": "end_turn",
        "stop_sequence": None,
    }
    content_type = draw(JSON_TYPES)
    usage: Any = None
    reported: int | None = None
    if not sometimes(draw, 15):  # else no usage at all: never free (the worst case)
        usage, reported = _anthropic_usage(draw, prompt, output)
        if sometimes(draw, 4):
            usage["output_tokens"] = draw(st.sampled_from(["5", -1, None]))
            reported = None
    if sometimes(draw, 25):
        # A tool's input holding a usage object (a client can steer a tool's input): only
        # the answer's own top-level usage counts, wherever the body is cut.
        numbers = {"input_tokens": 0, "output_tokens": 0}
        tool = {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"usage": numbers}}
        document["content"] = [*content, tool]
    if usage is None:
        body, usage_end = dumps(document), -1
    else:
        body, usage_end = json_with_usage(document, usage)
    return Answer(
        status,
        content_type,
        body,
        json_usage=None if reported is None else (reported, output),
        usage_end=usage_end,
    )


# --------------------------------------------------------------------------- Responses

RESPONSES_PATH = "/v1/responses"

INPUT_TEXT = WORDS.map(lambda w: {"type": "input_text", "text": w})
RESPONSES_ITEM = st.one_of(
    WORDS.map(lambda w: {"role": "user", "content": w}),
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.sampled_from(["user", "system", "developer"]),
            "content": WORDS | st.lists(INPUT_TEXT, min_size=1, max_size=2),
        }
    ),
    WORDS.map(
        lambda w: {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": w, "annotations": []}],
        }
    ),
    st.just(
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
    ),
    WORDS.map(lambda w: {"type": "function_call_output", "call_id": "call_1", "output": w}),
    st.just({"type": "custom_tool_call", "call_id": "call_2", "name": "run", "input": "ls"}),
    WORDS.map(lambda w: {"type": "custom_tool_call_output", "call_id": "call_2", "output": w}),
    WORDS.map(
        lambda w: {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": w}],
        }
    ),
)
ODD_RESPONSES_ITEM = st.sampled_from(
    [
        {"type": "item_reference", "id": "msg_1"},
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_audio"}]},
        {"role": "wizard", "content": "x"},
        {"type": "message", "content": "x"},
        {"type": "message", "role": "user"},
        {"type": "message", "role": "user", "content": 5},
        {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
        {"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]},
        {"type": "message", "role": "user", "content": ["x"]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "x"},
                {"type": "input_text", "text": "y"},
            ],
        },
        {"type": "message", "role": "assistant", "content": "x", "status": "in_progress"},
        {"type": "computer_call", "call_id": "c"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "mcp_call", "id": "m"},
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 5},
        {"type": "function_call_output", "call_id": "c"},
        {"type": "function_call_output", "output": "x"},
        {"type": "reasoning", "encrypted_content": "gAAAA"},
        {"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "x"}]},
        {"type": "reasoning", "summary": "x"},
        {"type": 5},
        {},
        "x",
        None,
    ]
)
RESPONSES_INPUT = (
    WORDS
    | st.lists(RESPONSES_ITEM, min_size=1, max_size=3)
    | st.lists(RESPONSES_ITEM | ODD_RESPONSES_ITEM, min_size=1, max_size=3)
    | st.sampled_from(["", [], None, {"role": "user", "content": "x"}])
    | ANY_JSON
)
RESPONSES_TOOLS_OK = [
    [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
    [{"type": "custom", "name": "run", "description": "Runs a command"}],
]
RESPONSES_TOOLS = st.sampled_from(
    [
        *RESPONSES_TOOLS_OK,
        [{"type": "web_search"}],
        [{"type": "web_search_preview"}],
        [{"type": "file_search", "vector_store_ids": ["vs_1"]}],
        [{"type": "code_interpreter", "container": {"type": "auto"}}],
        [{"type": "mcp", "server_label": "x", "server_url": "http://x"}],
        [{"type": "image_generation"}],
        [{"type": "namespace", "name": "ns", "tools": []}],
        [{"type": "custom", "name": "g", "format": {"type": "grammar", "definition": "x"}}],
        [{"type": "function"}],
        [{"name": "f"}],
        [{"type": "function", "name": "f", "parameters": "x"}],
        [{"type": "function", "function": {"name": "f"}}],
        [1],
        "f",
        {},
        [],
    ]
)
RESPONSES_TOOL_CHOICES = st.sampled_from(
    [
        "auto",
        "none",
        "required",
        {"type": "function", "name": "get_weather"},
        {"type": "function", "name": "nope"},
        {"type": "custom", "name": "run"},
        {"type": "allowed_tools", "mode": "auto", "tools": []},
        {"type": "allowed_tools", "mode": "x"},
        {"type": "web_search_preview"},
        {"type": 5},
        "sometimes",
        5,
    ]
)

# Every Responses body field kvgate reads, each with valid and odd values: the stateful
# ones (a stored conversation kvgate never counted) must be refused whatever they hold.
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": MODELS,
    "input": RESPONSES_INPUT,
    "instructions": WORDS | st.sampled_from(["", 5, ["x"], None]),
    "max_output_tokens": INTS | st.none(),
    "stream": STREAMS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "tools": RESPONSES_TOOLS | st.none(),
    "tool_choice": RESPONSES_TOOL_CHOICES | st.none(),
    "reasoning": st.sampled_from(
        [
            {"effort": "low"},
            {"effort": "high", "summary": "auto"},
            {"effort": "ultra"},
            {"effort": 5},
            {},
            "x",
            None,
        ]
    ),
    "text": st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            {"format": {"type": "json_schema", "schema": "x"}},
            {"format": {"type": "yaml"}},
            {"format": {}},
            {"format": "text"},
            "x",
            None,
        ]
    ),
    "store": st.booleans() | st.sampled_from(["no", None]),
    "include": st.sampled_from([[], ["reasoning.encrypted_content"], "x", None]),
    "metadata": st.sampled_from([{"k": "v"}, {}, "x", None]),
    "truncation": st.sampled_from(["auto", "disabled", 5]),
    "parallel_tool_calls": st.booleans() | st.just("x"),
    "user": st.sampled_from(["u-1", 5]),
    "chat_template_kwargs": CHAT_TEMPLATE_KWARGS | st.none(),
    "previous_response_id": st.sampled_from(["resp_1", "", 5, None]),
    "conversation": st.sampled_from(["conv_1", {"id": "conv_1"}, "", None]),
    "previous_input_messages": st.sampled_from([[], [{"role": "user", "content": "x"}], None]),
    "background": st.booleans() | st.sampled_from(["yes", None]),
    "prompt": st.sampled_from([{"id": "pmpt_1"}, "x", None]),
    "mm_processor_kwargs": st.sampled_from([{}, None]),
}
RESPONSES_CORE = ("model", "input", "max_output_tokens")
# Fields that make the prompt include a stored conversation: never admitted.
STATEFUL_FIELDS = ("previous_response_id", "conversation", "previous_input_messages")


def stateful(body: bytes) -> str | None:
    """The stateful field a Responses body carries (which kvgate must refuse), if any."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if type(document) is not dict:
        return None
    for name in STATEFUL_FIELDS:
        if document.get(name) is not None:
            return name
    if document.get("background") is True:
        return "background"
    items = document.get("input")
    if type(items) is list and any(
        type(item) is dict and item.get("type") == "item_reference" for item in items
    ):
        return "item_reference"
    return None


@st.composite
def responses_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A Responses body kvgate admits (when the limits allow)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "input": draw(WORDS | st.lists(RESPONSES_ITEM, min_size=1, max_size=3)),
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "instructions": WORDS,
        "max_output_tokens": st.integers(1, 400),
        "temperature": st.sampled_from([0, 0.7]),
        "top_p": st.just(0.9),
        "tools": st.sampled_from(RESPONSES_TOOLS_OK),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "reasoning": st.just({"effort": "low"}),
        "text": st.just({"format": {"type": "text"}}),
        "store": st.booleans(),
        "include": st.just([]),
        "metadata": st.just({"k": "v"}),
        "truncation": st.just("disabled"),
        "parallel_tool_calls": st.booleans(),
        "user": st.just("u-1"),
        "background": st.just(False),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        body[name] = draw(optional[name])
    if sometimes(draw, 60):  # without it, kvgate writes the cap it reserved
        body["max_output_tokens"] = draw(st.integers(1, 400))
    if sometimes(draw, 8):  # what an SDK's stateful conversation sends: refused
        name, value = draw(st.sampled_from(STATEFUL_REQUESTS))
        if name == "input":
            body["input"] = [{"role": "user", "content": "hi"}, value]
        else:
            body[name] = value
    body["stream"] = not sometimes(draw, 40)  # the richer grammar, a bit more often
    return body


STATEFUL_REQUESTS = [
    ("previous_response_id", "resp_68af4030592c81938ec0a5fbab4a3e9f"),
    ("conversation", "conv_689667905b048191b4740501625afd940c7533ace33a2dab"),
    ("conversation", {"id": "conv_1"}),
    ("previous_input_messages", [{"role": "user", "content": "earlier"}]),
    ("background", True),
    ("input", {"type": "item_reference", "id": "msg_1"}),
]


def _responses_usage(draw: st.DrawFn, prompt: int, output: int) -> tuple[Any, bool]:
    """A Responses usage object and whether kvgate may read it."""
    cached = draw(st.sampled_from([0, 0, 0, min(prompt, 64)]))
    reasoning = draw(st.sampled_from([0, 0, min(output, 5)]))
    usage: dict[str, Any] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }
    if sometimes(draw, 6):
        key = draw(st.sampled_from(["input_tokens", "output_tokens"]))
        usage[key] = draw(st.sampled_from(["12", -1, 1.5, True, None]))
        return usage, False
    return usage, True


def _response_object(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def _output_message(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


RESPONSES_GARBAGE = [
    *["noop"] * 4,
    "name only",
    "delta first",
    "two data lines",
    "delta not text",
    "error",
    "usage not the response's",
    "nested usage",
    "unreadable terminal usage",
]


def responses_error_body(status: int) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": "engine says no", "type": kind, "param": None, "code": status}
    return dumps({"error": error})


@st.composite
def responses_answers(draw: st.DrawFn, asked_stream: bool) -> Answer:
    status = draw(mostly(st.just(200), st.sampled_from([201, 400, 429, 500, 503])))
    streamed = asked_stream != sometimes(draw, 10)
    prompt, output = draw(st.integers(0, 3000)), draw(st.integers(0, 300))
    if status >= 400 and not (streamed and sometimes(draw, 50)):
        content_type = draw(st.sampled_from(["application/json", "text/plain"]))
        return Answer(status, content_type, responses_error_body(status))
    if not streamed:
        return _responses_body(draw, status, prompt, output)
    script = SseScript(draw(NEWLINES))
    sequence = iter(range(1000))

    def send(name: str, data: dict[str, Any], **effect: Any) -> None:
        script.named(name, {"type": name, "sequence_number": next(sequence), **data}, **effect)

    def garbage() -> None:
        """Now and then, an event a backend or a proxy may slip in, and what it bills."""
        if not sometimes(draw, 10):
            return
        kind = draw(st.sampled_from(RESPONSES_GARBAGE))
        word = draw(WORDS)
        if kind == "noop":
            script.raw(draw(st.sampled_from(NOOP_FRAMES)))
        elif kind == "name only":  # the kind only in the event's name: still read
            script.named("response.output_text.delta", {"delta": word}, text=word, content=True)
        elif kind == "delta first":  # the delta before the type, and no event name
            data = {"delta": word, "type": "response.reasoning_text.delta"}
            script.raw(b"data: " + dumps(data) + b"\n\n", text=word, content=True)
        elif kind == "two data lines":
            line = dumps({"type": "response.output_text.delta", "delta": word})
            cut = line.index(b'"delta"')
            script.frame([b"data: " + line[:cut], b"data: " + line[cut:]], text=word, content=True)
        elif kind == "delta not text":  # output all the same
            data = {"type": "response.output_text.delta", "delta": 5}
            script.named("response.output_text.delta", data, content=True)
        elif kind == "error":
            script.named("error", {"type": "error", "code": "server_error", "message": "boom"})
        elif kind == "usage not the response's":
            usage = {"input_tokens": 5, "output_tokens": 1}
            data = {"type": "response.in_progress", "response": {"usage": usage}}
            script.named("response.in_progress", data)
        elif kind == "nested usage":
            item = {"type": "message", "usage": {"input_tokens": 1, "output_tokens": 1}}
            data = {"type": "response.output_item.done", "item": item}
            script.named("response.output_item.done", data)
        else:  # a terminal event whose usage kvgate cannot read
            usage = {"input_tokens": "5", "output_tokens": 1}
            data = {"type": "response.failed", "response": {"usage": usage}}
            script.named("response.failed", data)

    send("response.created", {"response": _response_object("in_progress", []) | {"usage": None}})
    if draw(st.booleans()):
        send("response.in_progress", {"response": _response_object("in_progress", [])})
    garbage()
    output_items: list[dict[str, Any]] = []
    kinds = draw(
        mostly(
            st.lists(
                st.sampled_from(["message", "message", "reasoning", "call"]), min_size=1, max_size=3
            ),
            st.just([]),
        )
    )
    # A tool's arguments larger than the meter holds, now and then.
    huge = sometimes(draw, 10)
    if huge and "call" not in kinds:
        kinds.insert(draw(st.integers(0, len(kinds))), "call")
    for index, kind in enumerate(kinds):
        if kind == "call":
            item = {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "",
                "status": "in_progress",
            }
            send("response.output_item.added", {"output_index": index, "item": item})
            pieces = draw(st.lists(st.sampled_from(['{"city": ', '"Paris"', "}"]), max_size=3))
            if huge:
                pieces.insert(draw(st.integers(0, len(pieces))), HUGE_ARGUMENT)
                huge = False
            for piece in pieces:
                send(
                    "response.function_call_arguments.delta",
                    {"item_id": "fc_1", "output_index": index, "delta": piece},
                    text=piece,
                    content=True,
                    oversized="always" if piece is HUGE_ARGUMENT else "",
                )
                garbage()
            arguments = "".join(pieces)
            send(
                "response.function_call_arguments.done",
                {"item_id": "fc_1", "output_index": index, "arguments": arguments},
            )
            done = item | {"arguments": arguments, "status": "completed"}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_1", "summary": [], "content": []}
            send("response.output_item.added", {"output_index": index, "item": item})
            words = draw(SOME_WORDS)
            for word in words:
                send(
                    "response.reasoning_text.delta",
                    {"item_id": "rs_1", "output_index": index, "content_index": 0, "delta": word},
                    text=word,
                    content=True,
                )
                garbage()
            text = "".join(words)
            send(
                "response.reasoning_text.done",
                {"item_id": "rs_1", "output_index": index, "content_index": 0, "text": text},
            )
            done = item | {"content": [{"type": "reasoning_text", "text": text}]}
        else:
            item = {
                "type": "message",
                "id": "msg_1",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            send("response.output_item.added", {"output_index": index, "item": item})
            part = {"type": "output_text", "text": "", "annotations": []}
            send(
                "response.content_part.added",
                {"item_id": "msg_1", "output_index": index, "content_index": 0, "part": part},
            )
            words = draw(SOME_WORDS)
            for word in words:
                send(
                    "response.output_text.delta",
                    {
                        "item_id": "msg_1",
                        "output_index": index,
                        "content_index": 0,
                        "delta": word,
                        "logprobs": [],
                    },
                    text=word,
                    content=True,
                )
                garbage()
            text = "".join(words)
            send(
                "response.output_text.done",
                {"item_id": "msg_1", "output_index": index, "content_index": 0, "text": text},
            )
            done = _output_message(text)
        send("response.output_item.done", {"output_index": index, "item": done})
        output_items.append(done)
    ending = draw(st.sampled_from(["completed"] * 7 + ["incomplete", "failed", "none"]))
    if ending != "none":
        response = _response_object(ending, output_items)
        effect: dict[str, Any] = {}
        if ending == "failed" and draw(st.booleans()):
            response["usage"] = None
            response["error"] = {"code": "server_error", "message": "boom"}
        else:
            usage, readable = _responses_usage(draw, prompt, output)
            response["usage"] = usage
            if readable:
                effect = {"prompt": prompt, "output": output}
        if ending == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        send(f"response.{ending}", {"response": response}, **effect)
    garbage()
    if sometimes(draw, 8):
        script.unterminate(keep_newline=draw(st.booleans()))
    return script.answer(status, draw(SSE_TYPES))


def _responses_body(draw: st.DrawFn, status: int, prompt: int, output: int) -> Answer:
    text = "".join(draw(SOME_WORDS))
    document = _response_object("completed", [_output_message(text)])
    if sometimes(draw, 20):  # a usage nested where no usage is read
        document["metadata"] = {"usage": {"input_tokens": 0, "output_tokens": 0}}
    content_type = draw(JSON_TYPES)
    if sometimes(draw, 15):
        return Answer(status, content_type, dumps(document))
    usage, readable = _responses_usage(draw, prompt, output)
    # vLLM writes usage before input_messages and output_messages.
    trailer = draw(
        st.sampled_from(
            [
                None,
                {"user": None, "input_messages": None, "output_messages": None},
                {"output_messages": [{"usage": {"input_tokens": 0, "output_tokens": 0}}]},
            ]
        )
    )
    body, usage_end = json_with_usage(document, usage, trailer)
    return Answer(
        status,
        content_type,
        body,
        json_usage=(prompt, output) if readable else None,
        usage_end=usage_end,
    )


# --------------------------------------------------------------------------- the APIs


@dataclass(frozen=True)
class ApiGrammar:
    """One API's request grammar as the fuzz writes it."""

    name: str
    path: str
    fields: dict[str, st.SearchStrategy[Any]]
    core: tuple[str, ...]
    valid: st.SearchStrategy[dict[str, Any]]
    anthropic_errors: bool = False
    # Request headers its clients send besides the key.
    extra_headers: dict[str, st.SearchStrategy[bytes]] = field(default_factory=dict)


ANTHROPIC_HEADERS: dict[str, st.SearchStrategy[bytes]] = {
    "anthropic-version": st.sampled_from([b"2023-06-01", b"", b"1999"]),
    "anthropic-beta": st.sampled_from([b"prompt-caching-2024-07-31", b"x,y"]),
}
MESSAGES = ApiGrammar(
    "messages",
    MESSAGES_PATH,
    ANTHROPIC_FIELDS,
    ANTHROPIC_CORE,
    anthropic_valid_bodies(),
    anthropic_errors=True,
    extra_headers=ANTHROPIC_HEADERS,
)
COUNT_TOKENS = ApiGrammar(
    "count_tokens",
    COUNT_TOKENS_PATH,
    ANTHROPIC_FIELDS,
    COUNT_CORE,
    anthropic_valid_bodies(count=True),
    anthropic_errors=True,
    extra_headers=ANTHROPIC_HEADERS,
)
RESPONSES = ApiGrammar(
    "responses",
    RESPONSES_PATH,
    RESPONSES_FIELDS,
    RESPONSES_CORE,
    responses_valid_bodies(),
    extra_headers={"openai-beta": st.just(b"responses=v1")},
)
