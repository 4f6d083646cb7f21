"""A test-only record of the /v1/* requests that reached the simulator.

``GET /sim/requests`` shows what a gateway in front really forwarded: the method,
path, every header (credentials included, so a test can assert they were stripped),
the x-request-id, and the generation fields of the JSON body that decide how much
the engine may generate. Bounded; ``POST /sim/reset`` clears it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# JSON body fields copied into a record, when present (raw values, null included).
RECORDED_BODY_FIELDS = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "ignore_eos",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass
class RequestRecord:
    seq: int
    time: float
    method: str
    path: str
    headers: dict[str, str]
    request_id: str | None
    status: int | None = None
    body: dict[str, Any] | None = None
    body_keys: list[str] | None = None
    prompt_embeds: bool = False

    def note_body(self, body: dict[str, Any]) -> None:
        self.body = {k: body[k] for k in RECORDED_BODY_FIELDS if k in body}
        self.body_keys = list(body)
        self.prompt_embeds = body.get("prompt_embeds") is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": self.time,
            "method": self.method,
            "path": self.path,
            "request_id": self.request_id,
            "status": self.status,
            "headers": self.headers,
            "body": self.body,
            "body_keys": self.body_keys,
            "prompt_embeds": self.prompt_embeds,
        }


@dataclass
class RequestLog:
    """The last ``capacity`` /v1/* requests, oldest first, plus exact counters."""

    capacity: int = 1000
    records: deque[RequestRecord] = field(default_factory=deque)
    total: int = 0
    generation_total: int = 0

    def __post_init__(self) -> None:
        self.records = deque(maxlen=self.capacity)

    def add(self, method: str, path: str, headers: Any) -> RequestRecord:
        self.total += 1
        if path in GENERATION_PATHS:
            self.generation_total += 1
        merged: dict[str, str] = {}
        for name, value in headers.items():
            key = name.lower()
            merged[key] = f"{merged[key]}, {value}" if key in merged else value
        record = RequestRecord(
            seq=self.total,
            time=time.time(),
            method=method,
            path=path,
            headers=merged,
            request_id=merged.get("x-request-id"),
        )
        self.records.append(record)
        return record

    def clear(self) -> None:
        self.records.clear()
        self.total = 0
        self.generation_total = 0

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        records = list(self.records)
        if limit is not None:
            records = records[-limit:] if limit > 0 else []
        return {
            "total": self.total,
            "generation_requests_total": self.generation_total,
            "requests": [r.to_json() for r in records],
        }
