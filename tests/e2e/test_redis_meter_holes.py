"""A Redis outage against the real stack (a live stream, interrupted reserves; a late
redelivered settlement: see below): Envoy -> kvgate (one replica, its state in a private
redis-server on a free port) -> the vLLM simulator. The outage is a SIGSTOP of that Redis
(connections stay open, nothing answers; what kvgate sent meanwhile waits in the sockets
and runs when SIGCONT resumes it).

- Hole 15, a short outage frees a live stream: a stream served through a 3.8 s outage under
  a 5 s lease keeps its reservation (kvgate's in-flight gauges and Redis itself show exactly
  its KV, sampled while it still streams, past a whole lease after the outage) and the ledger
  books exactly the usage the client received. The reserves that timed out during the
  outage (503 under fail_closed, admitted locally under fail_open) hold nothing once kvgate
  has recovered.
- Hole 7, an interrupted reserve leaks: reserves whose reply is lost (Redis paused as they
  arrive: the call times out at `redis.timeout_s`, the script commits on resume), and
  reserves cancelled by the client mid-admission, hold nothing once kvgate has recovered: no
  KV, no tenant slot; the tenant gets its full concurrency at once, long before the lease
  could have expired. Under fail_open the requests served locally are not held in Redis too.
- Hole 13 (a settlement delivered twice is booked once, however late) is not tested end to
  end, on purpose: the scenario needs a settlement whose first attempt surely lands while
  its reply is lost, then a redelivery after `settled_id_retention_s`. Pausing Redis under a
  real kvgate does not give that reliably: whether a timed-out call was written at all
  seems to depend on the client's connection pool (most likely, a call that needs a new
  connection hangs in its handshake on the paused Redis and is never sent), so a two-replica version
  (replica 2 trimming the old dedup window between the landing and replica 1's redelivery)
  saw no first landing in about one run in three, on the new code and the old alike. The
  store-level test drives exactly that sequence deterministically (a landed settlement,
  the clock an hour past the window, the redelivery from the fallback queue):
  tests/store/test_redis_failures.py::test_a_settlement_redelivered_after_any_window_is_booked_once.

"Recovered" is kvgate's own `kvgate_store_up` back at 1: the fallback store replays
renewals and releases orphans before it marks Redis up, so the states are checked right then
(no wait that a lease expiry could satisfy).

The store-level versions: tests/store/test_redis_failures.py and
tests/store/test_interrupted_reserve.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import httpx
import pytest

from testbed.demo_model import demo_model_dir
from testbed.harness import DEFAULT_BACKEND, Stack, kvgate_metrics
from testbed.redis_harness import RedisServer

_T = TypeVar("_T")

MODEL = "qwen2.5-demo"
BACKEND = DEFAULT_BACKEND
CHAT = "/v1/chat/completions"
LEASE_TTL_S = 5.0
REDIS_TIMEOUT_S = 0.5
PROBE_S = 0.2
OUTAGE_S = 3.8
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# Bounded waits for states: generous for a loaded 2-core machine.
WAIT_S = 15.0

# The live stream of hole 15: 7 tokens, 2 s apart (so the test knows when it still streams).
LIVE_TOKENS = 7
LIVE_ITL_MS = 2000

TENANTS = [
    {"name": "live", "api_key": "sk-live"},  # hole 15's stream
    {"name": "other", "api_key": "sk-other"},  # requests sent during the outage
    {"name": "burst", "api_key": "sk-burst", "limits": {"concurrency": 3}},  # hole 7
    {"name": "cancel", "api_key": "sk-cancel", "limits": {"concurrency": 3}},  # hole 7
]


def models() -> list[dict[str, Any]]:
    return [
        {
            "name": MODEL,
            "tokenizer": str(demo_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 64,
            "backend": BACKEND,
            "pricing": {"input_per_million": "2", "output_per_million": "6"},
        }
    ]


class RedisReplica(Stack):
    """The e2e stack with one kvgate whose store is a private redis-server (no persistence)."""

    def __init__(self, *, redis_config: Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.redis = RedisServer(self.work_dir / "redis")
        self.redis_config = {"key_prefix": f"holes-{uuid.uuid4().hex[:8]}", **redis_config}

    @property
    def tag(self) -> str:
        return "{" + str(self.redis_config["key_prefix"]) + "}"

    def kvgate_config(self) -> dict[str, Any]:
        config = super().kvgate_config()
        config["store"] = self.redis.url
        config["redis"] = dict(self.redis_config)
        return config

    def processes(self) -> list[Any]:
        return [*super().processes(), self.redis.process]

    def start(self) -> Self:
        if self._started:
            return self
        self.redis.start()
        return super().start()  # on failure it stops everything, Redis included

    def stop(self) -> None:
        keep = self.keep_work_dir
        self.keep_work_dir = True  # Redis still writes there; removed below
        try:
            super().stop()  # kvgate settles into Redis on shutdown: Redis outlives it
        finally:
            self.redis.stop()
            self.keep_work_dir = keep
            if self._own_work_dir and not keep:
                shutil.rmtree(self.work_dir, ignore_errors=True)


# ---------------------------------------------------------------- views of the state


def redis_backend(stack: RedisReplica, tag: str) -> tuple[int, int]:
    """(KV tokens, requests) in flight on the backend, as Redis holds them."""
    with stack.redis.client() as client:
        kv, n = client.hmget(f"{tag}:b|{BACKEND}", "kv", "n")
    return int(kv or 0), int(n or 0)


def redis_tenant_slots(stack: RedisReplica, tenant: str) -> int:
    """The tenant's requests in flight (tenant-wide concurrency), as Redis holds them."""
    with stack.redis.client() as client:
        return int(client.hget(f"{stack.tag}:t|{tenant}", "|n") or 0)


def kvgate_backend(stack: Stack) -> tuple[int, int]:
    """(KV tokens, requests) in flight per kvgate's gauges: a scrape reads the store's
    backend status (Redis, plus the local store's reservations under fail_open)."""
    metrics = kvgate_metrics(stack)
    return (
        int(metrics.value("kvgate_kv_tokens_in_flight", backend=BACKEND)),
        int(metrics.value("kvgate_requests_in_flight", backend=BACKEND)),
    )


def store_up(stack: Stack) -> bool:
    return kvgate_metrics(stack).value("kvgate_store_up") == 1


def ledger(stack: RedisReplica, tag: str, tenant: str) -> dict[str, int]:
    """The tenant's all-time ledger in Redis."""
    totals = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
    names = {"req": "requests", "pt": "prompt_tokens", "ot": "output_tokens"}
    with stack.redis.client() as client:
        for key, value in client.hgetall(f"{tag}:tot").items():
            name, _, kind = key.decode().rpartition("|")
            if name.split("|")[0] == tenant and kind in names:
                totals[names[kind]] += int(value)
    return totals


def booked(usages: list[dict[str, int]]) -> dict[str, int]:
    """What a ledger must hold for these usage blocks."""
    return {
        "requests": len(usages),
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "output_tokens": sum(u["completion_tokens"] for u in usages),
    }


async def poll(probe: Callable[[], _T], done: Callable[[_T], bool], within: float) -> _T:
    """`probe` (blocking; run off the event loop) until `done`, at most `within` s; the last
    result either way, for the caller's assertion."""
    deadline = time.monotonic() + within
    while True:
        result = await asyncio.to_thread(probe)
        if done(result) or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- requests


def chat(max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def sim_headers(key: str, tokens: int, itl_ms: int | None = None) -> dict[str, str]:
    headers = {"authorization": f"Bearer {key}", "x-sim-output-tokens": str(tokens)}
    if itl_ms is not None:
        headers["x-sim-itl-ms"] = str(itl_ms)
        headers["x-sim-ttft-ms"] = "20"
    return headers


@dataclass
class Streamed:
    """What the client of one streamed request received so far."""

    status: int = 0
    tokens: int = 0  # content events
    usage: dict[str, int] | None = None
    body: str = ""
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False


async def stream(client: httpx.AsyncClient, headers: dict[str, str], into: Streamed) -> None:
    body = chat(64, stream=True)
    try:
        async with client.stream("POST", CHAT, json=body, headers=headers) as response:
            into.status = response.status_code
            if response.status_code != 200:
                into.body = (await response.aread()).decode()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if event.get("usage"):
                    into.usage = event["usage"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if "role" not in delta and delta.get("content") is not None:
                        into.tokens += 1
                        into.started.set()
    finally:
        into.ended = True
        into.started.set()


async def start_streams(
    client: httpx.AsyncClient, headers: dict[str, str], count: int
) -> tuple[list[Streamed], list[asyncio.Task[None]]]:
    records = [Streamed() for _ in range(count)]
    tasks = [asyncio.create_task(stream(client, headers, r)) for r in records]
    await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in records)), 30)
    return records, tasks


async def post_all(
    client: httpx.AsyncClient, headers: dict[str, str], count: int, max_tokens: int = 8
) -> list[httpx.Response]:
    return list(
        await asyncio.gather(
            *(client.post(CHAT, json=chat(max_tokens), headers=headers) for _ in range(count))
        )
    )


async def wait_recovered(stack: Stack) -> None:
    up = await poll(lambda: store_up(stack), bool, WAIT_S)
    assert up, "kvgate did not find Redis again"


async def wait_idle(stack: RedisReplica) -> None:
    def state() -> tuple[int, int]:
        kvgate_backend(stack)  # a status read: Redis sweeps the leases that expired
        return redis_backend(stack, stack.tag)

    left = await poll(state, lambda s: s == (0, 0), WAIT_S)
    assert left == (0, 0), f"work left in flight in Redis: {left}"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["fail_closed", "fail_open"])
def replica(request: pytest.FixtureRequest) -> Iterator[RedisReplica]:
    with RedisReplica(
        tenants=TENANTS,
        models=models(),
        kvgate_overrides={"server": {"lease_ttl_s": LEASE_TTL_S}},
        redis_config={
            "timeout_s": REDIS_TIMEOUT_S,
            "connect_timeout_s": REDIS_TIMEOUT_S,
            "probe_interval_s": PROBE_S,
            "failure_policy": request.param,
        },
    ) as stack:
        yield stack


def fail_open(stack: RedisReplica) -> bool:
    return stack.redis_config["failure_policy"] == "fail_open"


# ---------------------------------------------------------------- hole 15


async def test_a_short_outage_frees_no_live_stream_and_keeps_no_orphan(
    replica: RedisReplica,
) -> None:
    """Hole 15. The stream's last Redis write before the outage is its reserve; the outage
    (3.8 s) starts half a second after its first token, so its 5 s lease lapses about a second after
    Redis resumes unless the renewals skipped meanwhile are replayed."""
    stack = replica
    await wait_idle(stack)
    live_before = ledger(stack, stack.tag, "live")
    other_before = ledger(stack, stack.tag, "other")
    problems: list[str] = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as client:
        (live,), (live_task,) = await start_streams(
            client, sim_headers("sk-live", LIVE_TOKENS, LIVE_ITL_MS), 1
        )
        assert live.status == 200, live.body
        held = await asyncio.to_thread(redis_backend, stack, stack.tag)
        kv = held[0]
        assert held == (kv, 1) and kv > 0, held
        assert await asyncio.to_thread(kvgate_backend, stack) == (kv, 1)

        await asyncio.sleep(0.5)
        stack.redis.pause()
        paused_at = time.monotonic()
        try:
            # Requests arriving now wait on Redis for the timeout (their scripts stay queued
            # in the sockets): 503 under fail_closed, admitted locally under fail_open.
            during = await post_all(client, sim_headers("sk-other", 2), 3)
            down = await poll(lambda: not store_up(stack), bool, WAIT_S)
            assert down, "kvgate did not notice the outage"
            await asyncio.sleep(max(0.0, paused_at + OUTAGE_S - time.monotonic()))
        finally:
            stack.redis.resume()
        statuses = [r.status_code for r in during]
        if fail_open(stack):
            assert statuses == [200] * 3, [r.text for r in during]
        else:
            assert statuses == [503] * 3, [r.text for r in during]
            assert {r.json()["error"]["code"] for r in during} == {"service_unavailable"}
        assert not live.ended and live.tokens < LIVE_TOKENS - 2, "the outage outlasted it"

        await wait_recovered(stack)
        # From now on, while the stream still has tokens to come (more than one chunk
        # away from its end, so not settling), all that is in flight is the stream: its
        # lease lives on (and is renewed past a whole lease after the outage); the reserves
        # that timed out hold nothing.
        samples: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
        while live.tokens <= LIVE_TOKENS - 2 and not live.ended:
            seen = await asyncio.to_thread(kvgate_backend, stack)
            in_redis = await asyncio.to_thread(redis_backend, stack, stack.tag)
            if live.tokens <= LIVE_TOKENS - 2:
                samples.append((live.tokens, seen, in_redis))
            await asyncio.sleep(0.1)
        wrong = [s for s in samples if s[1:] != ((kv, 1), (kv, 1))]
        if not samples:
            problems.append("no sample while the stream was still streaming")
        if wrong:
            problems.append(
                f"while the stream still streamed, in flight (tokens received, kvgate, "
                f"Redis) was not exactly its KV {kv} / 1 request in {len(wrong)} of "
                f"{len(samples)} samples, e.g. {wrong[0]} ... {wrong[-1]}"
            )
        await asyncio.wait_for(live_task, 60)

    assert live.status == 200 and live.usage is not None, live
    assert live.usage["completion_tokens"] == LIVE_TOKENS == live.tokens, live
    expected = booked([live.usage])
    got = await poll(
        lambda: _delta(ledger(stack, stack.tag, "live"), live_before),
        lambda g: g == expected,
        WAIT_S,
    )
    if got != expected:
        problems.append(f"ledger booked {got} for the stream; the client received {expected}")
    if fail_open(stack):
        # The requests admitted locally during the outage are booked once, on recovery.
        served = booked([r.json()["usage"] for r in during])
        got_other = await poll(
            lambda: _delta(ledger(stack, stack.tag, "other"), other_before),
            lambda g: g == served,
            WAIT_S,
        )
        if got_other != served:
            problems.append(f"ledger booked {got_other} for the local admissions: {served}")
    assert problems == [], "\n".join(problems)
    await wait_idle(stack)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


# ---------------------------------------------------------------- hole 7


async def test_reserves_whose_reply_was_lost_are_released(replica: RedisReplica) -> None:
    """Hole 7. Redis hangs as three requests of a tenant limited to three at once arrive:
    their reserves time out in kvgate and commit when Redis resumes."""
    stack = replica
    await wait_idle(stack)
    assert await asyncio.to_thread(redis_tenant_slots, stack, "burst") == 0
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as client:
        stack.redis.pause()
        local: list[Streamed] = []
        local_tasks: list[asyncio.Task[None]] = []
        try:
            if fail_open(stack):
                # Admitted locally: long streams, still open after the recovery.
                local, local_tasks = await start_streams(
                    client, sim_headers("sk-burst", 20, 300), 3
                )
                assert [r.status for r in local] == [200] * 3, [r.body for r in local]
            else:
                refused = await post_all(client, sim_headers("sk-burst", 1), 3)
                assert [r.status_code for r in refused] == [503] * 3, [r.text for r in refused]
            down = await poll(lambda: not store_up(stack), bool, WAIT_S)
            assert down, "kvgate did not notice the outage"
            await asyncio.sleep(0.5)
        finally:
            stack.redis.resume()  # the three reserve scripts run now, and commit
        await wait_recovered(stack)

        in_redis = await asyncio.to_thread(redis_backend, stack, stack.tag)
        slots = await asyncio.to_thread(redis_tenant_slots, stack, "burst")
        seen = await asyncio.to_thread(kvgate_backend, stack)
        still_open = fail_open(stack) and not any(r.ended for r in local)
        # The tenant's full concurrency, through Redis, at once.
        full = await post_all(client, sim_headers("sk-burst", 6, 150), 3)
        await asyncio.gather(*local_tasks)

    problems: list[str] = []
    if in_redis != (0, 0) or slots != 0:
        problems.append(
            f"after the recovery Redis holds {in_redis} (KV, requests) and {slots} tenant "
            f"slots for reserves whose reply was lost"
        )
    if fail_open(stack):
        assert still_open, "the local streams ended before the check"
        kv_each = seen[0] // 3 if seen[1] == 3 else None
        if seen[1] != 3 or kv_each is None or kv_each <= 0:
            problems.append(
                f"kvgate counts {seen} (KV, requests) in flight for the 3 requests served "
                f"locally: held twice (locally and in Redis)"
            )
    elif seen != (0, 0):
        problems.append(f"kvgate counts {seen} (KV, requests) in flight, nothing is")
    codes = [r.status_code for r in full]
    if codes != [200] * 3:
        problems.append(
            f"the tenant's full concurrency (3) after the recovery: {codes} "
            f"{[r.text for r in full if r.status_code != 200][:1]}"
        )
    assert problems == [], "\n".join(problems)
    await wait_idle(stack)


async def _cancelled_request(port: int, key: str) -> None:
    """Send a request and close the connection while kvgate is deciding (its reserve is
    waiting on the paused Redis, well before the store's timeout)."""
    payload = json.dumps(chat(8)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        + payload
    )
    await writer.drain()
    await asyncio.sleep(REDIS_TIMEOUT_S / 2)
    assert not reader.at_eof()  # no answer yet: still deciding
    writer.close()
    await writer.wait_closed()


async def test_reserves_cancelled_mid_admission_are_released(replica: RedisReplica) -> None:
    """Hole 7. Three requests of a tenant limited to three at once are cancelled by their
    client while their reserves wait on a paused Redis; the scripts commit on resume."""
    stack = replica
    await wait_idle(stack)
    stack.redis.pause()
    try:
        await asyncio.gather(
            *(_cancelled_request(stack.listen_port, "sk-cancel") for _ in range(3))
        )
        # The releases cannot reach Redis either: kvgate marks it down.
        await poll(lambda: not store_up(stack), bool, 3.0)
        await asyncio.sleep(0.5)
    finally:
        stack.redis.resume()
    await wait_recovered(stack)

    in_redis = await asyncio.to_thread(redis_backend, stack, stack.tag)
    slots = await asyncio.to_thread(redis_tenant_slots, stack, "cancel")
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=HTTP_TIMEOUT) as client:
        full = await post_all(client, sim_headers("sk-cancel", 6, 150), 3)
    problems: list[str] = []
    if in_redis != (0, 0) or slots != 0:
        problems.append(
            f"after the recovery Redis holds {in_redis} (KV, requests) and {slots} tenant "
            f"slots for requests cancelled mid-admission"
        )
    codes = [r.status_code for r in full]
    if codes != [200] * 3:
        problems.append(
            f"the tenant's full concurrency (3) after the recovery: {codes} "
            f"{[r.text for r in full if r.status_code != 200][:1]}"
        )
    assert problems == [], "\n".join(problems)
    await wait_idle(stack)
