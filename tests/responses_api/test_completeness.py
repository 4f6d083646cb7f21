"""The Responses completeness rule: what the answer layer may keep of a Responses answer.
Complete answers in vLLM 0.34's shapes (``vllm_sim.responses``), and every way one is not:
cut at every byte, ``error`` and ``response.failed`` events, statuses that are not a
finished answer, a wrong content type, a status other than 200, events out of order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.openai.completeness import AnswerDefect
from kvgate.responses_api.completeness import answer_defect

SSE_TYPE = "text/event-stream; charset=utf-8"
JSON_TYPE = "application/json"
USAGE = {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}


def response(status: str = "completed", **fields: Any) -> dict[str, Any]:
    reason = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": status,
        "incomplete_details": reason,
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
            }
        ],
        "usage": USAGE,
        **fields,
    }


def event(kind: str, number: int | None, newline: str = "\n", **payload: Any) -> bytes:
    data: dict[str, Any] = {"type": kind, **payload}
    if number is not None:
        data["sequence_number"] = number
    text = json.dumps(data, separators=(",", ":"))
    return f"event: {kind}{newline}data: {text}{newline}{newline}".encode()


INITIAL = response("in_progress", output=[], usage=None)
HEAD = [
    event("response.created", 0, response=INITIAL),
    event("response.in_progress", 1, response=INITIAL),
    event("response.output_item.added", 2, output_index=0, item={"type": "message"}),
    event("response.output_text.delta", 3, delta="Hel", item_id="msg_1", output_index=0),
    event("response.output_text.delta", 4, delta="lo.", item_id="msg_1", output_index=0),
    event("response.output_text.done", 5, text="Hello.", item_id="msg_1", output_index=0),
    event("response.output_item.done", 6, output_index=0, item={"type": "message"}),
]


def terminal(kind: str = "response.completed", status: str = "completed", **fields: Any) -> bytes:
    return event(kind, 7, response=response(status, **fields))


STREAM = b"".join([*HEAD, terminal()])
INCOMPLETE = b"".join([*HEAD, terminal("response.incomplete", "incomplete")])


def stream_defect(body: bytes, content_type: str = SSE_TYPE) -> AnswerDefect | None:
    return answer_defect(stream=True, status=200, content_type=content_type, body=body)


def json_defect(body: bytes | dict[str, Any], content_type: str = JSON_TYPE) -> AnswerDefect | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return answer_defect(stream=False, status=200, content_type=content_type, body=raw)


def test_a_finished_response_is_complete() -> None:
    assert json_defect(response()) is None
    assert json_defect(response(output=[])) is None  # nothing generated: still an answer
    assert json_defect(response(error=None)) is None  # OpenAI writes the null field
    assert stream_defect(STREAM) is None
    assert stream_defect(STREAM, "text/event-stream") is None
    assert stream_defect(b": keep-alive\n\n" + STREAM) is None
    # No sequence numbers (another server), CRLF framing.
    crlf = b"".join(
        event(kind, None, "\r\n", response=body)
        for kind, body in (("response.created", INITIAL), ("response.completed", response()))
    )
    assert stream_defect(crlf) is None


def test_incomplete_by_its_own_max_output_tokens_is_the_requests_answer() -> None:
    """As chat's finish_reason "length": the same request, with the same cap, is cut at
    the same token (a clamp's lower cap is never cached)."""
    assert json_defect(response("incomplete")) is None
    assert stream_defect(INCOMPLETE) is None
    filtered = response("incomplete", incomplete_details={"reason": "content_filter"})
    assert json_defect(filtered) is AnswerDefect.FAILED_CHOICE
    assert json_defect(response("incomplete", incomplete_details=None)) is (
        AnswerDefect.FAILED_CHOICE
    )
    filtered_stream = b"".join(
        [
            *HEAD,
            terminal("response.incomplete", "incomplete", incomplete_details={"reason": "x"}),
        ]
    )
    assert stream_defect(filtered_stream) is AnswerDefect.FAILED_CHOICE


@pytest.mark.parametrize(
    ("status", "defect"),
    [
        ("failed", AnswerDefect.ERROR),
        ("cancelled", AnswerDefect.FAILED_CHOICE),  # vLLM's aborted harmony generation
        ("in_progress", AnswerDefect.UNFINISHED_CHOICE),
        ("queued", AnswerDefect.UNFINISHED_CHOICE),
        ("done", AnswerDefect.MALFORMED),
    ],
)
def test_a_status_that_is_not_a_finished_answer(status: str, defect: AnswerDefect) -> None:
    assert json_defect(response(status)) is defect


@pytest.mark.parametrize("whole", [STREAM, INCOMPLETE])
def test_a_stream_cut_at_any_point_is_not_complete(whole: bytes) -> None:
    for end in range(len(whole)):
        assert stream_defect(whole[:end]) is not None, whole[:end]


def test_a_response_cut_at_any_point_is_not_complete() -> None:
    body = json.dumps(response()).encode()
    for end in range(len(body)):
        assert json_defect(body[:end]) in (AnswerDefect.MALFORMED, AnswerDefect.EMPTY)


def test_where_a_stream_was_cut_names_why() -> None:
    assert stream_defect(b"".join(HEAD)) is AnswerDefect.NO_DONE
    assert stream_defect(STREAM[:-1]) is AnswerDefect.NO_DONE  # the terminal not terminated
    assert stream_defect(b": ping\n\n") is AnswerDefect.EMPTY


def test_an_error_or_a_failed_response_is_an_error() -> None:
    error = event("error", 7, code="server_error", message="engine died", param=None)
    assert stream_defect(b"".join([*HEAD, error])) is AnswerDefect.ERROR
    failed = terminal("response.failed", "failed", error={"code": "server_error"})
    assert stream_defect(b"".join([*HEAD, failed])) is AnswerDefect.ERROR
    assert stream_defect(STREAM + error) is AnswerDefect.ERROR  # even after the end
    # vLLM's error body (a 200 from a proxy, or a 4xx/5xx answered as JSON).
    body = {"error": {"message": "x", "type": "BadRequestError", "param": None, "code": 400}}
    assert json_defect(body) is AnswerDefect.ERROR
    assert json_defect(response(error={"code": "server_error", "message": "x"})) is (
        AnswerDefect.ERROR
    )


@pytest.mark.parametrize(
    "events",
    [
        [*HEAD[1:], terminal()],  # no response.created first
        [HEAD[0], HEAD[0], terminal()],  # created twice
        [*HEAD, terminal(), terminal()],  # anything after the terminal event
        [*HEAD, terminal("response.completed", "incomplete")],  # the status disagrees
        [*HEAD, terminal("response.incomplete", "completed")],
        [*HEAD, event("response.completed", 7, response={"status": "completed"})],
        [*HEAD, event("response.completed", 7)],  # no response at all
        [*HEAD, event("ping", 7), terminal()],  # not this grammar
        [*HEAD[:3], HEAD[4], HEAD[3], terminal()],  # sequence numbers going back
    ],
)
def test_events_out_of_the_grammar_are_malformed(events: list[bytes]) -> None:
    assert stream_defect(b"".join(events)) is AnswerDefect.MALFORMED


def test_framing_that_is_not_the_apis() -> None:
    renamed = STREAM.replace(b"event: response.in_progress", b"event: response.created")
    assert stream_defect(renamed) is AnswerDefect.MALFORMED
    assert stream_defect(STREAM + b"data: [DONE]\n\n") is AnswerDefect.MALFORMED
    assert stream_defect(b"data: {oops\n\n") is AnswerDefect.MALFORMED
    assert stream_defect(b"\xff" + STREAM) is AnswerDefect.MALFORMED
    assert json_defect(response(object="chat.completion")) is AnswerDefect.MALFORMED
    assert json_defect(response(output=None)) is AnswerDefect.MALFORMED
    assert json_defect(b'"completed"') is AnswerDefect.MALFORMED


def test_the_head_the_request_asked_for() -> None:
    body = json.dumps(response()).encode()
    for status in (201, 400, 429, 500, 503):
        assert (
            answer_defect(stream=False, status=status, content_type=JSON_TYPE, body=body)
            is AnswerDefect.STATUS
        )
    assert json_defect(body, "text/html") is AnswerDefect.CONTENT_TYPE
    assert json_defect(STREAM, SSE_TYPE) is AnswerDefect.STREAM_MISMATCH
    assert stream_defect(body, JSON_TYPE) is AnswerDefect.STREAM_MISMATCH
    assert stream_defect(b"\n\n") is AnswerDefect.EMPTY
