"""Answer completeness by the API's grammar: what a cache or an Idempotency-Key may keep.

Well-formed answers come from the vLLM simulator itself (run in process, and its
formatters for hand-built shapes); broken ones are the shapes vLLM, or something in front
of it, really sends: an in-band error event, a cut stream, `finish_reason: abort`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvgate.openai.completeness import AnswerDefect, answer_defect, answer_is_complete
from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir
from vllm_sim import SimConfig, create_app
from vllm_sim.protocol import SSE_DONE, ChatFormatter, CompletionFormatter, error_body, sse
from vllm_sim.tokenization import SimTokenizer

SSE_TYPE = "text/event-stream; charset=utf-8"
JSON_TYPE = "application/json"


def stream_defect(body: bytes, content_type: str = SSE_TYPE) -> AnswerDefect | None:
    return answer_defect(stream=True, status=200, content_type=content_type, body=body)


def plain_defect(body: bytes, content_type: str = JSON_TYPE) -> AnswerDefect | None:
    return answer_defect(stream=False, status=200, content_type=content_type, body=body)


def chat_stream(
    *texts: str, finish: str = "stop", n: int = 1, usage: bool = True, done: bool = True
) -> bytes:
    """A chat stream as vLLM frames it: role chunks, one token chunk per text and choice,
    the last one finishing, the usage chunk, [DONE]."""
    fmt = ChatFormatter("chatcmpl-1", DEMO_MODEL_NAME, created=1)
    parts = [sse(fmt.role_chunk(i, [], None)) for i in range(n)]
    for i in range(n):
        for k, text in enumerate(texts):
            last = k == len(texts) - 1
            parts.append(sse(fmt.token_chunk(i, text, [], finish if last else None, None)))
    if usage:
        parts.append(sse(fmt.usage_chunk(5, len(texts) * n)))
    if done:
        parts.append(SSE_DONE)
    return b"".join(parts)


def completion_stream(*texts: str, finish: str = "length") -> bytes:
    fmt = CompletionFormatter("cmpl-1", DEMO_MODEL_NAME, created=1)
    parts = [
        sse(fmt.token_chunk(0, text, [], finish if k == len(texts) - 1 else None, None))
        for k, text in enumerate(texts)
    ]
    return b"".join([*parts, sse(fmt.usage_chunk(3, len(texts))), SSE_DONE])


def chat_body(*finishes: str | None) -> bytes:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": "hi"}, "finish_reason": f}
        for i, f in enumerate(finishes)
    ]
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": choices}
    return json.dumps(body).encode()


# --- the simulator's own answers, streamed and not -----------------------------------------


@pytest.fixture(scope="module")
def sim_tokenizer() -> SimTokenizer:
    return SimTokenizer(Path(demo_model_dir()))  # loaded once: every server below shares it


@pytest.fixture
async def sim(sim_tokenizer: SimTokenizer) -> AsyncIterator[TestClient]:
    config = SimConfig(model_dir=Path(demo_model_dir()), served_model_name=DEMO_MODEL_NAME)
    client = TestClient(TestServer(create_app(config, tokenizer=sim_tokenizer)))
    await client.start_server()
    yield client
    await client.close()


async def _answer(sim: TestClient, path: str, body: dict[str, Any]) -> tuple[str, bytes]:
    response = await sim.post(path, json={"model": DEMO_MODEL_NAME, **body})
    assert response.status == 200, await response.text()
    return response.headers["Content-Type"], await response.read()


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 6},
        {"max_tokens": 6, "n": 2},
        {"max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 3},
        {"max_tokens": 6, "stream_options": {"include_usage": True}},
        {"max_tokens": 6, "n": 2, "stream_options": {"include_usage": True}},
        {"max_tokens": 6, "logprobs": True, "top_logprobs": 2},
        {
            "max_tokens": 6,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_the_simulators_chat_answers_are_complete(
    sim: TestClient, body: dict[str, Any], stream: bool
) -> None:
    if not stream:
        body = {k: v for k, v in body.items() if k != "stream_options"}
    messages = [{"role": "user", "content": "Say something."}]
    content_type, raw = await _answer(
        sim, "/v1/chat/completions", {"messages": messages, "stream": stream, **body}
    )
    assert answer_defect(stream=stream, status=200, content_type=content_type, body=raw) is None


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 5},
        {"max_tokens": 5, "n": 2, "logprobs": 2},
        {"max_tokens": 5, "echo": True, "logprobs": 1},
        {"max_tokens": 5, "prompt": ["One", "Two"], "stream_options": {"include_usage": True}},
    ],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_the_simulators_completions_are_complete(
    sim: TestClient, body: dict[str, Any], stream: bool
) -> None:
    if not stream:
        body = {k: v for k, v in body.items() if k != "stream_options"}
    content_type, raw = await _answer(
        sim, "/v1/completions", {"prompt": "Once upon a time", "stream": stream, **body}
    )
    assert answer_defect(stream=stream, status=200, content_type=content_type, body=raw) is None


async def test_the_simulators_in_band_engine_refusal_is_an_error(sim: TestClient) -> None:
    # More logprobs than the engine allows: vLLM has answered 200 and sends an error event.
    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "stream": True, "logprobs": True, "top_logprobs": 21}
    content_type, raw = await _answer(sim, "/v1/chat/completions", body)
    assert b'"error"' in raw and raw.endswith(SSE_DONE)
    assert stream_defect(raw, content_type) is AnswerDefect.ERROR


# --- streams: framing -----------------------------------------------------------------


def test_a_vllm_chat_stream_is_complete() -> None:
    body = chat_stream(" the", " cat")
    assert answer_is_complete(stream=True, status=200, content_type=SSE_TYPE, body=body)


def test_crlf_framing_comments_and_other_fields_are_read_as_sse() -> None:
    body = chat_stream(" the", " cat")
    crlf = body.replace(b"\n", b"\r\n")
    assert stream_defect(crlf) is None
    assert stream_defect(body.replace(b"\n", b"\r")) is None  # lone CR line ends
    pinged = b": ping\n\n" + body.replace(b"\n\ndata:", b"\n\n: keep-alive\n\nid: 7\ndata:", 1)
    assert stream_defect(pinged) is None
    assert stream_defect(body + b": bye\n\n") is None  # a comment after [DONE]


def test_multi_line_data_joins_with_lf() -> None:
    fmt = ChatFormatter("chatcmpl-1", DEMO_MODEL_NAME, created=1)
    event = json.dumps(fmt.token_chunk(0, "hi", [], "stop", None), indent=1)
    multi = ("\n".join(f"data: {line}" for line in event.split("\n")) + "\n\n").encode()
    assert multi.count(b"data:") > 5
    assert stream_defect(multi + SSE_DONE) is None


def test_the_usage_only_chunk_and_continuous_usage_are_not_choices() -> None:
    assert stream_defect(chat_stream(" a", usage=True)) is None
    assert stream_defect(chat_stream(" a", usage=False)) is None
    fmt = ChatFormatter("chatcmpl-1", DEMO_MODEL_NAME, created=1)
    only_usage = sse(fmt.usage_chunk(5, 0)) + SSE_DONE
    assert stream_defect(only_usage) is AnswerDefect.NO_CHOICES


def test_completion_streams_and_their_logprobs() -> None:
    assert stream_defect(completion_stream(" the", " cat")) is None
    fmt = CompletionFormatter("cmpl-1", DEMO_MODEL_NAME, created=1)
    logprobs = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": [" a"], "top_logprobs": []}
    body = sse(fmt.token_chunk(0, " a", [], "length", None, None, logprobs)) + SSE_DONE
    assert stream_defect(body) is None


def test_two_choices_must_both_finish() -> None:
    assert stream_defect(chat_stream(" a", " b", n=2)) is None
    fmt = ChatFormatter("chatcmpl-1", DEMO_MODEL_NAME, created=1)
    one_open = b"".join(
        [
            sse(fmt.role_chunk(0, [], None)),
            sse(fmt.role_chunk(1, [], None)),
            sse(fmt.token_chunk(0, " a", [], "stop", None)),
            sse(fmt.token_chunk(1, " b", [], None, None)),
            SSE_DONE,
        ]
    )
    assert stream_defect(one_open) is AnswerDefect.UNFINISHED_CHOICE
    # Choice 0 never sent anything: index 1 alone is not a whole answer.
    only_second = sse(fmt.token_chunk(1, " b", [], "stop", None)) + SSE_DONE
    assert stream_defect(only_second) is AnswerDefect.UNFINISHED_CHOICE


# --- streams: what a failed generation looks like -------------------------------------------


def test_an_in_band_error_event_mid_stream() -> None:
    cut = chat_stream(" the", " cat", done=False, usage=False).rsplit(b"data:", 1)[0]
    error = json.dumps(error_body("Internal server error", "InternalServerError", 500))
    body = cut + f"data: {error}\n\n".encode() + SSE_DONE
    assert stream_defect(body) is AnswerDefect.ERROR
    legacy = json.dumps({"object": "error", "message": "boom", "type": "x", "code": 500})
    assert stream_defect(cut + f"data: {legacy}\n\n".encode() + SSE_DONE) is AnswerDefect.ERROR


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_choice_the_engine_gave_up_on(reason: str) -> None:
    assert stream_defect(chat_stream(" the", finish=reason)) is AnswerDefect.FAILED_CHOICE
    assert stream_defect(completion_stream(" the", finish=reason)) is AnswerDefect.FAILED_CHOICE


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "repetition"])
def test_other_finish_reasons_end_a_choice(reason: str) -> None:
    assert stream_defect(chat_stream(" the", finish=reason)) is None


def test_a_stream_that_ends_without_done() -> None:
    assert stream_defect(chat_stream(" the", done=False)) is AnswerDefect.NO_DONE
    # Every choice finished, the usage event came, but [DONE] never did.
    assert stream_defect(chat_stream(" the", usage=True, done=False)) is AnswerDefect.NO_DONE
    # [DONE] without its blank line is never dispatched: the stream did not end.
    assert stream_defect(chat_stream(" the")[:-1]) is AnswerDefect.NO_DONE
    # Cut inside an event.
    assert stream_defect(chat_stream(" the")[:40]) is AnswerDefect.NO_DONE


def test_nothing_may_follow_done() -> None:
    body = chat_stream(" the")
    assert stream_defect(body + body) is AnswerDefect.MALFORMED
    assert stream_defect(body + b"data: [DONE]") is AnswerDefect.MALFORMED


def test_events_that_are_not_completion_chunks() -> None:
    done = SSE_DONE
    assert stream_defect(b"data: not json\n\n" + done) is AnswerDefect.MALFORMED
    assert stream_defect(b"data: [1, 2]\n\n" + done) is AnswerDefect.MALFORMED
    assert stream_defect(b'data: {"object": "list", "choices": []}\n\n' + done) is (
        AnswerDefect.MALFORMED
    )
    no_choices = b'data: {"object": "chat.completion.chunk"}\n\n' + done
    assert stream_defect(no_choices) is AnswerDefect.MALFORMED
    mixed = chat_stream(" a", done=False) + completion_stream(" b")
    assert stream_defect(mixed) is AnswerDefect.MALFORMED
    # An event for a choice after its finish.
    fmt = ChatFormatter("chatcmpl-1", DEMO_MODEL_NAME, created=1)
    late = sse(fmt.token_chunk(0, "a", [], "stop", None)) + sse(
        fmt.token_chunk(0, "b", [], None, None)
    )
    assert stream_defect(late + done) is AnswerDefect.MALFORMED
    assert stream_defect(b"\xff\xfe" + chat_stream(" a")) is AnswerDefect.MALFORMED


def test_an_empty_stream() -> None:
    assert stream_defect(b"") is AnswerDefect.EMPTY
    assert stream_defect(b"\n\n") is AnswerDefect.EMPTY
    assert stream_defect(b": ping\n\n: ping\n\n") is AnswerDefect.EMPTY
    assert stream_defect(SSE_DONE) is AnswerDefect.NO_CHOICES


# --- plain JSON answers -------------------------------------------------------------


def test_a_plain_completion_object() -> None:
    assert plain_defect(chat_body("stop")) is None
    assert plain_defect(chat_body("stop", "length"), "application/json; charset=utf-8") is None
    text = {
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
    }
    assert plain_defect(json.dumps(text).encode()) is None


def test_plain_answers_that_are_not_whole_completions() -> None:
    assert plain_defect(b"") is AnswerDefect.EMPTY
    assert plain_defect(b"  \n") is AnswerDefect.EMPTY
    assert plain_defect(b'{"id": "chatcmpl-1", "object": "chat.completion"') is (
        AnswerDefect.MALFORMED
    )
    error = json.dumps(error_body("Internal server error", "InternalServerError", 500))
    assert plain_defect(error.encode()) is AnswerDefect.ERROR
    assert plain_defect(b'{"object": "list", "data": []}') is AnswerDefect.MALFORMED
    assert plain_defect(b'{"object": "chat.completion"}') is AnswerDefect.MALFORMED
    assert plain_defect(b'{"object": "chat.completion", "choices": []}') is AnswerDefect.NO_CHOICES
    assert plain_defect(chat_body("stop", "abort")) is AnswerDefect.FAILED_CHOICE
    assert plain_defect(chat_body("error")) is AnswerDefect.FAILED_CHOICE
    assert plain_defect(chat_body(None)) is AnswerDefect.UNFINISHED_CHOICE
    missing_first = json.loads(chat_body("stop", "stop"))
    missing_first["choices"] = missing_first["choices"][1:]
    assert plain_defect(json.dumps(missing_first).encode()) is AnswerDefect.UNFINISHED_CHOICE


# --- the response as a whole ---------------------------------------------------------------


def test_html_and_other_media_types() -> None:
    html = b"<html><body>502 Bad Gateway</body></html>"
    assert plain_defect(html, "text/html; charset=utf-8") is AnswerDefect.CONTENT_TYPE
    assert stream_defect(html, "text/html") is AnswerDefect.CONTENT_TYPE
    assert plain_defect(chat_body("stop"), "") is AnswerDefect.CONTENT_TYPE
    assert stream_defect(chat_stream(" a"), "TEXT/EVENT-STREAM") is None


def test_a_stream_to_a_plain_request_and_json_to_a_stream() -> None:
    assert plain_defect(chat_stream(" a"), SSE_TYPE) is AnswerDefect.STREAM_MISMATCH
    assert stream_defect(chat_body("stop"), JSON_TYPE) is AnswerDefect.STREAM_MISMATCH


@pytest.mark.parametrize("status", [201, 204, 206, 400, 500])
def test_only_a_200_is_an_answer(status: int) -> None:
    body = chat_body("stop")
    assert not answer_is_complete(stream=False, status=status, content_type=JSON_TYPE, body=body)
    assert (
        answer_defect(stream=False, status=status, content_type=JSON_TYPE, body=body)
        is AnswerDefect.STATUS
    )
