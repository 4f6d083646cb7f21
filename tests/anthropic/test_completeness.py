"""The Messages completeness rule: what the answer layer may keep of an Anthropic answer.
Complete answers in vLLM 0.34's shapes (``vllm_sim.anthropic``), and every way one is not:
cut at every byte, an error event, an aborted or unfinished stop, a wrong content type, a
status other than 200, events out of order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.anthropic.completeness import FINISHED_STOP_REASONS, answer_defect
from kvgate.openai.completeness import AnswerDefect

SSE_TYPE = "text/event-stream; charset=utf-8"
JSON_TYPE = "application/json"


def event(name: str, payload: dict[str, Any], newline: str = "\n") -> bytes:
    data = json.dumps({"type": name, **payload}, separators=(",", ":"))
    return f"event: {name}{newline}data: {data}{newline}{newline}".encode()


def message(**fields: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello there."}],
        "model": "m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 3},
        **fields,
    }


START = event("message_start", {"message": message(content=[], stop_reason=None)})
BLOCK = [
    event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
    event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "lo."}}),
    event("content_block_stop", {"index": 0}),
]
TOOL_BLOCK = [
    event(
        "content_block_start",
        {"index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}},
    ),
    event("content_block_delta", {"index": 1, "delta": {"type": "input_json_delta"}}),
    event("content_block_stop", {"index": 1}),
]
STOP = event("message_stop", {})
ERROR = event("error", {"error": {"type": "api_error", "message": "engine died"}})


def delta(stop_reason: object = "end_turn") -> bytes:
    return event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"input_tokens": 9, "output_tokens": 3},
        },
    )


STREAM = b"".join([START, *BLOCK, delta(), STOP])


def stream_defect(body: bytes, content_type: str = SSE_TYPE) -> AnswerDefect | None:
    return answer_defect(stream=True, status=200, content_type=content_type, body=body)


def json_defect(body: bytes | dict[str, Any], content_type: str = JSON_TYPE) -> AnswerDefect | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return answer_defect(stream=False, status=200, content_type=content_type, body=raw)


@pytest.mark.parametrize("reason", sorted(FINISHED_STOP_REASONS))
def test_a_finished_message_is_complete(reason: str) -> None:
    assert json_defect(message(stop_reason=reason)) is None
    assert json_defect(message(content=[])) is None  # an empty answer is still one
    assert stream_defect(b"".join([START, *BLOCK, delta(reason), STOP])) is None


def test_a_stream_in_every_shape_vllm_and_anthropic_write_is_complete() -> None:
    # Several blocks (text, then a tool call), pings (Anthropic's), CRLF framing, comments.
    ping = event("ping", {})
    assert (
        stream_defect(b"".join([START, ping, *BLOCK, *TOOL_BLOCK, delta("tool_use"), STOP])) is None
    )
    crlf = b"".join(
        event(name, payload, "\r\n")
        for name, payload in (
            ("message_start", {"message": message(content=[], stop_reason=None)}),
            ("message_delta", {"delta": {"stop_reason": "max_tokens"}}),
            ("message_stop", {}),
        )
    )
    assert stream_defect(crlf) is None  # no content at all, cut by its max_tokens
    assert stream_defect(b": keep-alive\n\n" + STREAM + b": bye\n\n") is None
    assert stream_defect(STREAM, "text/event-stream") is None


def test_a_stream_cut_at_any_point_is_not_complete() -> None:
    for end in range(len(STREAM)):
        assert stream_defect(STREAM[:end]) is not None, STREAM[:end]


def test_a_message_cut_at_any_point_is_not_complete() -> None:
    body = json.dumps(message()).encode()
    for end in range(len(body)):
        assert json_defect(body[:end]) in (AnswerDefect.MALFORMED, AnswerDefect.EMPTY)


def test_where_a_stream_was_cut_names_why() -> None:
    assert stream_defect(STREAM[: STREAM.index(b"event: message_stop")]) is AnswerDefect.NO_DONE
    assert stream_defect(STREAM[:-1]) is AnswerDefect.NO_DONE  # message_stop not terminated
    assert stream_defect(b"".join([START, *BLOCK, STOP])) is AnswerDefect.UNFINISHED_CHOICE
    assert stream_defect(b": ping\n\n") is AnswerDefect.EMPTY


def test_an_error_anywhere_is_an_error() -> None:
    # vLLM: the open block is closed, then the error event, then the body ends.
    assert stream_defect(b"".join([START, *BLOCK, ERROR])) is AnswerDefect.ERROR
    assert stream_defect(b"".join([START, *BLOCK, delta(), ERROR, STOP])) is AnswerDefect.ERROR
    assert stream_defect(ERROR) is AnswerDefect.ERROR
    error_body = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert json_defect(error_body) is AnswerDefect.ERROR
    assert json_defect({"error": {"message": "x", "type": "BadRequestError"}}) is AnswerDefect.ERROR


@pytest.mark.parametrize("reason", [None, "pause_turn", "refusal", "abort", "whatever"])
def test_a_stop_reason_that_is_not_a_finished_answer_is_not_kept(reason: str | None) -> None:
    # None: vLLM's aborted generation (null in message_delta, left out of a message).
    assert stream_defect(b"".join([START, *BLOCK, delta(reason), STOP])) is (
        AnswerDefect.FAILED_CHOICE
    )
    body = message(stop_reason=reason)
    assert json_defect(body) is AnswerDefect.FAILED_CHOICE
    if reason is None:
        del body["stop_reason"]
        assert json_defect(body) is AnswerDefect.FAILED_CHOICE
    assert json_defect(message(stop_reason=7)) is AnswerDefect.MALFORMED


@pytest.mark.parametrize(
    "events",
    [
        [*BLOCK, START, delta(), STOP],  # content before message_start
        [START, START, *BLOCK, delta(), STOP],  # two starts
        [START, *BLOCK[:3], delta(), STOP],  # a block still open at the message_delta
        [START, BLOCK[1], delta(), STOP],  # a delta for a block never started
        [START, *BLOCK, *BLOCK, delta(), STOP],  # an index started twice
        [START, *BLOCK, delta(), delta(), STOP],  # two message_deltas
        [START, *BLOCK, delta(), *TOOL_BLOCK, STOP],  # content after the stop reason
        [START, *BLOCK, delta(), STOP, event("ping", {})],  # anything after message_stop
        [START, *BLOCK, event("something_new", {}), delta(), STOP],  # not this grammar
        [event("message_start", {"message": {"type": "completion"}}), delta(), STOP],
    ],
)
def test_events_out_of_the_grammar_are_malformed(events: list[bytes]) -> None:
    assert stream_defect(b"".join(events)) is AnswerDefect.MALFORMED


def test_framing_that_is_not_the_apis() -> None:
    # The event name must be the data's type; the data JSON; the body UTF-8.
    renamed = STREAM.replace(b"event: message_stop", b"event: message_delta")
    assert stream_defect(renamed) is AnswerDefect.MALFORMED
    assert stream_defect(START + b"data: {not json\n\n") is AnswerDefect.MALFORMED
    assert stream_defect(START + b"data: [DONE]\n\n") is AnswerDefect.MALFORMED
    assert stream_defect(b"\xff" + STREAM) is AnswerDefect.MALFORMED
    assert json_defect(b"[1, 2]") is AnswerDefect.MALFORMED
    assert json_defect(message(role="user")) is AnswerDefect.MALFORMED
    assert json_defect(message(content="Hello")) is AnswerDefect.MALFORMED


def test_the_head_the_request_asked_for() -> None:
    body = json.dumps(message()).encode()
    for status in (201, 400, 429, 500, 529):
        assert (
            answer_defect(stream=False, status=status, content_type=JSON_TYPE, body=body)
            is AnswerDefect.STATUS
        )
    assert json_defect(body, "text/html; charset=utf-8") is AnswerDefect.CONTENT_TYPE
    assert stream_defect(STREAM, "text/plain") is AnswerDefect.CONTENT_TYPE
    assert json_defect(STREAM, SSE_TYPE) is AnswerDefect.STREAM_MISMATCH  # a stream unasked
    assert stream_defect(body, JSON_TYPE) is AnswerDefect.STREAM_MISMATCH  # JSON to a stream
    assert json_defect(b"  ") is AnswerDefect.EMPTY
    assert stream_defect(b"") is AnswerDefect.EMPTY
