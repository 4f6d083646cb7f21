"""Reading a Responses answer for the bill: the response body's usage and the named SSE
events, fed whole or cut at every point, in bounded memory."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.json_capture import JsonPathCapture
from kvgate.policy import ActualUsage
from kvgate.responses_api import (
    ResponseBodyScanner,
    ResponsesMeter,
    ResponsesStreamReader,
    ResponsesUsage,
    responses_usage,
)

USAGE = {
    "input_tokens": 42,
    "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
    "output_tokens": 9,
    "output_tokens_details": {"reasoning_tokens": 4, "tool_output_tokens": 0},
    "total_tokens": 51,
}
EXPECTED = ResponsesUsage(input_tokens=42, output_tokens=9, cached_tokens=16, reasoning_tokens=4)
# A client's values that look like usage, before and after the real one.
DECOY = {"usage": {"input_tokens": 0, "output_tokens": 0}}


def response(status: str = "completed", usage: Any = USAGE, **extra: Any) -> dict[str, Any]:
    """A response object as vLLM writes it (usage after output, tools and text)."""
    return {
        "id": "resp_1",
        "created_at": 1,
        "incomplete_details": None,
        "instructions": 'say "usage": {"input_tokens": 0}',
        "metadata": {"note": json.dumps(DECOY)},
        "model": "m",
        "object": "response",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": 'Sunny \\ "usage" {}', "annotations": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "tools": [{"type": "function", "name": "f", "parameters": DECOY}],
        "text": {"format": {"type": "json_schema", "schema": DECOY}},
        "status": status,
        "usage": usage,
        "user": None,
        **extra,
    }


def event(kind: str, **payload: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


def stream(final: str = "response.completed", usage: Any = USAGE) -> bytes:
    started = response("in_progress", usage=None)
    return b"".join(
        [
            event("response.created", sequence_number=0, response=started),
            event("response.in_progress", sequence_number=1, response=started),
            event("response.output_item.added", sequence_number=2, output_index=0, item={}),
            event("response.reasoning_text.delta", sequence_number=3, delta="Think. "),
            event("response.output_text.delta", sequence_number=4, delta="Sun"),
            event("response.output_text.delta", sequence_number=5, delta='ny "ü" \n'),
            event("response.function_call_arguments.delta", sequence_number=6, delta='{"a"'),
            event("response.output_text.done", sequence_number=7, text="Sunny"),
            event(final, sequence_number=8, response=response(usage=usage)),
        ]
    )


def scan_body(raw: bytes, step: int) -> ResponseBodyScanner:
    scanner = ResponseBodyScanner()
    for i in range(0, len(raw), step):
        scanner.feed(raw[i : i + step])
    return scanner


def read_stream(raw: bytes, step: int) -> ResponsesStreamReader:
    reader = ResponsesStreamReader()
    for i in range(0, len(raw), step):
        reader.feed(raw[i : i + step])
    reader.finish()
    return reader


def test_usage_is_read_from_its_fields() -> None:
    assert responses_usage(USAGE) == EXPECTED
    assert responses_usage({"input_tokens": 3, "output_tokens": 0}) == ResponsesUsage(3, 0)
    for broken in (None, [], {"input_tokens": 3}, {"input_tokens": True, "output_tokens": 1}):
        assert responses_usage(broken) is None
    # A cached part larger than the prompt is no cached part to trust.
    odd = {"input_tokens": 3, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 9}}
    assert responses_usage(odd) == ResponsesUsage(3, 1, cached_tokens=3)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 13, 64, 10_000])
def test_a_body_cut_anywhere_gives_its_top_level_usage(step: int) -> None:
    raw = json.dumps(response(), indent=1 if step % 2 else None).encode()
    scanner = scan_body(raw, step)
    assert scanner.usage == EXPECTED
    assert scanner.status == "completed"


def test_usage_before_large_trailing_messages_is_found_and_nothing_large_is_kept() -> None:
    # enable_response_messages puts input/output messages after usage: their decoys are
    # nested, never top-level.
    messages = [{"role": "user", "content": "x" * 100_000, **DECOY}] * 5
    raw = json.dumps(response(input_messages=messages, output_messages=messages)).encode()
    scanner = ResponseBodyScanner()
    peak = 0
    for i in range(0, len(raw), 4096):
        scanner.feed(raw[i : i + 4096])
        peak = max(peak, scanner.buffered_bytes)
    assert scanner.usage == EXPECTED
    assert peak < 1024


def test_a_body_without_usage_or_cut_before_it_has_none() -> None:
    raw = json.dumps(response(usage=None)).encode()
    assert scan_body(raw, 7).usage is None
    full = json.dumps(response()).encode()
    assert scan_body(full[: full.index(b'"usage"') + 20], 3).usage is None
    assert scan_body(b"not json", 3).usage is None
    assert scan_body(b"[1, 2]", 3).usage is None


@pytest.mark.parametrize("final", ["response.completed", "response.incomplete", "response.failed"])
@pytest.mark.parametrize("step", [1, 3, 7, 64, 100_000])
def test_a_stream_cut_anywhere_gives_the_terminal_events_usage_and_the_text(
    final: str, step: int
) -> None:
    reader = read_stream(stream(final), step)
    assert reader.usage == EXPECTED and reader.final_event == final
    assert reader.output_text() == 'Think. Sunny "ü" \n{"a"'
    assert reader.content_events == 4
    assert reader.events_seen == 9 and reader.malformed_events == 0
    assert not reader.output_text_truncated


def test_a_stream_cut_before_its_end_has_text_but_no_usage() -> None:
    raw = stream()
    cut = raw[: raw.rindex(b"event: response.completed") + 40]
    reader = read_stream(cut, 5)
    assert reader.usage is None and reader.final_event is None
    assert reader.content_events == 4 and reader.output_text().startswith("Think.")
    assert reader.malformed_events == 1


def test_crlf_lines_comments_and_events_named_only_by_their_event_line() -> None:
    raw = (
        b": keep-alive\r\n\r\n"
        b'event: response.output_text.delta\r\ndata: {"delta": "Hi"}\r\n\r\n'
        b"event: response.completed\r\n"
        b'data: {"response": {"usage": {"input_tokens": 5, "output_tokens": 1}}}\r\n\r\n'
    )
    for step in (1, 2, 1000):
        reader = read_stream(raw, step)
        assert reader.output_text() == "Hi" and reader.content_events == 1
        assert reader.usage == ResponsesUsage(5, 1)


def test_an_unterminated_last_event_is_still_read() -> None:
    raw = stream().rstrip(b"\n")
    assert read_stream(raw, 11).usage == EXPECTED


def test_the_last_event_repeating_a_long_output_is_read_in_bounded_memory() -> None:
    long_text = "word " * 200_000
    final = response()
    final["output"][0]["content"][0]["text"] = long_text
    raw = event("response.output_text.delta", delta="word ") + event(
        "response.completed", response=final
    )
    reader = ResponsesStreamReader()
    peak = 0
    for i in range(0, len(raw), 8192):
        reader.feed(raw[i : i + 8192])
        peak = max(peak, reader.buffered_bytes)
    reader.finish()
    assert reader.usage == EXPECTED
    assert peak < 2048


def test_text_beyond_the_bound_is_marked_truncated() -> None:
    reader = ResponsesStreamReader(max_text_chars=4)
    reader.feed(event("response.output_text.delta", delta="abcdef"))
    reader.finish()
    assert reader.output_text() == "abcd" and reader.output_text_truncated
    huge = event("response.output_text.delta", delta="x" * 100_000)
    reader = read_stream(huge, 4096)
    assert reader.content_events == 1 and reader.output_text_truncated


def test_an_error_event_is_kept() -> None:
    raw = event("error", code="internal_error", message="boom", sequence_number=3)
    reader = read_stream(raw, 4)
    assert reader.error == {"code": "internal_error", "message": "boom"}
    assert reader.usage is None


def test_the_path_scanner_skips_strings_and_nesting() -> None:
    raw = b'{"a": "\\"usage\\": {", "b": [{"usage": 1}], "usage": {"x": [1, "]}"]}, "n": -1.5e3}'
    for step in (1, 2, 4, 100):
        capture = JsonPathCapture([("usage",), ("n",), ("b",)], max_capture_bytes=8)
        for i in range(0, len(raw), step):
            capture.feed(raw[i : i + step])
        assert capture.complete and not capture.dead
        assert capture.values == {("n",): -1500.0}
        assert capture.oversized == {("usage",), ("b",)}
    dead = JsonPathCapture([("usage",)])
    dead.feed(b'["usage"]')
    assert dead.dead


async def count(text: str) -> int:
    return len(text.split())


async def test_the_meter_bills_the_engines_usage_and_passes_every_chunk() -> None:
    meter = ResponsesMeter(stream_requested=True)
    meter.on_headers(200, "text/event-stream; charset=utf-8")
    raw = stream()
    for i in range(0, len(raw), 100):
        assert meter.on_chunk(raw[i : i + 100], end_of_stream=i + 100 >= len(raw)) is None
    reading = await meter.reading(count)
    assert reading.usage == ActualUsage(prompt_tokens=42, output_tokens=9, cached_tokens=16)
    assert reading.streamed and reading.accepted and reading.visible_text
    assert reading.counted_output_tokens == 0  # nothing counted when the usage is known


async def test_a_cut_stream_is_counted_from_its_text() -> None:
    meter = ResponsesMeter(stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    meter.on_chunk(event("response.output_text.delta", delta="one two three"), end_of_stream=False)
    reading = await meter.reading(count)
    assert reading.usage is None
    assert (reading.counted_output_tokens, reading.content_events) == (3, 1)
    assert reading.output_text_complete


async def test_a_json_answer_and_an_error_answer() -> None:
    meter = ResponsesMeter(stream_requested=False)
    meter.on_headers(200, "application/json")
    meter.on_chunk(json.dumps(response()).encode(), end_of_stream=True)
    reading = await meter.reading(count)
    assert reading.usage is not None and reading.usage.prompt_tokens == 42
    assert not reading.streamed
    failed = ResponsesMeter(stream_requested=False)
    failed.on_headers(400, "application/json")
    failed.on_chunk(b'{"error": {"message": "bad"}}', end_of_stream=True)
    reading = await failed.reading(count)
    assert not reading.accepted and reading.usage is None
