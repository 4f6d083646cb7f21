"""Steering for broken 200 answers: a generation that fails, ends early or is aborted after
its headers went out, and a 200 that a proxy in front of vLLM made up."""

from __future__ import annotations

import json

from aiohttp.test_utils import TestClient

from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, event_json, split_sse, stats

STREAM = {"stream": True, "max_tokens": 8, "stream_options": {"include_usage": True}}
ENGINE_DEAD = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) '
    b'for the root cause.", "type": "BadRequestError", "param": null, "code": 400}}'
)


async def _stream(client: TestClient, path: str, body: dict, **headers: str) -> list[bytes]:
    resp = await client.post(path, json=body, headers=headers)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    return split_sse(await resp.read())


def _choices(events: list[bytes]) -> list[dict]:
    return [c for e in events if e != b"data: [DONE]" for c in event_json(e)["choices"]]


async def test_a_generation_failing_mid_stream_sends_vllms_error_event(client: TestClient) -> None:
    events = await _stream(client, CHAT, chat_body(**STREAM), **{"x-sim-stream-error-after": "3"})
    # role, three tokens, then the error event (json.dumps' separators) and [DONE].
    assert len(events) == 1 + 3 + 2
    assert events[-2] == ENGINE_DEAD and events[-1] == b"data: [DONE]"
    assert all(c["finish_reason"] is None for c in _choices(events[:-2]))
    snap = await stats(client)
    assert snap["aborted_total"] == 1 and snap["kv_blocks_used"] == 0


async def test_a_plain_request_whose_engine_dies_is_a_bare_500(client: TestClient) -> None:
    body = chat_body(max_tokens=8)
    resp = await client.post(CHAT, json=body, headers={"x-sim-stream-error-after": "3"})
    assert resp.status == 500 and await resp.read() == b""


async def test_a_stream_that_ends_cleanly_before_done(client: TestClient) -> None:
    events = await _stream(client, CHAT, chat_body(**STREAM), **{"x-sim-end-after": "2"})
    assert len(events) == 1 + 2  # role and two tokens: no finish, no usage, no [DONE]
    assert b"[DONE]" not in b"".join(events)
    assert (await stats(client))["kv_blocks_used"] == 0
    plain = await client.post(CHAT, json=chat_body(), headers={"x-sim-end-after": "2"})
    assert plain.status == 400


async def test_an_engine_abort_finishes_every_running_choice_with_abort(
    client: TestClient,
) -> None:
    body = chat_body(**STREAM, n=2, logprobs=True)
    events = await _stream(client, CHAT, body, **{"x-sim-finish-abort-after": "3"})
    finishes = [(c["index"], c["finish_reason"]) for c in _choices(events) if c["finish_reason"]]
    assert finishes == [(0, "abort"), (1, "abort")]
    last = [c for c in _choices(events) if c["finish_reason"]]
    assert all(c["delta"] == {"content": ""} and c["logprobs"] == {"content": []} for c in last)
    usage = event_json(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert events[-1] == b"data: [DONE]"
    snap = await stats(client)
    assert snap["aborted_total"] == 2 and snap["kv_blocks_used"] == 0


async def test_an_engine_abort_in_a_plain_answer_and_a_completion_stream(
    client: TestClient,
) -> None:
    headers = {"x-sim-finish-abort-after": "2"}
    plain = await (await client.post(CHAT, json=chat_body(max_tokens=8), headers=headers)).json()
    assert plain["choices"][0]["finish_reason"] == "abort"
    assert plain["usage"]["completion_tokens"] == 2
    body = {"model": MODEL, "prompt": "Once", **STREAM}
    events = await _stream(client, COMPLETIONS, body, **headers)
    choices = _choices(events)
    assert [c["finish_reason"] for c in choices] == [None, None, "abort"]
    assert choices[-1]["text"] == ""
    # More tokens than the answer has: it ends as it would have.
    events = await _stream(client, CHAT, chat_body(**STREAM), **{"x-sim-finish-abort-after": "99"})
    assert _choices(events)[-1]["finish_reason"] == "length"


async def test_a_proxy_in_front_answers_200_with_html_or_nothing(client: TestClient) -> None:
    html = await client.post(CHAT, json=chat_body(), headers={"x-sim-proxy-answer": "html"})
    assert html.status == 200 and html.headers["Content-Type"] == "text/html; charset=utf-8"
    assert (await html.read()).startswith(b"<!DOCTYPE html>")
    for body, content_type in (
        (chat_body(stream=True), "text/event-stream; charset=utf-8"),
        (chat_body(), "application/json"),
    ):
        empty = await client.post(CHAT, json=body, headers={"x-sim-proxy-answer": "empty"})
        assert empty.status == 200 and empty.headers["Content-Type"] == content_type
        assert await empty.read() == b""
    bad = await client.post(CHAT, json=chat_body(), headers={"x-sim-proxy-answer": "xml"})
    assert bad.status == 400
    # Never reached the engine, but recorded as arrivals (with what was asked).
    snap = await stats(client)
    assert snap["requests_total"] == 0 and snap["generation_requests_total"] == 4
    records = await (await client.get("/sim/requests")).json()
    answered = records["requests"][:3]
    assert [r["body"].get("stream") for r in answered] == [None, True, None]
    assert json.dumps(records).count("x-sim-proxy-answer") == 4
