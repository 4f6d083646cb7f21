"""The Messages meter without a server: a ``message`` body or its event stream, for the
bill, in bounded memory, however the answer is cut into chunks or cut short."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.anthropic import MessagesStreamReader, MessageUsageScanner, message_usage
from kvgate.anthropic.meter import MessagesMeter
from kvgate.lifecycle.billing import ResponseReading, charged_usage
from kvgate.policy import ActualUsage, AdmissionRequest, Reservation, SettleCause


def event(name: str, payload: dict[str, Any], *, newline: str = "\n") -> bytes:
    # vLLM's framing: wrap_data_with_event(data, event).
    data = json.dumps(payload, separators=(",", ":"))
    return f"event: {name}{newline}data: {data}{newline}{newline}".encode()


def delta(index: int, kind: str, **fields: str) -> bytes:
    return event(
        "content_block_delta",
        {"type": "content_block_delta", "index": index, "delta": {"type": kind, **fields}},
    )


MESSAGE_START = event(
    "message_start",
    {
        "type": "message_start",
        "message": {
            "id": "chatcmpl-1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "qwen2.5-demo",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 21, "output_tokens": 0},
        },
    },
)
MESSAGE_DELTA = event(
    "message_delta",
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 21, "output_tokens": 9},
    },
)
MESSAGE_STOP = event("message_stop", {"type": "message_stop"})

# A vLLM stream: thinking (with vLLM's made-up signature), text, a tool call.
STREAM = b"".join(
    [
        MESSAGE_START,
        event("ping", {"type": "ping"}),
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": ""},
            },
        ),
        delta(0, "thinking_delta", thinking="Paris?"),
        delta(0, "signature_delta", signature="0f3a9c"),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        delta(1, "text_delta", text="Let me"),
        delta(1, "text_delta", text=" check."),
        event("content_block_stop", {"type": "content_block_stop", "index": 1}),
        event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 2,
                "content_block": {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {},
                },
            },
        ),
        delta(2, "input_json_delta", partial_json='{"city": '),
        delta(2, "input_json_delta", partial_json='"Paris"}'),
        event("content_block_stop", {"type": "content_block_stop", "index": 2}),
        MESSAGE_DELTA,
        MESSAGE_STOP,
    ]
)
TEXT = 'Paris?Let me check.get_weather{"city": "Paris"}'


async def count_chars(text: str) -> int:
    return len(text)


async def read(chunks: list[bytes], *, end: bool = True, status: int = 200) -> ResponseReading:
    meter = MessagesMeter(stream_requested=True)
    meter.on_headers(status, "text/event-stream; charset=utf-8")
    for i, chunk in enumerate(chunks):
        last = end and i == len(chunks) - 1
        assert meter.on_chunk(chunk, end_of_stream=last) is None  # nothing is ever rewritten
    return await meter.reading(count_chars)


async def test_a_whole_stream_is_billed_by_its_own_usage() -> None:
    reading = await read([STREAM])
    assert reading.accepted and reading.streamed
    assert reading.usage == ActualUsage(prompt_tokens=21, output_tokens=9)
    # thinking, two text deltas, two tool-input deltas; the signature is vLLM's, not the model's
    assert reading.content_events == 5
    assert reading.output_text_complete and reading.visible_text
    assert reading.counted_output_tokens == 0  # usage known: nothing counted


def test_the_reader_sees_every_part_of_the_stream() -> None:
    reader = MessagesStreamReader()
    reader.feed(STREAM)
    reader.finish()
    assert reader.started and reader.stopped and reader.error is None
    assert reader.output_text() == TEXT
    assert reader.events_seen == 16 and reader.malformed_events == 0
    assert reader.buffered_bytes == 0


async def test_a_stream_cut_before_message_delta_is_counted_from_its_text() -> None:
    cut = STREAM[: STREAM.index(b"event: message_delta")]
    reading = await read([cut], end=False)
    assert reading.usage is None
    assert reading.counted_output_tokens == len(TEXT)
    assert reading.content_events == 5
    reservation = Reservation(
        reservation_id="r1",
        request=AdmissionRequest(
            request_id="q1",
            tenant="acme",
            model="m",
            backend="b",
            prompt_tokens=30,
            max_new_tokens=100,
        ),
        kv_tokens=256,
        started_at=0.0,
        expires_at=10.0,
    )
    # Cut by the client: kvgate's prompt count and the output it saw.
    usage, metered = charged_usage(SettleCause.DISCONNECTED, reading, reservation)
    assert metered and usage == ActualUsage(prompt_tokens=30, output_tokens=len(TEXT))


async def test_cache_fields_add_to_the_prompt_and_reads_are_the_cached_part() -> None:
    start = event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "usage": {"input_tokens": 5, "cache_read_input_tokens": 16, "output_tokens": 0}
            },
        },
    )
    end = event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {
                "input_tokens": 4,
                "output_tokens": 3,
                "cache_read_input_tokens": 16,
                "cache_creation_input_tokens": 1,
            },
        },
    )
    reading = await read([start + delta(0, "text_delta", text="hi") + end + MESSAGE_STOP])
    assert reading.usage == ActualUsage(prompt_tokens=21, output_tokens=3, cached_tokens=16)


async def test_anthropics_own_message_delta_carries_only_the_output() -> None:
    end = event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 7},
        },
    )
    reading = await read([MESSAGE_START + delta(0, "text_delta", text="x") + end + MESSAGE_STOP])
    assert reading.usage == ActualUsage(prompt_tokens=21, output_tokens=7)


async def test_an_error_event_mid_stream_is_seen_and_the_text_counted() -> None:
    error = event(
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    )
    meter = MessagesMeter(stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    meter.on_chunk(MESSAGE_START + delta(0, "text_delta", text="abc") + error, end_of_stream=True)
    assert meter.events is not None and meter.events.error == {
        "type": "overloaded_error",
        "message": "Overloaded",
    }
    reading = await meter.reading(count_chars)
    assert reading.usage is None and reading.counted_output_tokens == 3


async def test_crlf_framing_and_an_unterminated_last_event() -> None:
    stream = (
        event(
            "message_start",
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 2, "output_tokens": 0}},
            },
            newline="\r\n",
        )
        + event(
            "message_delta",
            {"type": "message_delta", "usage": {"output_tokens": 1}},
            newline="\r\n",
        )
        + b'event: message_stop\r\ndata: {"type":"message_stop"}'
    )
    meter = MessagesMeter(stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    meter.on_chunk(stream, end_of_stream=True)
    assert meter.events is not None and meter.events.stopped
    assert meter.reported_usage() is not None


async def test_an_upstream_error_is_never_read_as_usage() -> None:
    reading = await read([STREAM], status=500)
    assert not reading.accepted and reading.usage is None and reading.counted_output_tokens == 0


async def test_a_large_event_is_skipped_in_bounded_memory_and_still_counted() -> None:
    huge = delta(0, "text_delta", text="y" * 300_000)
    meter = MessagesMeter(stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    chunks = [MESSAGE_START, *(huge[i : i + 4096] for i in range(0, len(huge), 4096))]
    chunks += [delta(0, "text_delta", text="z"), MESSAGE_DELTA, MESSAGE_STOP]
    events = meter.events
    assert events is not None
    peak = 0
    for chunk in chunks:
        meter.on_chunk(chunk, end_of_stream=False)
        peak = max(peak, events.buffered_bytes)
    assert peak <= 64 * 1024 + 4096
    assert events.large_events == 1 and events.output_text_truncated
    assert events.content_events == 2 and events.stopped
    reading = await meter.reading(count_chars)
    assert reading.usage == ActualUsage(prompt_tokens=21, output_tokens=9)
    assert not reading.output_text_complete


def test_retained_text_is_capped() -> None:
    reader = MessagesStreamReader(max_text_chars=10)
    reader.feed(delta(0, "text_delta", text="0123456") + delta(0, "text_delta", text="789abc"))
    assert reader.output_text() == "0123456789" and reader.output_text_truncated
    assert reader.content_events == 2


@settings(max_examples=300, deadline=None)
@given(
    cuts=st.lists(st.integers(0, len(STREAM)), max_size=12),
    stop=st.integers(0, len(STREAM)),
)
def test_any_chunking_reads_the_same_and_a_cut_stream_never_invents_usage(
    cuts: list[int], stop: int
) -> None:
    def fed(data: bytes, *, finish: bool) -> MessagesStreamReader:
        reader = MessagesStreamReader()
        bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
        for a, b in itertools.pairwise(bounds):
            reader.feed(data[a:b])
        if finish:
            reader.finish()
        return reader

    whole = fed(STREAM, finish=True)
    assert whole.usage is not None and whole.output_text() == TEXT
    assert (whole.content_events, whole.events_seen) == (5, 16)

    # A stream cut anywhere: what it read is what its whole events carried, never more.
    prefix = STREAM[:stop]
    cut = fed(prefix, finish=False)
    complete = prefix[: prefix.rfind(b"\n\n") + 2] if b"\n\n" in prefix else b""
    reference = fed(complete, finish=False)
    assert cut.output_text() == reference.output_text()
    assert TEXT.startswith(cut.output_text())
    assert cut.content_events == reference.content_events <= 5
    assert cut.usage == reference.usage
    assert (cut.usage is not None) == (
        prefix.find(b"\n\n", STREAM.index(b"event: message_delta")) >= 0
    )
    assert cut.buffered_bytes <= len(prefix) - len(complete) + 3


# --------------------------------------------------------------------------- JSON


def message(text: str, usage: dict[str, int]) -> bytes:
    # vLLM's model_dump(exclude_none=True) order: usage after the content.
    return json.dumps(
        {
            "id": "chatcmpl-2",
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "text", "text": text},
                {
                    "type": "tool_use",
                    "id": "c",
                    "name": "f",
                    "input": {"usage": {"input_tokens": 1, "output_tokens": 1}},
                },
            ],
            "model": "m",
            "stop_reason": "end_turn",
            "usage": usage,
        }
    ).encode()


@pytest.mark.parametrize("size", [10, 100_000, 1_000_000])
async def test_a_json_message_is_billed_by_its_top_level_usage(size: int) -> None:
    body = message(
        '"usage": {"input_tokens": 999, "output_tokens": 999}' + "x" * size,
        {"input_tokens": 12, "output_tokens": 34},
    )
    meter = MessagesMeter(stream_requested=False)
    meter.on_headers(200, "application/json")
    for start in range(0, len(body), 8192):
        meter.on_chunk(body[start : start + 8192], end_of_stream=start + 8192 >= len(body))
    reading = await meter.reading(count_chars)
    assert reading.usage == ActualUsage(prompt_tokens=12, output_tokens=34)
    assert not reading.streamed and reading.content_events == 0


def test_the_json_scanner_holds_next_to_nothing_of_a_large_body() -> None:
    scanner = MessageUsageScanner()
    body = message(
        "x" * 50_000, {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 2}
    )
    for start in range(0, len(body), 100):
        scanner.feed(body[start : start + 100])
        assert scanner.buffered_bytes <= 1024
    assert scanner.usage is not None
    assert (scanner.usage.prompt_tokens, scanner.usage.output_tokens) == (5, 4)


def test_a_usage_inside_a_tool_input_is_never_the_answers() -> None:
    """A tool's input is a JSON object the client can steer: a usage in it is not read,
    whether the real usage is missing, unreadable, or not delivered yet."""
    decoy = {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "f",
        "input": {"usage": {"input_tokens": 0, "output_tokens": 0}},
    }
    document = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [decoy],
        "stop_reason": "tool_use",
    }
    for usage in (None, {"input_tokens": "9", "output_tokens": 3}):
        scanner = MessageUsageScanner()
        scanner.feed(json.dumps({**document, "usage": usage}).encode())
        assert scanner.usage is None
    whole = json.dumps({**document, "usage": {"input_tokens": 7, "output_tokens": 2}}).encode()
    cut = MessageUsageScanner()
    cut.feed(whole[: whole.rindex(b'"usage"')])
    assert cut.usage is None
    full = MessageUsageScanner()
    full.feed(whole)
    assert full.usage is not None and (full.usage.prompt_tokens, full.usage.output_tokens) == (7, 2)


async def test_a_json_answer_without_usage_or_cut_is_not_metered() -> None:
    meter = MessagesMeter(stream_requested=False)
    meter.on_headers(200, "application/json")
    body = message("hello", {"input_tokens": 1, "output_tokens": 2})
    meter.on_chunk(body[: len(body) // 2], end_of_stream=False)
    assert (await meter.reading(count_chars)).usage is None
    error = MessagesMeter(stream_requested=False)
    error.on_headers(400, "application/json")
    error.on_chunk(
        b'{"type":"error","error":{"type":"invalid_request_error","message":"x"}}',
        end_of_stream=True,
    )
    reading = await error.reading(count_chars)
    assert not reading.accepted and reading.usage is None


def test_usage_objects_must_hold_both_counts() -> None:
    assert message_usage({"input_tokens": 1}) is None
    assert message_usage({"input_tokens": True, "output_tokens": 1}) is None
    assert message_usage({"input_tokens": -1, "output_tokens": 1}) is None
    usage = message_usage({"input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 3})
    assert usage is not None and usage.prompt_tokens == 4
