"""What several session test modules share: a chat request, the chunks and the usage event of
its streamed answer, the error an immediate response carries, and a rig with tracing on and
one streamed chat through it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.session.conftest import (
    SessionRig,
    _rig,
    body_msg,
    header_values,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
    sse_events,
)

CHAT = {
    "model": "qwen2.5-demo",
    "messages": [{"role": "user", "content": "Write a haiku about KV caches."}],
    "max_tokens": 64,
}


def chunk(content: str | None = None, role: bool = False, finish: str | None = None) -> dict:
    delta: dict = {"role": "assistant", "content": ""} if role else {"content": content}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "qwen2.5-demo",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def usage_event(prompt: int, completion: int) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "qwen2.5-demo",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
    }


def error_of(reply) -> tuple[int, dict, dict[str, str]]:
    assert reply.WhichOneof("response") == "immediate_response"
    imm = reply.immediate_response
    return imm.status.code, json.loads(imm.body), header_values(imm.headers)


async def traced_rig(exporter: InMemorySpanExporter, **tracing: Any) -> AsyncIterator[SessionRig]:
    config = make_config()
    config["tracing"] = {"enabled": True, **tracing}
    async for rig in _rig(config, span_exporter=exporter):
        yield rig


async def run_stream(rig: SessionRig, extra_headers: dict[str, str]) -> int:
    """One streamed chat, admitted, answered and settled; returns its prompt tokens."""
    body = dict(CHAT, stream=True)
    prompt = await rig.server.tokenizers.count_chat(body["model"], body["messages"])
    stream = rig.stream()
    await stream.exchange(headers_msg(extra=extra_headers))
    reply = await stream.exchange(body_msg(body))
    assert reply.WhichOneof("response") == "request_body"
    await stream.exchange(response_headers_msg())
    events = [chunk(role=True), chunk(" Hi", finish="stop"), usage_event(prompt, 2), "[DONE]"]
    await stream.exchange(response_body_msg(sse_events(events), end_of_stream=True))
    await stream.half_close()
    assert await rig.in_flight() == (0, 0)  # drains the settlement's store write too
    return prompt
