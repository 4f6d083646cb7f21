"""Small helpers shared by the simulator tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from testbed.demo_model import DEMO_MODEL_NAME

MODEL = DEMO_MODEL_NAME
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "Hello there, how are you?"}]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER_HI, **extra}


def split_sse(raw: bytes) -> list[bytes]:
    """SSE events (without the trailing blank line); asserts the framing."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(b"data: "), event
    return events


def event_json(event: bytes) -> dict[str, Any]:
    return json.loads(event[len(b"data: ") :])


async def stats(client: TestClient) -> dict[str, Any]:
    resp = await client.get("/sim/stats")
    assert resp.status == 200
    return await resp.json()


async def wait_for(client: TestClient, predicate: Any, within_s: float = 5.0) -> dict[str, Any]:
    """Poll /sim/stats until ``predicate(stats)`` holds."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        snap = await stats(client)
        if predicate(snap):
            return snap
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached; last stats: {snap}")
        await asyncio.sleep(0.02)


LABELS = {"model_name": MODEL, "engine": "0"}


async def scrape(client: TestClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    wanted = {**LABELS, **labels}
    matches = [v for lab, v in samples[name] if lab == wanted]
    assert len(matches) == 1, (name, samples.get(name))
    return matches[0]
