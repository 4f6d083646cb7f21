"""The answer recorder keeps only complete answers: an incomplete 2xx is a failed attempt
(nothing stored, the key free for a retry, `on_not_kept` told why). The real memory store."""

from __future__ import annotations

import json
from collections.abc import Coroutine
from typing import Any

import pytest

from kvgate.cache.answers import ClaimState, MemoryAnswerStore
from kvgate.lifecycle.idempotency import AnswerRecorder
from kvgate.openai.completeness import answer_defect
from kvgate.policy import SettleCause
from vllm_sim.protocol import SSE_DONE, ChatFormatter, error_body, sse

SSE_TYPE = "text/event-stream; charset=utf-8"
FMT = ChatFormatter("chatcmpl-1", "m", created=1)
WHOLE_STREAM = b"".join(
    [sse(FMT.role_chunk(0, [], None)), sse(FMT.token_chunk(0, " hi", [], "stop", None)), SSE_DONE]
)
WHOLE_JSON = (
    b'{"object":"chat.completion","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
)


class Tasks:
    def __init__(self) -> None:
        self.pending: list[Coroutine[Any, Any, None]] = []

    def track(self, coro: Coroutine[Any, Any, None]) -> None:
        self.pending.append(coro)

    async def run(self) -> None:
        while self.pending:
            await self.pending.pop(0)


async def _record(
    stream: bool | None, content_type: str, body: bytes
) -> tuple[MemoryAnswerStore, list[str]]:
    """One attempt for key "k" that ends normally with this answer."""
    store, tasks, why = MemoryAnswerStore(1 << 20), Tasks(), []
    claim = await store.claim("k", "fp", "first", 30)
    assert claim.state is ClaimState.STARTED
    recorder = AnswerRecorder(
        store,
        "k",
        "first",
        max_answer_bytes=1 << 20,
        retention_s=60,
        track=tasks.track,
        judge=answer_defect,  # chat/completions' rule
        keep_marker=True,  # as for an Idempotency-Key
        on_not_kept=why.append,
        stream=stream,
    )
    recorder.on_headers(200, content_type)
    recorder.on_chunk(body[: len(body) // 2])
    recorder.on_chunk(body[len(body) // 2 :])
    recorder.finish(SettleCause.COMPLETED)
    await tasks.run()
    return store, why


@pytest.mark.parametrize(
    ("stream", "content_type", "body"),
    [
        (True, SSE_TYPE, WHOLE_STREAM),
        (None, SSE_TYPE, WHOLE_STREAM),
        (False, "application/json", WHOLE_JSON),
    ],
)
async def test_a_complete_answer_is_stored(
    stream: bool | None, content_type: str, body: bytes
) -> None:
    store, why = await _record(stream, content_type, body)
    claim = await store.claim("k", "fp", "retry", 30)
    assert claim.state is ClaimState.COMPLETED and claim.answer is not None
    assert claim.answer.body == body and why == []


ERROR_EVENT = f"data: {json.dumps(error_body('boom', 'BadRequestError', 400))}\n\n".encode()


@pytest.mark.parametrize(
    ("stream", "content_type", "body", "reason"),
    [
        (True, SSE_TYPE, WHOLE_STREAM[: -len(SSE_DONE)] + ERROR_EVENT + SSE_DONE, "error"),
        (True, SSE_TYPE, WHOLE_STREAM[: -len(SSE_DONE)], "no_done"),
        (True, SSE_TYPE, WHOLE_STREAM.replace(b'"stop"', b'"abort"'), "failed_choice"),
        (None, SSE_TYPE, WHOLE_STREAM.replace(b'"stop"', b'"abort"'), "failed_choice"),
        (False, "text/html; charset=utf-8", b"<html></html>", "content_type"),
        (False, "application/json", b"", "empty"),
        (True, "application/json", WHOLE_JSON, "stream_mismatch"),
        (False, SSE_TYPE, WHOLE_STREAM, "stream_mismatch"),
        (False, "application/json", WHOLE_JSON.replace(b'"stop"', b"null"), "unfinished_choice"),
    ],
)
async def test_an_incomplete_answer_frees_the_key(
    stream: bool | None, content_type: str, body: bytes, reason: str
) -> None:
    store, why = await _record(stream, content_type, body)
    assert why == [reason]
    # Nothing stored, no not-kept marker: the retry runs anew.
    retry = await store.claim("k", "fp", "retry", 30)
    assert retry.state is ClaimState.STARTED
