"""The SSE filter on answers of any size.

Large events (logprobs, n, echo) must not stop the meter: usage is found inside
or after them, the injected usage event is still stripped, memory stays bounded,
and a cut stream keeps a per-event lower bound on output tokens.

The differential tests compare the incremental scan of large events (tiny
``max_event_bytes``, random chunk splits) with decoding every event whole.
"""

from __future__ import annotations

import itertools
import json
import random
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from kvgate.openai import SseStreamFilter, Usage

MiB = 1024 * 1024
CHUNK = 64 * 1024  # Envoy-sized body chunks
USAGE = {"prompt_tokens": 37, "total_tokens": 1037, "completion_tokens": 1000}


def dump(obj: dict[str, Any], rng: random.Random | None = None) -> str:
    if rng is None:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    seps = rng.choice([(",", ":"), (", ", ": ")])
    return json.dumps(obj, separators=seps, ensure_ascii=rng.random() < 0.5)


def chat_chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": "chatcmpl-9",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
    }
    obj.update(extra)
    return obj


def usage_event(usage: dict[str, Any] | None = None) -> str:
    return dump(chat_chunk([], usage=usage or USAGE))


def sse(*payloads: str) -> bytes:
    return "".join(f"data: {p}\n\n" for p in payloads).encode()


def chunks_of(data: bytes, size: int = CHUNK) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def top_logprobs(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [
        {"token": f"t{rng.randrange(99999)}", "logprob": -rng.random() * 9, "bytes": [116, 49]}
        for _ in range(n)
    ]


def logprobs_event(tokens: int, top: int = 20, seed: int = 0, **extra: Any) -> str:
    """A chat chunk carrying ``tokens`` merged tokens with ``top`` logprobs each."""
    rng = random.Random(seed)
    entries = [
        dump({"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": tops})
        for tops in (top_logprobs(rng, top) for _ in range(16))
    ]
    choice = {"index": 0, "delta": {"content": "x" * tokens}, "logprobs": {"content": []},
              "finish_reason": None}  # fmt: skip
    event = dump(chat_chunk([choice], **extra))
    content = ",".join(entries[i % 16] for i in range(tokens))
    return event.replace('"content":[]', '"content":[' + content + "]", 1)


# --------------------------------------------------------------------------- stream generator

TEXT_BITS = ["a", "b c", " ", "é", "世界", "🎉", '"', "\\", "\n", "\t", "usage", '"usage":{',
             "data: x", "\n\n", "{", "}", "[", "]", ",", ":", "\u2028", "\\u0041"]  # fmt: skip


def rand_text(rng: random.Random, long: bool = False) -> str:
    n = rng.choice([0, 1, 2, 5]) if not long else rng.randint(50, 400)
    return "".join(rng.choice(TEXT_BITS) for _ in range(n))


def rand_delta(rng: random.Random) -> dict[str, Any]:
    long = rng.random() < 0.3
    kind = rng.randrange(9)
    if kind == 0:
        return {"role": "assistant", "content": ""}
    if kind == 1:
        return {"content": ""}  # a decode step with no text (special token)
    if kind == 2:
        return {"reasoning_content": rand_text(rng, long)}
    if kind == 3:
        t = rand_text(rng, long)
        return {"reasoning": t, "reasoning_content": t}
    if kind == 4:
        name = rng.choice(["f", "", "get_weather"])
        call = {"index": 0, "id": "c1", "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip
        return {"tool_calls": [call]}
    if kind == 5:
        return {"tool_calls": [{"index": 0, "function": {"arguments": rand_text(rng, long)}}]}
    if kind == 6:
        return {"function_call": {"name": "legacy", "arguments": rand_text(rng)}}
    if kind == 7:
        return {}
    return {"content": rand_text(rng, long)}


def rand_chat_event(rng: random.Random) -> dict[str, Any]:
    choices = []
    for i in range(rng.choice([1, 1, 1, 2, 3])):
        choice: dict[str, Any] = {"index": i, "delta": rand_delta(rng), "finish_reason": None}
        if rng.random() < 0.4:
            choice["logprobs"] = {"content": [
                {"token": rand_text(rng), "logprob": -1.5, "bytes": [1, 2],
                 "top_logprobs": top_logprobs(rng, rng.randint(0, 20))}
                for _ in range(rng.randint(1, 6))
            ]}  # fmt: skip
        else:
            choice["logprobs"] = None
        choices.append(choice)
    obj = chat_chunk(choices)
    if rng.random() < 0.3:  # continuous_usage_stats
        obj["usage"] = {"prompt_tokens": 5, "completion_tokens": rng.randint(0, 99),
                        "total_tokens": 0}  # fmt: skip
    elif rng.random() < 0.2:
        obj["usage"] = None
    if rng.random() < 0.1:
        obj["nested"] = {"usage": {"prompt_tokens": 999999, "completion_tokens": 1}}
    return obj


def rand_completion_event(rng: random.Random) -> dict[str, Any]:
    choices = []
    for i in range(rng.choice([1, 1, 2])):
        logprobs = None
        if rng.random() < 0.5:
            # Legacy completions logprobs: top_logprobs are dicts keyed by token text.
            tops = [{rand_text(rng) or "usage": -0.1, "usage": -0.2} for _ in range(3)]
            logprobs = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": tops,
                        "text_offset": [0]}  # fmt: skip
        choices.append({"index": i, "text": rand_text(rng, rng.random() < 0.3),
                        "logprobs": logprobs, "finish_reason": None})  # fmt: skip
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": choices}  # fmt: skip


def rand_stream(rng: random.Random, final_usage: bool) -> bytes:
    completions = rng.random() < 0.3
    parts: list[str] = []
    for _ in range(rng.randint(1, 12)):
        obj = rand_completion_event(rng) if completions else rand_chat_event(rng)
        payload = dump(obj, rng)
        eol = rng.choice(["\n", "\n", "\r\n"])
        r = rng.random()
        if r < 0.1:
            parts.append(f": keep-alive{eol}{eol}")
        if r < 0.15:
            # Two data lines, split where the top-level "choices" key starts.
            i = payload.index('"choices"')
            parts.append(f"event: message{eol}data: {payload[:i]}{eol}data:{payload[i:]}{eol}{eol}")
        else:
            parts.append(f"data: {payload}{eol}{eol}")
    if rng.random() < 0.1:
        err = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
        parts.append(f"data: {dump(err)}\n\n")
    if final_usage:
        details = {"cached_tokens": 3} if rng.random() < 0.5 else None
        usage = dict(USAGE, prompt_tokens_details=details)
        parts.append(f"data: {usage_event(usage)}\n\n")
    if rng.random() < 0.9:
        parts.append("data: [DONE]\n\n")
    return "".join(parts).encode()


def split_random(rng: random.Random, data: bytes) -> list[bytes]:
    if len(data) < 2:
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 60))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def run(f: SseStreamFilter, chunks: list[bytes] | Iterator[bytes]) -> bytes:
    out = [f.feed(c) for c in chunks]
    out.append(f.finish())
    return b"".join(out)


def held(f: SseStreamFilter) -> int:
    # getattr: the same tests also run against the old filter (see the commit).
    return getattr(f, "buffered_bytes", 0)


def state(f: SseStreamFilter) -> dict[str, Any]:
    return {
        "usage": f.usage,
        "text": f.output_text(),
        "truncated": getattr(f, "output_text_truncated", None),
        "content_events": getattr(f, "content_events", None),
        "events_seen": f.events_seen,
        "done": f.done,
        "error": f.error,
        "stripped": f.stripped_events,
        "malformed": f.malformed_events,
    }


@pytest.mark.parametrize("with_text_cap", [False, True])
@pytest.mark.parametrize("strip", [False, True])
def test_differential_large_path_random_splits(strip: bool, with_text_cap: bool) -> None:
    """Incremental scan (small cap, random splits) == decoding each event whole."""
    rng = random.Random(20261201 + strip + 2 * with_text_cap)
    large_seen = 0
    for case in range(400):
        stream = rand_stream(rng, final_usage=rng.random() < 0.8)
        kw: dict[str, Any] = {}
        if with_text_cap:
            kw["max_text_chars"] = rng.randint(0, 3000)
        ref = SseStreamFilter(strip_usage_event=strip, max_event_bytes=10**9, **kw)
        expected_out = run(ref, [stream])
        # Above the usage event's size (~200 bytes) so that it stays strippable.
        cap = rng.choice([300, 512, 2048])
        f = SseStreamFilter(strip_usage_event=strip, max_event_bytes=cap, **kw)
        out = []
        for c in split_random(rng, stream):
            out.append(f.feed(c))
            assert held(f) <= cap + 16 * 1024
        out.append(f.finish())
        assert b"".join(out) == expected_out, case
        assert state(f) == state(ref), case
        large_seen += f.large_events
        assert ref.large_events == 0
    assert large_seen > 500  # the incremental path was really exercised


def test_same_result_whatever_the_chunking() -> None:
    rng = random.Random(7)
    for _ in range(100):
        stream = rand_stream(rng, final_usage=True)
        whole = SseStreamFilter(strip_usage_event=True, max_event_bytes=400)
        expected = run(whole, [stream])
        for _ in range(5):
            f = SseStreamFilter(strip_usage_event=True, max_event_bytes=400)
            assert run(f, split_random(rng, stream)) == expected
            assert state(f) == state(whole)


# --------------------------------------------------------------------------- hole 3


def huge_stream(event: str, *, n_small: int = 3) -> bytes:
    small = [dump(chat_chunk([{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]))]
    return sse(*(small * n_small), event, *(small * n_small), usage_event(), "[DONE]")


@pytest.mark.parametrize("strip", [False, True])
def test_usage_found_and_stripped_after_a_20mib_content_event(strip: bool) -> None:
    big = dump(chat_chunk([{"index": 0, "delta": {"content": "y" * (20 * MiB)}}]))
    stream = huge_stream(big)
    f = SseStreamFilter(strip_usage_event=strip)
    peak = 0
    out = []
    for c in chunks_of(stream):
        out.append(f.feed(c))
        peak = max(peak, held(f))
    out.append(f.finish())
    expected = stream.replace(sse(usage_event()), b"") if strip else stream
    assert b"".join(out) == expected  # forwarded byte for byte, usage event removed whole
    assert f.usage == Usage(37, 1000)
    assert f.stripped_events == (1 if strip else 0)
    assert peak <= 64 * 1024
    assert f.content_events == 7
    assert f.output_text_truncated and len(f.output_text()) == 1024 * 1024


def test_usage_found_after_a_huge_logprobs_event_in_one_chunk() -> None:
    # ~20 MiB of logprobs (vLLM merged 15k tokens into one event), in one chunk
    # together with the usage event: the filter must not buffer the whole chunk.
    big = logprobs_event(15_000, top=20)
    assert len(big) > 18 * MiB
    stream = huge_stream(big)
    f = SseStreamFilter(strip_usage_event=True)
    out = f.feed(stream) + f.finish()
    assert f.usage == Usage(37, 1000)
    assert out == stream.replace(sse(usage_event()), b"")
    assert f.large_events == 1
    assert f.output_text() == "ok" * 3 + "x" * 15_000 + "ok" * 3
    assert f.buffered_bytes == 0


def test_usage_inside_a_huge_event_continuous_stats() -> None:
    # continuous_usage_stats: usage rides on every chunk; the stream is cut before
    # any usage-only event, so the big chunk's usage is the only one there is.
    usage = {"prompt_tokens": 37, "completion_tokens": 6000, "total_tokens": 6037,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
    stream = sse(logprobs_event(6000, top=20, usage=usage))  # ~8 MiB
    assert len(stream) > 7 * MiB
    for size in (4096, CHUNK, 1, len(stream)):
        f = SseStreamFilter(strip_usage_event=True)
        if size == 1:  # byte by byte through the start, then the rest in one piece
            chunks = [*chunks_of(stream[:30_000], 1), stream[30_000:]]
        else:
            chunks = list(chunks_of(stream, size))
        out = run(f, chunks)
        assert f.usage == Usage(37, 6000, 32)
        assert out == stream  # not usage-only: forwarded
        assert f.content_events == 1


def test_injected_usage_event_never_leaks_after_huge_events_any_split() -> None:
    big = logprobs_event(300, top=20)  # ~700 KB
    stream = sse(big, big) + sse(usage_event()) + sse("[DONE]")
    expected = sse(big, big, "[DONE]")
    rng = random.Random(3)
    for _ in range(20):
        f = SseStreamFilter(strip_usage_event=True)
        out = []
        for c in split_random(rng, stream):
            out.append(f.feed(c))
            assert held(f) <= 64 * 1024
        out.append(f.finish())
        assert b"".join(out) == expected
        assert f.usage == Usage(37, 1000) and f.stripped_events == 1


def test_memory_stays_bounded_on_a_20mib_event() -> None:
    """tracemalloc: what the filter allocates does not grow with the event."""
    head = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
    rng = random.Random(1)
    entry = dump({"token": "x", "logprob": -0.1, "bytes": [120],
                  "top_logprobs": top_logprobs(rng, 20)}).encode()  # fmt: skip
    piece = b",".join([entry] * 64)
    pieces = (20 * MiB) // len(piece)

    def chunks() -> Iterator[bytes]:  # generated lazily: the test holds one chunk at a time
        yield head + b'"logprobs":{"content":['
        for i in range(pieces):
            yield (b"," if i else b"") + piece
        yield b']},"delta":{"content":"z"}}]}\n\n' + sse(usage_event(), "[DONE]")

    f = SseStreamFilter(strip_usage_event=True)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out_bytes = 0
        tail = b""
        for c in chunks():
            out = f.feed(c)
            out_bytes += len(out)
            tail = (tail + out)[-200:]
            del out
        tail += f.finish()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert f.usage == Usage(37, 1000)
    assert tail.endswith(b"data: [DONE]\n\n") and b"usage" not in tail
    assert out_bytes > 20 * MiB - 100_000
    assert f.output_text() == "z" and f.content_events == 1
    assert peak < 2 * MiB, peak  # chunks are ~64 KiB; the event is 20 MiB


# --------------------------------------------------------------------------- hole 11


def test_content_events_count_empty_decode_steps() -> None:
    # logit_bias towards special tokens: vLLM still sends one event per step,
    # with empty content. Each is an output token at least.
    role = chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    empty = chat_chunk([{"index": 0, "delta": {"content": ""}, "finish_reason": None}])
    stop = chat_chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    stream = sse(dump(role), *[dump(empty)] * 50, dump(stop))
    for cap in (64 * 1024, 100):  # decoded whole, and scanned incrementally
        f = SseStreamFilter(max_event_bytes=cap)
        run(f, chunks_of(stream, 33))
        assert f.output_text() == ""  # counting text alone books 0 output tokens
        assert f.content_events == 51
        assert f.usage is None


def test_content_events_completions_and_n() -> None:
    def ev(*texts: str) -> str:
        return dump({"id": "c", "object": "text_completion", "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": None}
            for i, t in enumerate(texts)]})  # fmt: skip

    stream = sse(ev("", ""), ev("a"), ev("", "b"), usage_event(), "[DONE]")
    f = SseStreamFilter(strip_usage_event=True)
    run(f, [stream])
    assert f.content_events == 3  # events, not choices
    assert f.output_text() == "ab"


def test_output_text_is_capped() -> None:
    piece = dump(chat_chunk([{"index": 0, "delta": {"content": "é" * 1000}}]))
    stream = sse(*[piece] * 3000)  # 3M characters
    f = SseStreamFilter()  # the default cap: 1 Mi characters
    run(f, chunks_of(stream))
    assert len(f.output_text()) == 1024 * 1024
    assert f.output_text_truncated
    assert f.content_events == 3000


def test_huge_text_decoded_across_chunks_with_escapes_and_surrogates() -> None:
    text = ('\\ "q" 🎉 é\n' * 30_000)[:-1]
    payload = json.dumps(chat_chunk([{"index": 0, "delta": {"content": text}}]))  # ASCII escapes
    stream = sse(payload)
    rng = random.Random(5)
    for _ in range(5):
        f = SseStreamFilter(max_event_bytes=1024)
        run(f, split_random(rng, stream))
        assert f.output_text() == text
        assert not f.output_text_truncated
        g = SseStreamFilter(max_event_bytes=1024, max_text_chars=12_345)
        run(g, split_random(rng, stream))
        assert g.output_text() == text[:12_345] and g.output_text_truncated
