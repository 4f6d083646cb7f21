"""Usage extraction from non-streaming response bodies."""

from __future__ import annotations

import itertools
import json
import random
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.openai import JsonUsageScanner, Usage, usage_from_json_body, usage_from_mapping

MiB = 1024 * 1024

# A non-streaming chat response as vLLM's OpenAI server serialises it (field order
# and nulls included).
VLLM_CHAT_BODY = (
    b'{"id":"chatcmpl-8f0c","object":"chat.completion","created":1732900000,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","reasoning_content":null,'
    b'"content":"Hello! How can I help?","tool_calls":[]},"logprobs":null,'
    b'"finish_reason":"stop","stop_reason":null}],'
    b'"usage":{"prompt_tokens":21,"total_tokens":28,"completion_tokens":7,'
    b'"prompt_tokens_details":null},"prompt_logprobs":null,"kv_transfer_params":null}'
)

VLLM_COMPLETION_BODY = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null,"prompt_logprobs":null}],'
    b'"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":2}},"kv_transfer_params":null}'
)

# OpenAI puts fields after usage, pretty-printed with spaces.
OPENAI_BODY = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
        "usage": {
            "prompt_tokens": 19,
            "completion_tokens": 10,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 16, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_1",
    },
    indent=2,
).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (VLLM_CHAT_BODY, Usage(21, 7, 0)),
        (VLLM_COMPLETION_BODY, Usage(3, 2, 2)),
        (OPENAI_BODY, Usage(19, 10, 16)),
    ],
)
def test_usage_from_body(body: bytes, expected: Usage) -> None:
    assert usage_from_json_body(body) == expected
    # Same answer as a plain full parse (the fast path must not change results).
    assert usage_from_mapping(json.loads(body)["usage"]) == expected


def test_total_tokens() -> None:
    assert Usage(3, 4).total_tokens == 7


def test_usage_text_inside_content_is_not_mistaken_for_usage() -> None:
    # The content talks about usage (escaped quotes) and is placed after the real
    # usage object to defeat a naive "last occurrence" search.
    body = json.dumps(
        {
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
            "choices": [
                {"message": {"content": 'fake "usage": {"prompt_tokens": 999} and "usage"'}}
            ],
        }
    ).encode()
    assert usage_from_json_body(body) == Usage(5, 1)


def test_key_named_usage_in_logprobs_is_skipped() -> None:
    # Legacy completions logprobs map token strings to numbers: a token "usage" is a key.
    body = json.dumps(
        {
            "choices": [{"text": "x", "logprobs": {"top_logprobs": [{"usage": -0.1}]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1},
            "extra": [{"usage": -0.5}, {'"usage': -0.2}],
        }
    ).encode()
    assert usage_from_json_body(body) == Usage(2, 1)


NO_USAGE_BODIES = [
    b"",
    b"not json",
    b"[1,2]",
    b'{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}',
    b'{"object":"error","message":"x","type":"BadRequestError","param":null,"code":400}',
    b'{"id":"x","usage":null}',
    b'{"usage":{"prompt_tokens":"3","completion_tokens":1}}',
    b'{"usage":{"prompt_tokens":true,"completion_tokens":1}}',
    b'{"usage":{"prompt_tokens":-1,"completion_tokens":1}}',
    b'{"usage":{"completion_tokens":1}}',
    b'{"usage":{"prompt_tokens":1,"completion_tokens":1.5}}',
    b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1',  # truncated
    b"\xff\xfe",
]


@pytest.mark.parametrize("body", NO_USAGE_BODIES)
def test_no_usage(body: bytes) -> None:
    assert usage_from_json_body(body) is None


def test_lenient_fields() -> None:
    # completion_tokens may be null/absent (vLLM's UsageInfo allows it); malformed
    # cached_tokens are ignored rather than discarding the whole usage.
    assert usage_from_mapping({"prompt_tokens": 4}) == Usage(4, 0)
    assert usage_from_mapping({"prompt_tokens": 4, "completion_tokens": None}) == Usage(4, 0)
    assert usage_from_mapping(
        {
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": "x"},
        }
    ) == Usage(4, 1, 0)
    assert usage_from_mapping(None) is None
    assert usage_from_mapping([1]) is None


# --------------------------------------------------------------------------- JsonUsageScanner

TRICKY_BODIES = [
    # "usage" in content (escaped quotes), after the real usage.
    json.dumps(
        {
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
            "choices": [{"message": {"content": 'fake "usage": {"prompt_tokens": 999} "usage"'}}],
        }
    ).encode(),
    # A key named usage in legacy logprobs, before and after the real one.
    json.dumps(
        {
            "choices": [{"text": "x", "logprobs": {"top_logprobs": [{"usage": -0.1}]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1},
            "extra": [{"usage": -0.5}, {'"usage': -0.2}],
        }
    ).encode(),
    # Backslashes right before quotes, non-ASCII, usage first.
    json.dumps(
        {
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
            "choices": [{"message": {"content": 'a\\"usage\\\\": {"prompt_tokens": 1} 世界 🎉'}}],
        },
        ensure_ascii=False,
    ).encode(),
]


def scan(chunks: list[bytes], hold: int = 0) -> Usage | None:
    # hold=0: scan incrementally from the first byte (the path of large bodies).
    s = JsonUsageScanner(hold_bytes=hold)
    for c in chunks:
        s.feed(c)
        assert s.buffered_bytes <= 16 * 1024 + hold
    assert s.scanning == (s.bytes_seen > hold)
    assert s.usage == s.finish()
    return s.finish()


@pytest.mark.parametrize(
    "body",
    [VLLM_CHAT_BODY, VLLM_COMPLETION_BODY, OPENAI_BODY, *TRICKY_BODIES, *NO_USAGE_BODIES],
)
def test_scanner_matches_usage_from_json_body_at_every_split(body: bytes) -> None:
    expected = usage_from_json_body(body)
    assert scan([body]) == expected
    assert scan([body], hold=64 * 1024) == expected
    assert scan([body[:5], body[5:]], hold=20) == expected  # held, then scanned
    for i in range(len(body) + 1):
        assert scan([body[:i], body[i:]]) == expected, i
    assert scan([body[i : i + 1] for i in range(len(body))]) == expected


def rand_body(rng: random.Random) -> tuple[bytes, Usage | None]:
    words = ["usage", '"usage":', '{"prompt_tokens": 9}', "\\", '"', "é", "🎉", "\n", "x y"]

    def text() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 8)))

    choices = []
    for i in range(rng.randint(1, 3)):
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": text()}}
        if rng.random() < 0.5:
            choice["logprobs"] = {"content": [
                {"token": text(), "logprob": -1.0, "bytes": [1],
                 "top_logprobs": [{"token": text(), "logprob": -2.0}] * rng.randint(0, 5)}
            ], "top_logprobs": [{"usage": -0.3, text(): -0.1}]}  # fmt: skip
        choices.append(choice)
    usage: dict[str, Any] | None = None
    if rng.random() < 0.9:
        usage = {"prompt_tokens": rng.randint(0, 10**6), "completion_tokens": rng.randint(0, 10**5)}
        if rng.random() < 0.5:
            usage["prompt_tokens_details"] = rng.choice([None, {"cached_tokens": 5}])
    nested = {"usage": {"prompt_tokens": 1}}
    items: list[tuple[str, Any]] = [("id", "chatcmpl-" + text()), ("object", "chat.completion"),
                                    ("choices", choices), ("nested", nested),
                                    ("usage", usage), ("service_tier", None)]  # fmt: skip
    rng.shuffle(items)
    indent = rng.choice([None, None, 2])
    body = json.dumps(dict(items), indent=indent, ensure_ascii=rng.random() < 0.5).encode()
    return body, usage_from_mapping(usage)


def test_scanner_random_bodies_random_splits() -> None:
    rng = random.Random(9)
    for _ in range(500):
        body, truth = rand_body(rng)
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 40))))
        bounds = [0, *cuts, len(body)]
        chunks = [body[a:b] for a, b in itertools.pairwise(bounds)]
        assert scan(chunks) == truth, body
        assert scan(chunks, hold=rng.randint(0, len(body))) == truth, body


def test_scanner_key_and_escape_split_across_chunks() -> None:
    chunks = [b'{"choices":[{"message":{"content":"a\\', b'"usage\\', b'":{}"}}],"usa',
              b'ge"', b" :", b' {"prompt_tokens":3,"prompt_tokens_details":{"cached_',
              b'tokens":2},"completion_tokens":1}}']  # fmt: skip
    assert usage_from_json_body(b"".join(chunks)) == Usage(3, 1, 2)
    assert scan(chunks) == Usage(3, 1, 2)


def test_scanner_ignores_an_oversized_usage_value() -> None:
    body = b'{"usage":{"prompt_tokens":3,"completion_tokens":1,"pad":"' + b"p" * 100_000 + b'"}}'
    assert scan([body[i : i + 4096] for i in range(0, len(body), 4096)]) is None


@pytest.mark.parametrize("usage_first", [False, True])
def test_scanner_20mib_body_bounded_memory(usage_first: bool) -> None:
    # A non-streamed answer with n and logprobs far above the 8 MiB response
    # buffer: the old path (buffer, then usage_from_json_body) dropped it and
    # booked 0 output tokens.
    usage = b'"usage":{"prompt_tokens":11,"completion_tokens":40000,"total_tokens":40011}'
    top = [{"token": "y", "logprob": -1.0, "bytes": [121]}] * 20
    entry = json.dumps({"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": top})
    piece = (entry + ",") * 100
    n_pieces = (20 * MiB) // len(piece) + 1

    def chunks() -> Iterator[bytes]:
        yield b'{"id":"x",' + (usage + b"," if usage_first else b"")
        yield b'"choices":[{"index":0,"message":{"content":"usage"},"logprobs":{"content":['
        for _ in range(n_pieces):
            yield piece.encode()
        yield entry.encode() + b"]}}]" + (b"" if usage_first else b"," + usage) + b"}"

    s = JsonUsageScanner()  # default hold: 64 KiB
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for c in chunks():
            s.feed(c)
            assert s.buffered_bytes <= 16 * 1024 or not s.scanning
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert s.finish() == Usage(11, 40000)
    assert s.bytes_seen > 20 * MiB
    assert peak < MiB, peak
