"""At the admission level, an interrupted reserve is released.

A real kvgate (memory store) behind a real grpc.aio channel; its store and tokenizers are
wrapped so that one call of the admission path pauses (the JSON parse off the loop, the
pre-check, each prompt count, the reserve before it reaches the store, the reserve after
it committed with its reply lost, and a reserve that commits only after the caller left).
At each of those points the stream is cancelled as Envoy does when a client goes away, or
the decision deadline expires; then nothing may stay held: no KV, no request in flight, no
concurrency slot or TPM, no RPM beyond the one slot a passed pre-check takes (spent by
design), and nothing booked. The tenant's limits are tight enough that
any leak refuses the next full-size request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.lifecycle.exchange import PARSE_OFF_LOOP_BYTES
from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from tests.session.cancel_helpers import Gate, ReserveMode, install
from tests.session.conftest import SessionRig, _rig, body_msg, headers_msg, make_config

MODEL = "qwen2.5-demo"
MAX_TOKENS = 500
# Over kvgate's parse threshold: parsed on a worker (tokenizers.run), an await point. The
# whitespace keeps it a few thousand tokens, well inside the context.
BIG_TEXT = (
    "Summarise the following notes. "
    + " " * PARSE_OFF_LOOP_BYTES
    + " ".join(f"note {i} says the river runs past the old mill" for i in range(200))
)
BIG_CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": BIG_TEXT}],
    "max_tokens": MAX_TOKENS,
}
SMALL_CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Summarise the plot of Hamlet."}],
    "max_tokens": MAX_TOKENS,
}
# A completions batch: one count per prompt, each an await point.
BATCH: dict[str, Any] = {
    "model": MODEL,
    "prompt": [[11] * 3000, [12] * 3000],
    "max_tokens": MAX_TOKENS,
}


@dataclass(frozen=True)
class Point:
    name: str
    target: str
    method: str
    body: dict[str, Any]
    occurrence: int = 1
    reserve_mode: ReserveMode = ReserveMode.COMMITTED

    @property
    def after_precheck(self) -> bool:
        """The pre-check took the request's RPM slot before this point. By design that
        slot stays spent when the request is cancelled (the request was made; refunding it
        would let a client have prompts tokenized past its RPM): abandon gives back what
        the reserve took, not the pre-check's slot."""
        return self.method not in ("run", "precheck")

    def gate(self) -> Gate:
        return Gate(self.target, self.method, self.occurrence, self.reserve_mode)


POINTS = [
    Point("parse-off-loop", "tokenizers", "run", BIG_CHAT),
    Point("precheck", "store", "precheck", BIG_CHAT),
    Point("count-chat", "tokenizers", "count_chat", BIG_CHAT),
    Point("count-completion-1", "tokenizers", "count_completion", BATCH, 1),
    Point("count-completion-2", "tokenizers", "count_completion", BATCH, 2),
    Point("reserve-before-store", "store", "reserve", BIG_CHAT, 1, ReserveMode.BEFORE),
    Point("reserve-committed-reply-lost", "store", "reserve", BIG_CHAT),
    Point("reserve-commits-after-cancel", "store", "reserve", BIG_CHAT, 1, ReserveMode.LANDS_LATE),
    Point("batch-reserve-committed-reply-lost", "store", "reserve", BATCH),
]
POINT_IDS = [p.name for p in POINTS]


def request_size(body: dict[str, Any]) -> int:
    """Tokens the request reserves from TPM: prompt(s) + sequences x max_new."""
    counter = PromptCounter.from_model_dir(demo_model_dir())
    if "messages" in body:
        return counter.count_chat(body["messages"]) + MAX_TOKENS
    prompts = body["prompt"]
    return sum(counter.count_completion(p) for p in prompts) + len(prompts) * MAX_TOKENS


def tight_config(body: dict[str, Any], spent_rpm: int, **server: Any) -> dict[str, Any]:
    """One full-size request fits the tenant at a time, whichever limit is looked at:
    1 in flight, 1 request per minute beyond the `spent_rpm` the cancelled request keeps,
    TPM for one and a half (and refilling ~nothing)."""
    config = make_config()
    size = request_size(body)
    config["tenants"][0]["limits"] = {
        "rpm": 1 + spent_rpm,
        "concurrency": 1,
        "tpm": {"capacity": size + size // 2, "refill_per_s": 0.001},
    }
    config["server"].update(server)
    return config


def headers_for(body: dict[str, Any]) -> pb.ProcessingRequest:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return headers_msg(path)


def kind(reply: pb.ProcessingResponse) -> str:
    return str(reply.WhichOneof("response"))


def immediate_error(reply: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert kind(reply) == "immediate_response", reply
    imm = reply.immediate_response
    return imm.status.code, json.loads(imm.body)


async def assert_nothing_held(rig: SessionRig, body: dict[str, Any]) -> None:
    """No KV or request in flight, nothing booked, and the tenant's slot, RPM and TPM all
    back: a full-size request is admitted (and a second one, while it holds, is not; so
    a leak of any of them would have shown)."""
    assert await rig.in_flight() == (0, 0)
    assert await rig.usage() == (0, 0, 0)
    first = rig.stream()
    await first.exchange(headers_for(body))
    admitted = await first.exchange(body_msg(body))
    if kind(admitted) != "request_body":
        status, error = immediate_error(admitted)
        pytest.fail(f"a full-size request was refused after the cancel: {status} {error}")
    second = rig.stream()
    await second.exchange(headers_for(body))
    status, error = immediate_error(await second.exchange(body_msg(body)))
    assert status == 429, error
    first.reset()
    second.reset()
    assert await rig.in_flight_after_reset() == (0, 0)


@pytest.mark.parametrize("point", POINTS, ids=POINT_IDS)
async def test_client_cancel_at_every_await_point_leaks_nothing(point: Point) -> None:
    async for rig in _rig(tight_config(point.body, int(point.after_precheck))):
        gate = point.gate()
        install(rig.server.services, gate)
        stream = rig.stream()
        await stream.exchange(headers_for(point.body))
        await stream._outbox.put(body_msg(point.body))  # no reply will come
        await gate.wait_reached()
        if point.reserve_mode is ReserveMode.COMMITTED and point.method == "reserve":
            # The reserve really took everything before its reply was lost.
            assert gate.committed is not None and gate.committed.admitted, gate.committed
            assert (await rig.server.store.backend_status())[0].requests_in_flight == 1
        stream.reset()  # RST_STREAM(CANCEL): the client went away
        await gate.wait_cancelled()
        gate.release.set()
        if gate.late_task is not None:
            late = await gate.late_task
            assert not late.admitted, "a reserve that landed after the cancel kept its hold"
        await assert_nothing_held(rig, point.body)


DEADLINE_POINTS = [p for p in POINTS if p.method in ("reserve", "count_chat")]


@pytest.mark.parametrize("point", DEADLINE_POINTS, ids=[p.name for p in DEADLINE_POINTS])
async def test_decision_deadline_while_paused_answers_503_and_leaks_nothing(
    point: Point,
) -> None:
    body = SMALL_CHAT if point.body is BIG_CHAT else point.body
    async for rig in _rig(tight_config(body, int(point.after_precheck), decision_timeout_s=0.5)):
        gate = point.gate()
        install(rig.server.services, gate)
        stream = rig.stream()
        await stream.exchange(headers_for(body))
        status, error = immediate_error(await stream.exchange(body_msg(body)))
        assert gate.reached.is_set() and gate.cancelled.is_set()
        assert status == 503, error
        assert error["error"]["code"] == "service_unavailable", error
        assert set(error["error"]) == {"message", "type", "param", "code"}
        gate.release.set()
        if gate.late_task is not None:
            late = await gate.late_task
            assert not late.admitted, "a reserve that landed after the deadline kept its hold"
        await assert_nothing_held(rig, body)
