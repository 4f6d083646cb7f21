"""The response meter without a server: what it reads of an answer, for the bill."""

from __future__ import annotations

import json

from kvgate.lifecycle import ResponseMeter


def event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def delta(text: str) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }


USAGE = {
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
}


async def count_words(text: str) -> int:
    return len(text.split())


async def test_stream_usage_is_read_and_the_injected_event_stripped() -> None:
    meter = ResponseMeter(strip_usage_event=True, stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    assert meter.on_chunk(event(delta(" a")), end_of_stream=False) is None
    stripped = meter.on_chunk(event(USAGE) + event("[DONE]"), end_of_stream=True)
    assert stripped == event("[DONE]")
    reading = await meter.reading(count_words)
    assert reading.accepted and reading.streamed
    assert reading.usage is not None
    assert (reading.usage.prompt_tokens, reading.usage.output_tokens) == (9, 2)
    assert reading.content_events == 1


async def test_a_cut_stream_is_counted_from_its_text() -> None:
    meter = ResponseMeter(strip_usage_event=True, stream_requested=True)
    meter.on_headers(200, "text/event-stream")
    meter.on_chunk(event(delta(" one")) + event(delta(" two")), end_of_stream=False)
    reading = await meter.reading(count_words)
    assert reading.usage is None
    assert (reading.counted_output_tokens, reading.content_events) == (2, 2)
    assert reading.visible_text and reading.output_text_complete


async def test_json_usage_is_read_from_the_body() -> None:
    meter = ResponseMeter(strip_usage_event=False, stream_requested=False)
    meter.on_headers(200, "application/json")
    body = json.dumps({"choices": [{"text": "x" * 100_000}], "usage": USAGE["usage"]}).encode()
    for start in range(0, len(body), 4096):
        assert meter.on_chunk(body[start : start + 4096], end_of_stream=False) is None
    reading = await meter.reading(count_words)
    assert reading.usage is not None and reading.usage.output_tokens == 2
    assert not reading.streamed


async def test_an_error_answer_is_not_accepted() -> None:
    meter = ResponseMeter(strip_usage_event=False, stream_requested=False)
    meter.on_headers(503, "application/json")
    meter.on_chunk(b'{"error": {"message": "x"}}', end_of_stream=True)
    reading = await meter.reading(count_words)
    assert not reading.accepted and reading.usage is None
