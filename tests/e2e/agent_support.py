"""What the agent-API end-to-end tests share: long agent prompts (a system prompt, tool
definitions, tool outputs), kvgate's ledger and in-flight state for one tenant and model,
and raw SSE streams cut at a chosen point.

Nothing here knows how kvgate counts: the sizes of the prompts below are whatever the
engine (the simulator) reports, and the tests compare kvgate's numbers with those.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from testbed.harness import DEFAULT_BACKEND, Stack, kvgate_metrics, kvgate_usage, wait_until

SETTLE_TIMEOUT_S = 10.0

# Common English words, each one token of the demo (Qwen2) vocabulary with its leading
# space, so a text of n of them is about n tokens.
_TEXT = (
    "the river runs past the old mill where people walk in the evening and talk about "
    "the weather the market the harvest and the long road to town while children play "
    "near the water under the trees"
)
_VOCABULARY = _TEXT.split()


def prose(words: int, seed: int) -> str:
    """`words` words of filler text, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCABULARY) for _ in range(words))


def system_prompt(words: int = 2_800) -> str:
    """A long agent system prompt: rules, then a project description."""
    rules = (
        "You are a coding agent working in a large repository. Use the tools to read, "
        "search and change files, and run the tests after every change. Never guess the "
        "content of a file: read it first. Explain each step in one sentence.\n"
    )
    return rules + "Project notes:\n" + prose(words, seed=1)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    properties: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": self.properties, "required": list(self.properties)}

    def anthropic(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.schema()}

    def responses(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.schema(),
        }


TOOLS = (
    Tool("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
    Tool(
        "search_code",
        "Search the repository for a regular expression; returns matching lines.",
        {"pattern": {"type": "string"}, "glob": {"type": "string"}},
    ),
    Tool(
        "write_file",
        "Replace a file's content.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
    ),
    Tool(
        "run_tests",
        "Run the test suite (or the tests matching a keyword) and return the report.",
        {"keyword": {"type": "string"}},
    ),
)


def tool_call(turn: int) -> tuple[str, dict[str, Any]]:
    """The tool an agent calls after turn `turn`, with its arguments."""
    tool = TOOLS[turn % len(TOOLS)]
    args = {
        "read_file": {"path": f"src/module_{turn}.py"},
        "search_code": {"pattern": f"def handler_{turn}", "glob": "*.py"},
        "write_file": {"path": f"src/module_{turn}.py", "content": prose(40, seed=900 + turn)},
        "run_tests": {"keyword": f"module_{turn}"},
    }[tool.name]
    return tool.name, args


def tool_output(turn: int, words: int = 1_300) -> str:
    """What the tool returned: a long file, search report or test log."""
    return f"Output of call {turn}:\n" + prose(words, seed=100 + turn)


def user_message(turn: int) -> str:
    return f"Step {turn}: look at what the tool returned and continue with the next change."


# --------------------------------------------------------------------------- ledger


@dataclass
class Served:
    """The engine's usage summed over requests (what was served)."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    def add(self, prompt: int, output: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.output_tokens += output

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }


LEDGER_KEYS = ("requests", "prompt_tokens", "output_tokens")


def ledger(stack: Stack, tenant: str, model: str) -> dict[str, dict[str, int]]:
    """A tenant's ledger this month: its totals ("total") and the model's ("model"),
    zeros when nothing is booked."""
    out = {"total": dict.fromkeys(LEDGER_KEYS, 0), "model": dict.fromkeys(LEDGER_KEYS, 0)}
    for entry in kvgate_usage(stack).get("tenants", []):
        if entry.get("tenant") != tenant:
            continue
        month = entry["this_month"]
        out["total"] = {key: int(month[key]) for key in LEDGER_KEYS}
        by_model = month.get("by_model", {}).get(model)
        if by_model is not None:
            out["model"] = {key: int(by_model[key]) for key in LEDGER_KEYS}
    return out


def wait_ledger(stack: Stack, tenant: str, model: str, requests: int) -> dict[str, dict[str, int]]:
    """The ledger once `requests` requests are booked for the tenant (settlement lands just
    after the client's last byte), or after the timeout."""
    return wait_until(
        lambda: ledger(stack, tenant, model),
        lambda got: got["total"]["requests"] >= requests,
        timeout=SETTLE_TIMEOUT_S,
    )


def metered(stack: Stack, tenant: str, model: str) -> dict[str, int]:
    """kvgate's Prometheus token counters for the tenant and model."""
    metrics = kvgate_metrics(stack)
    labels = {"tenant": tenant, "model": model}
    return {
        "prompt_tokens": int(metrics.value("kvgate_prompt_tokens_total", **labels)),
        "output_tokens": int(metrics.value("kvgate_output_tokens_total", **labels)),
    }


def in_flight(stack: Stack, backend: str = DEFAULT_BACKEND) -> tuple[float, float]:
    """kvgate's reserved KV tokens and requests in flight on the backend."""
    metrics = kvgate_metrics(stack)
    return (
        metrics.value("kvgate_kv_tokens_in_flight", backend=backend),
        metrics.value("kvgate_requests_in_flight", backend=backend),
    )


def assert_nothing_in_flight(stack: Stack, backend: str = DEFAULT_BACKEND) -> None:
    left = wait_until(
        lambda: in_flight(stack, backend), lambda v: v == (0, 0), timeout=SETTLE_TIMEOUT_S
    )
    assert left == (0, 0), f"kvgate still holds (KV tokens, requests) {left} on {backend}"


def access_entry(stack: Stack, request_id: str) -> dict[str, Any]:
    """Envoy's access-log entry of one request (kvgate's dynamic metadata included)."""
    return stack.wait_access_log(lambda e: e["request_id"] == request_id)


def reservation(prompt: int, max_new: int, block: int) -> int:
    """KV tokens a request of `prompt` tokens allowed `max_new` new ones takes, in whole
    blocks."""
    return math.ceil((prompt + max_new) / block) * block


# --------------------------------------------------------------------------- cut streams


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The complete named SSE events in `raw` (event name, decoded data); a partial last
    event is left out."""
    events: list[tuple[str, dict[str, Any]]] = []
    blocks = raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n")
    for block in blocks[:-1]:  # the last one is not terminated (or empty)
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            events.append((name, json.loads("\n".join(data))))
    return events


@dataclass
class CutStream:
    """A stream the client left early: what it had read when it closed the connection."""

    status: int
    request_id: str
    raw: bytes = b""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def count(self, name: str) -> int:
        return sum(1 for event, _ in self.events if event == name)


def cut_stream(
    stack: Stack,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    events: tuple[str, int] = ("", 0),
    more_bytes: int = 0,
) -> CutStream:
    """POST a streamed request through Envoy with a raw HTTP client, read until
    `events` = (event name, n) such events arrived (n = 0: only the response headers),
    then `more_bytes` bytes more (whatever was in flight arrives too: the body is read as
    the socket delivers it), then close the connection."""
    name, wanted = events
    with (
        httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0)) as client,
        client.stream(
            "POST", stack.base_url + path, json=dict(body), headers=dict(headers)
        ) as resp,
    ):
        cut = CutStream(resp.status_code, resp.headers["x-request-id"])
        if resp.status_code != 200:
            cut.raw = resp.read()
            return cut
        reached: int | None = 0 if wanted == 0 else None  # body length when `events` arrived
        if reached is None or more_bytes:
            for part in resp.iter_raw():
                cut.raw += part
                if reached is None:
                    if sum(1 for event, _ in sse_events(cut.raw) if event == name) < wanted:
                        continue
                    reached = len(cut.raw)
                if len(cut.raw) >= reached + more_bytes:
                    break
        # Leaving the `with` closes the half-read response, and the connection with it.
    cut.events = sse_events(cut.raw)
    return cut
