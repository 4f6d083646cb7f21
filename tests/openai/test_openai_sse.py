"""The SSE stream filter: framing across arbitrary chunking, usage, text, stripping."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable
from typing import Any

import pytest

from kvgate.openai import SseStreamFilter, Usage


def chunk_json(choices: list[dict[str, Any]], **extra: Any) -> str:
    obj: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": choices,
    }
    obj.update(extra)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def delta(content: str | None = None, finish: str | None = None, **fields: Any) -> dict:
    d: dict[str, Any] = dict(fields)
    if content is not None:
        d["content"] = content
    return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}


ROLE_EVENT = (
    '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}]}'
)
PIECES = ["Hel", "lo", ", wörld", " 世界", " 🎉", "!"]
USAGE_EVENT = chunk_json(
    [], usage={"prompt_tokens": 12, "total_tokens": 18, "completion_tokens": 6}
)
EXPECTED_USAGE = Usage(12, 6, 0)


def events_to_stream(payloads: Iterable[str], eol: str = "\n") -> bytes:
    return "".join(f"data: {p}{eol}{eol}" for p in payloads).encode()


def vllm_chat_payloads(with_usage: bool = True) -> list[str]:
    payloads = [ROLE_EVENT]
    payloads += [chunk_json([delta(p)]) for p in PIECES]
    payloads.append(chunk_json([delta("", "stop")]))
    if with_usage:
        payloads.append(USAGE_EVENT)
    payloads.append("[DONE]")
    return payloads


def usage_event_bytes(eol: str = "\n") -> bytes:
    return f"data: {USAGE_EVENT}{eol}{eol}".encode()


STREAM_LF = events_to_stream(vllm_chat_payloads())
STREAM_CRLF = events_to_stream(vllm_chat_payloads(), "\r\n")
TEXT = "".join(PIECES)


def run(f: SseStreamFilter, chunks: Iterable[bytes]) -> bytes:
    out = [f.feed(c) for c in chunks]
    out.append(f.finish())
    return b"".join(out)


def split_at(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def assert_tracked(f: SseStreamFilter, events: int) -> None:
    assert f.usage == EXPECTED_USAGE
    assert f.output_text() == TEXT
    assert f.done is True
    assert f.events_seen == events
    assert f.malformed_events == 0
    assert f.error is None
    # Six text pieces and the empty stop delta; the role announcement is no decode step.
    assert f.content_events == len(PIECES) + 1
    assert not f.output_text_truncated
    assert f.buffered_bytes == 0


N_EVENTS = len(vllm_chat_payloads())


# --------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("stream", [STREAM_LF, STREAM_CRLF], ids=["lf", "crlf"])
def test_pass_through_split_at_every_byte(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        f = SseStreamFilter()
        chunks = split_at(stream, [cut])
        outs = [f.feed(c) for c in chunks]
        # Without stripping every chunk is forwarded as the very same object.
        assert all(o is c for o, c in zip(outs, chunks, strict=True))
        assert f.finish() == b""
        assert_tracked(f, N_EVENTS)


@pytest.mark.parametrize("stream", [STREAM_LF, STREAM_CRLF], ids=["lf", "crlf"])
def test_strip_split_at_every_byte(stream: bytes) -> None:
    eol = "\r\n" if stream is STREAM_CRLF else "\n"
    expected = stream.replace(usage_event_bytes(eol), b"")
    assert len(expected) == len(stream) - len(usage_event_bytes(eol))
    for cut in range(len(stream) + 1):
        f = SseStreamFilter(strip_usage_event=True)
        assert run(f, split_at(stream, [cut])) == expected, cut
        assert_tracked(f, N_EVENTS)
        assert f.stripped_events == 1


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("stream", [STREAM_LF, STREAM_CRLF], ids=["lf", "crlf"])
def test_one_byte_chunks(stream: bytes, strip: bool) -> None:
    f = SseStreamFilter(strip_usage_event=strip)
    out = run(f, [stream[i : i + 1] for i in range(len(stream))])
    eol = "\r\n" if stream is STREAM_CRLF else "\n"
    assert out == (stream.replace(usage_event_bytes(eol), b"") if strip else stream)
    assert_tracked(f, N_EVENTS)


@pytest.mark.parametrize("strip", [False, True])
def test_random_multi_splits(strip: bool) -> None:
    rng = random.Random(1234)
    for stream, eol in ((STREAM_LF, "\n"), (STREAM_CRLF, "\r\n")):
        expected = stream.replace(usage_event_bytes(eol), b"") if strip else stream
        for _ in range(300):
            cuts = rng.sample(range(1, len(stream)), rng.randint(1, 40))
            f = SseStreamFilter(strip_usage_event=strip)
            assert run(f, split_at(stream, cuts)) == expected
            assert_tracked(f, N_EVENTS)


def test_every_two_cut_pair_on_the_tail() -> None:
    # All pairs of cuts around the usage event and [DONE], where stripping happens.
    stream = STREAM_CRLF
    expected = stream.replace(usage_event_bytes("\r\n"), b"")
    tail_start = stream.index(b"data: " + USAGE_EVENT.encode()) - 4
    for a in range(tail_start, len(stream)):
        for b in range(a, len(stream) + 1, 3):
            f = SseStreamFilter(strip_usage_event=True)
            assert run(f, split_at(stream, [a, b])) == expected
            assert f.usage == EXPECTED_USAGE and f.done


def test_whole_event_chunks_are_not_delayed() -> None:
    # vLLM writes one event per chunk: with stripping, each is forwarded at once.
    chunks = [f"data: {p}\n\n".encode() for p in vllm_chat_payloads()]
    f = SseStreamFilter(strip_usage_event=True)
    for c in chunks:
        out = f.feed(c)
        if c == usage_event_bytes():
            assert out == b""
        else:
            assert out is c
    assert f.finish() == b""
    assert_tracked(f, N_EVENTS)


def test_many_events_in_one_chunk() -> None:
    f = SseStreamFilter(strip_usage_event=True)
    assert f.feed(STREAM_LF) == STREAM_LF.replace(usage_event_bytes(), b"")
    assert f.finish() == b""
    assert_tracked(f, N_EVENTS)


def test_partial_tail_is_held_only_when_stripping() -> None:
    first = f"data: {ROLE_EVENT}\n\ndata: {chunk_json([delta('Hel')])[:20]}".encode()
    f = SseStreamFilter(strip_usage_event=True)
    assert f.feed(first) == f"data: {ROLE_EVENT}\n\n".encode()
    g = SseStreamFilter()
    assert g.feed(first) is first


# --------------------------------------------------------------------------- content


def test_stream_without_usage() -> None:
    stream = events_to_stream(vllm_chat_payloads(with_usage=False))
    f = SseStreamFilter(strip_usage_event=True)
    assert run(f, [stream]) == stream
    assert f.usage is None
    assert f.output_text() == TEXT
    assert f.done and f.stripped_events == 0


def test_usage_null_on_every_chunk_and_continuous_stats() -> None:
    # Older vLLM sends "usage": null on each chunk when include_usage is set; with
    # continuous_usage_stats each chunk carries running usage. Only the final
    # usage-only event is stripped; the last usage seen wins.
    payloads = [
        chunk_json([delta("a")], usage=None),
        chunk_json([delta("b")], usage={"prompt_tokens": 12, "completion_tokens": 1}),
        chunk_json([delta("", "stop")], usage={"prompt_tokens": 12, "completion_tokens": 2}),
        chunk_json([], usage={"prompt_tokens": 12, "completion_tokens": 2,
                              "prompt_tokens_details": {"cached_tokens": 8}}),
        "[DONE]",
    ]  # fmt: skip
    stream = events_to_stream(payloads)
    f = SseStreamFilter(strip_usage_event=True)
    out = run(f, split_at(stream, range(7, len(stream), 13)))
    assert out == events_to_stream(payloads[:3] + payloads[4:])
    assert f.usage == Usage(12, 2, 8)
    assert f.output_text() == "ab"
    assert f.stripped_events == 1


def test_completions_stream() -> None:
    def event(text: str, finish: str | None = None) -> str:
        return json.dumps(
            {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                          "stop_reason": None}]},
            separators=(",", ":"),
        )  # fmt: skip

    usage = json.dumps(
        {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
        separators=(",", ":"),
    )  # fmt: skip
    payloads = [event(" one"), event(" two"), event(" three", "length"), usage, "[DONE]"]
    stream = events_to_stream(payloads)
    for cut in range(len(stream) + 1):
        f = SseStreamFilter(strip_usage_event=True)
        assert run(f, split_at(stream, [cut])) == events_to_stream([*payloads[:3], "[DONE]"])
        assert f.usage == Usage(4, 3)
        assert f.output_text() == " one two three"
        assert f.done and f.events_seen == 5


def test_n_greater_than_one_text_from_all_choices() -> None:
    payloads = [
        chunk_json(
            [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "x"}}]
        ),
        chunk_json([{"index": 1, "delta": {"content": "y"}}]),
    ]
    f = SseStreamFilter()
    run(f, [events_to_stream(payloads)])
    assert f.output_text() == "axy"


def test_tool_calls_and_reasoning_are_counted() -> None:
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    payloads = [
        chunk_json([delta(reasoning_content="think ")]),
        # Newer vLLM may send both names with the same text: counted once.
        chunk_json([delta(reasoning="more ", reasoning_content="more ")]),
        chunk_json([delta(tool_calls=[call])]),
        chunk_json([delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city":'}}])]),
        chunk_json([delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}])]),
        chunk_json([delta(function_call={"name": "legacy", "arguments": "{}"})]),
        chunk_json([delta(None, "tool_calls")]),
    ]
    f = SseStreamFilter()
    run(f, [events_to_stream(payloads)])
    assert f.output_text() == 'think more get_weather{"city":"Paris"}legacy{}'


def test_track_text_false_still_finds_and_strips_usage() -> None:
    f = SseStreamFilter(strip_usage_event=True, track_text=False)
    assert run(f, split_at(STREAM_LF, [100, 200, 900])) == STREAM_LF.replace(
        usage_event_bytes(), b""
    )
    assert f.usage == EXPECTED_USAGE
    assert f.text_parts == []
    assert f.done and f.events_seen == N_EVENTS


def test_multiline_data_comments_and_other_fields() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 1}
    stream = (
        b": keep-alive comment\n\n"
        b"event: message\nid: 7\nretry: 1000\n"
        b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"hi"}}]}\n\n'
        b'dataset: not data\ndata:{"choices":[],\r\ndata:"usage":' + json.dumps(usage).encode()
        + b"}\r\n\r\n"
        b"data\n\n"
        b"data: [DONE]\n\n"
    )  # fmt: skip
    for strip in (False, True):
        f = SseStreamFilter(strip_usage_event=strip)
        out = run(f, [stream[i : i + 1] for i in range(len(stream))])
        assert f.output_text() == "hi"
        assert f.usage == Usage(1, 1)
        assert f.done
        # The comment-only event is not a data event; "data" alone is (empty data).
        assert f.events_seen == 4
        assert f.malformed_events == 1  # the empty data
        if strip:
            assert b"usage" not in out and out.endswith(b"data: [DONE]\n\n")
        else:
            assert out == stream


def test_mixed_line_endings() -> None:
    stream = (
        b"data: " + ROLE_EVENT.encode() + b"\r\n\n"
        b"data: " + chunk_json([delta("x")]).encode() + b"\n\r\n"
        b"data: " + USAGE_EVENT.encode() + b"\n\n"
        b"data: [DONE]\r\n\r\n"
    )
    f = SseStreamFilter(strip_usage_event=True)
    out = run(f, [stream[i : i + 3] for i in range(0, len(stream), 3)])
    assert b"usage" not in out
    assert f.output_text() == "x" and f.usage == EXPECTED_USAGE and f.done


def test_unterminated_final_event_is_accounted() -> None:
    stream = (
        events_to_stream(vllm_chat_payloads(with_usage=False)[:-1])
        + b"data: "
        + USAGE_EVENT.encode()
    )
    f = SseStreamFilter()
    assert run(f, [stream]) == stream
    assert f.usage == EXPECTED_USAGE and not f.done
    g = SseStreamFilter(strip_usage_event=True)
    assert run(g, [stream]) == events_to_stream(vllm_chat_payloads(with_usage=False)[:-1])
    h = SseStreamFilter(strip_usage_event=True)
    partial = events_to_stream([ROLE_EVENT]) + b'data: {"choices":[{"delta":{"content":"tr'
    assert run(h, [partial]) == partial  # a cut-off event is forwarded as it came
    assert h.malformed_events == 1


def test_error_event_and_malformed_data() -> None:
    err = {"error": {"message": "boom", "type": "InternalServerError", "param": None,
                     "code": 500}}  # fmt: skip
    stream = events_to_stream([ROLE_EVENT, "not json", "[1]", json.dumps(err), "[DONE]"])
    f = SseStreamFilter(strip_usage_event=True)
    assert run(f, [stream]) == stream
    assert f.error == err["error"]
    assert f.malformed_events == 2
    assert f.usage is None and f.done


def test_legacy_error_object() -> None:
    legacy = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    f = SseStreamFilter()
    run(f, [events_to_stream([json.dumps(legacy)])])
    assert f.error == legacy


def test_oversized_event_is_streamed_and_scanned() -> None:
    big = "data: " + chunk_json([delta("x" * 5000)])
    rest = events_to_stream(vllm_chat_payloads())
    for strip in (False, True):
        f = SseStreamFilter(strip_usage_event=strip, max_event_bytes=1000)
        stream = events_to_stream([ROLE_EVENT]) + big.encode() + b"\n\n" + rest
        chunks = split_at(stream, range(500, len(stream), 500))
        out = run(f, chunks)
        # The big event is forwarded unchanged and still read; nothing stops.
        assert out == (stream.replace(usage_event_bytes(), b"") if strip else stream)
        assert f.usage == EXPECTED_USAGE
        assert f.large_events == 1
        assert f.output_text() == "x" * 5000 + TEXT
        assert f.content_events == len(PIECES) + 2
        assert f.stripped_events == (1 if strip else 0)


def test_empty_chunks_and_finish_idempotent() -> None:
    f = SseStreamFilter(strip_usage_event=True)
    empty = b""
    assert f.feed(empty) is empty
    assert f.feed(STREAM_LF[:10]) == b""
    assert f.finish() == STREAM_LF[:10]
    assert f.finish() == b""
    with pytest.raises(RuntimeError):
        f.feed(b"data: [DONE]\n\n")


def test_bytearray_remainder_never_rescans_from_start() -> None:
    # A long event trickling in 1-byte chunks must stay linear: _scan advances.
    payload = "data: " + json.dumps({"choices": [{"delta": {"content": "y" * 200_000}}]})
    data = payload.encode() + b"\n\n"
    f = SseStreamFilter()
    for i in range(0, len(data), 64):
        f.feed(data[i : i + 64])
    assert f.output_text() == "y" * 200_000


def test_crlf_multiline_event_fields_are_trimmed() -> None:
    # "data: [DONE]" followed by another field: the CR of its CRLF must not stick to it.
    stream = b"data:" + USAGE_EVENT.encode() + b"\r\nid: 9\r\n\r\ndata: [DONE]\r\nid: 10\r\n\r\n"
    f = SseStreamFilter(strip_usage_event=True)
    assert run(f, [stream]) == b"data: [DONE]\r\nid: 10\r\n\r\n"
    assert f.done and f.usage == EXPECTED_USAGE
