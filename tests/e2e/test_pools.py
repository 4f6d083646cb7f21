"""Pools end to end: one model served by three simulator replicas behind one Envoy.

kvgate reserves KV on one endpoint per request and names it in x-kvgate-destination; Envoy's
ORIGINAL_DST cluster connects exactly there. Each replica reports its own engine statistics
(`/sim/stats`), so every claim is checked against what each pod itself saw.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_reset,
    sim_stats,
    wait_until,
)
from testbed.redis_harness import RedisStack
from tests.e2e.support import assert_openai_error, document_messages

POOL = "vllm-pool"
REPLICAS = 3
# Each replica: 500 blocks x 16 = 8,000 tokens of KV, and kvgate's budget per endpoint says so.
BLOCKS = 500
BLOCK = 16
BUDGET = BLOCKS * BLOCK
# 2,000 prompt + 1,000 new = 3,008 reserved (whole blocks): two fit one endpoint, three do not.
PROMPT = 2_000
MAX_NEW = 1_000
PER_ENDPOINT = BUDGET // (((PROMPT + MAX_NEW + BLOCK - 1) // BLOCK) * BLOCK)
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


def _pool_stack(
    tenants: list[dict[str, Any]] | None = None, *, stack_class: type[Stack] = Stack, **backend: Any
) -> Stack:
    return stack_class(
        tenants=tenants,
        models=[
            {
                "name": DEFAULT_MODEL_NAME,
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 1024,
                "backend": POOL,
            }
        ],
        backends=[
            {
                "name": POOL,
                "kv_budget_tokens": BUDGET,
                "kv_block_size": BLOCK,
                "max_concurrent_requests": 64,
                # Scraped twice a second: a dead replica is left within a second.
                "discovery": {
                    "metrics_url": "http://{endpoint}/metrics",
                    "interval_s": 0.5,
                    "timeout_s": 0.5,
                    "max_staleness_s": 5,
                },
                **backend,
            }
        ],
        pool_replicas={POOL: REPLICAS},
        # vLLM's own default: automatic prefix caching; usage reports cached tokens.
        sim=SimOptions(
            num_gpu_blocks=BLOCKS,
            block_size=BLOCK,
            extra_args=["--enable-prefix-caching", "--enable-prompt-tokens-details"],
        ),
    )


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(demo_model_dir())


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with _pool_stack() as running:
        yield running


def _replicas(stack: Stack) -> list[str]:
    return [f"{POOL}#{i}" for i in range(REPLICAS)]


def _chat(
    stack: Stack,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int = MAX_NEW,
    headers: dict[str, str] | None = None,
    tenant: str | None = None,
    stream: bool = False,
) -> httpx.Response:
    all_headers = dict(stack.auth_headers(tenant) if tenant else stack.auth_headers())
    all_headers.update(headers or {})
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_NAME,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": stream,
        },
        headers=all_headers,
        timeout=TIMEOUT,
    )


def _in_flight(stack: Stack) -> dict[str, float]:
    samples = kvgate_metrics(stack)
    return {
        endpoint: samples.value("kvgate_kv_tokens_in_flight", backend=f"{POOL}/{endpoint}")
        for endpoint in stack.pool_endpoints(POOL)
    }


def _served_per_replica(stack: Stack) -> dict[str, int]:
    return {name: len(sim_stats(stack, name)["served"]) for name in _replicas(stack)}


def test_a_burst_admits_exactly_what_fits_each_endpoint(
    stack: Stack, counter: PromptCounter
) -> None:
    for name in _replicas(stack):
        sim_reset(stack, name)
    burst = 3 * PER_ENDPOINT * REPLICAS
    # Slow enough that the whole burst is decided while the first admitted still run.
    slow = {"x-sim-output-tokens": "40", "x-sim-itl-ms": "50"}
    messages = [document_messages(counter, PROMPT, f"burst-{i}") for i in range(burst)]
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda m: _chat(stack, m, headers=slow), messages))
    statuses = collections.Counter(a.status_code for a in answers)
    assert statuses == {200: PER_ENDPOINT * REPLICAS, 429: burst - PER_ENDPOINT * REPLICAS}, (
        statuses
    )
    for answer in answers:
        if answer.status_code == 429:
            assert_openai_error(
                answer, 429, code="kv_budget_exhausted", type_="rate_limit_exceeded"
            )
            assert int(answer.headers["retry-after"]) >= 1
    for name in _replicas(stack):
        stats = sim_stats(stack, name)
        assert stats["preemptions"] == 0, (name, stats)
        assert stats["peak_kv_tokens_used"] <= BUDGET, (name, stats)
        # Every pod got its share: exactly what fits it.
        assert len(stats["served"]) == PER_ENDPOINT, (name, stats["served"])
    in_flight = wait_until(lambda: _in_flight(stack), lambda v: not any(v.values()), timeout=10)
    assert not any(in_flight.values()), in_flight


def test_the_destination_is_the_endpoint_that_holds_the_reservation(
    stack: Stack, counter: PromptCounter
) -> None:
    """The access log's endpoint (kvgate's metadata) is the replica that served it, and a
    client's own x-kvgate-destination (aimed at kvgate's own metrics port) changes nothing."""
    for name in _replicas(stack):
        sim_reset(stack, name)
    forged = {"x-kvgate-destination": f"127.0.0.1:{stack.kvgate_http_port}"}
    answers = [
        _chat(
            stack,
            document_messages(counter, 200, f"dest-{i}"),
            max_tokens=8,
            headers={**forged, "x-request-id": f"destination-{i}"},
        )
        for i in range(6)
    ]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    entries = wait_until(
        lambda: [e for e in stack.access_log() if e["request_id"].startswith("destination-")],
        lambda e: len(e) >= 6,
        timeout=5,
    )
    # Envoy connected to exactly the endpoint kvgate reserved on.
    assert all(e["upstream_host"] == e["endpoint"] for e in entries), entries
    endpoints = collections.Counter(e["endpoint"] for e in entries)
    served = _served_per_replica(stack)
    by_address = dict(zip(stack.pool_endpoints(POOL), _replicas(stack), strict=True))
    assert set(endpoints) <= set(by_address), endpoints
    assert {by_address[a]: n for a, n in endpoints.items()} == {
        name: n for name, n in served.items() if n
    }
    assert sum(served.values()) == 6


def test_a_queued_request_waits_past_envoys_message_timeout_and_is_admitted(
    counter: PromptCounter,
) -> None:
    """With a queue, a request that finds the pool full waits (beyond Envoy's 2 s message
    timeout, extended by kvgate) and is admitted when an endpoint frees up; its client
    gets a 200, never a 504."""
    with _pool_stack(queue={"max_wait_s": 8, "poll_interval_s": 0.05}) as stack:
        hold = {"x-sim-output-tokens": "60", "x-sim-itl-ms": "50"}  # ~3 s each
        fill = [
            document_messages(counter, PROMPT, f"fill-{i}") for i in range(PER_ENDPOINT * REPLICAS)
        ]
        with ThreadPoolExecutor(len(fill) + 1) as pool:
            running = [pool.submit(_chat, stack, m, headers=hold) for m in fill]
            time.sleep(0.8)  # the pool is full now
            started = time.monotonic()
            queued = pool.submit(
                _chat,
                stack,
                document_messages(counter, PROMPT, "queued"),
                max_tokens=MAX_NEW,
                headers={"x-sim-output-tokens": "4"},
            )
            answer = queued.result()
            waited = time.monotonic() - started
            assert all(f.result().status_code == 200 for f in running)
        assert answer.status_code == 200, answer.text
        assert waited > 2.0, waited  # past Envoy's own message timeout
        samples = kvgate_metrics(stack)
        assert samples.total("kvgate_queue_wait_seconds_count", pool=POOL) == 1


def test_a_full_queue_wait_ends_in_429_with_retry_after_and_a_disconnect_leaves_the_queue(
    counter: PromptCounter,
) -> None:
    with _pool_stack(queue={"max_wait_s": 1.5, "poll_interval_s": 0.05}) as stack:
        hold = {"x-sim-output-tokens": "120", "x-sim-itl-ms": "50"}  # ~6 s each
        fill = [
            document_messages(counter, PROMPT, f"hold-{i}") for i in range(PER_ENDPOINT * REPLICAS)
        ]
        with ThreadPoolExecutor(len(fill) + 2) as pool:
            running = [pool.submit(_chat, stack, m, headers=hold) for m in fill]
            time.sleep(0.8)
            expired = _chat(stack, document_messages(counter, PROMPT, "expires"))
            assert_openai_error(
                expired, 429, code="queue_wait_expired", type_="rate_limit_exceeded"
            )
            assert int(expired.headers["retry-after"]) >= 1
            # A client that gives up while queued leaves the queue at once.
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{stack.base_url}/v1/chat/completions",
                    json={
                        "model": DEFAULT_MODEL_NAME,
                        "messages": document_messages(counter, PROMPT, "gives-up"),
                        "max_tokens": MAX_NEW,
                    },
                    headers=stack.auth_headers(),
                    timeout=httpx.Timeout(0.5, connect=5.0),
                )
            drops = wait_until(
                lambda: kvgate_metrics(stack).total(
                    "kvgate_queue_drops_total", reason="disconnected"
                ),
                lambda n: n >= 1,
                timeout=5,
            )
            assert drops == 1
            assert kvgate_metrics(stack).total("kvgate_queue_length", pool=POOL) == 0
            assert all(f.result().status_code == 200 for f in running)
        in_flight = wait_until(lambda: _in_flight(stack), lambda v: not any(v.values()), timeout=10)
        assert not any(in_flight.values()), in_flight


def test_a_killed_endpoint_is_avoided_and_its_leases_freed(counter: PromptCounter) -> None:
    with _pool_stack() as stack:
        victim = f"{POOL}#0"
        victim_address = stack.pool_endpoints(POOL)[0]
        slow = {"x-sim-output-tokens": "200", "x-sim-itl-ms": "20"}
        with ThreadPoolExecutor(6) as pool:
            streams = [
                pool.submit(
                    _chat,
                    stack,
                    document_messages(counter, 300, f"kill-{i}"),
                    max_tokens=400,
                    headers=slow,
                    stream=True,
                )
                for i in range(6)
            ]
            time.sleep(1.0)
            stack.sims[victim].kill()
            outcomes = []
            for future in streams:
                try:
                    outcomes.append(future.result().status_code)
                except httpx.HTTPError:
                    outcomes.append("cut")  # a stream on the killed pod, cut mid-answer
        # The other pods' streams complete; the killed pod's were cut (or never started).
        assert outcomes.count(200) + outcomes.count("cut") == 6, outcomes
        # The dead endpoint's reservations are settled (its streams were cut) and freed.
        freed = wait_until(lambda: _in_flight(stack)[victim_address], lambda v: v == 0, timeout=10)
        assert freed == 0
        # Within a second the failed checks take it out: every new request goes elsewhere.
        time.sleep(1.2)
        answers = [
            _chat(stack, document_messages(counter, 100, f"after-{i}"), max_tokens=4)
            for i in range(9)
        ]
        assert [a.status_code for a in answers] == [200] * 9, [a.text for a in answers]
        samples = kvgate_metrics(stack)
        assert samples.value("kvgate_pool_endpoints", pool=POOL, state="unhealthy") == 1
        assert samples.value("kvgate_pool_endpoints", pool=POOL, state="pickable") == 2


def test_a_priority_class_the_tenant_may_not_use_is_refused(stack: Stack) -> None:
    answer = _chat(
        stack,
        [{"role": "user", "content": "hello"}],
        max_tokens=4,
        headers={"kvgate-priority": "7"},
    )
    error = assert_openai_error(answer, 400, code="invalid_value")
    assert error["param"] == "kvgate-priority"


def _system_chat(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _long_system_prompt(counter: PromptCounter, tag: str, tokens: int) -> str:
    words = document_messages(counter, tokens, tag)[0]["content"]
    return f"You are assistant {tag}. Reference material follows.\n{words}"


def test_requests_sharing_a_system_prompt_go_where_it_is_cached(
    stack: Stack, counter: PromptCounter
) -> None:
    """Three tenants' long system prompts (here: three prompts of one tenant), requests
    interleaved: each prompt's requests all land on one replica, and every one after the
    first is served from that replica's prefix cache (the engine's own cached_tokens)."""
    systems = {tag: _long_system_prompt(counter, tag, 1_500) for tag in ("alpha", "beta", "gamma")}
    cached: dict[str, list[int]] = collections.defaultdict(list)
    for round_ in range(4):
        for tag, system in systems.items():
            answer = _chat(
                stack, _system_chat(system, f"Question {round_} about {tag}?"), max_tokens=8
            )
            assert answer.status_code == 200, answer.text
            details = answer.json()["usage"].get("prompt_tokens_details") or {}
            cached[tag].append(int(details.get("cached_tokens") or 0))
    entries = wait_until(
        lambda: [e for e in stack.access_log() if e["request_id"].startswith("affinity-")],
        lambda e: len(e) >= 12,
        timeout=5,
    )
    by_prompt: dict[str, set[str]] = collections.defaultdict(set)
    for entry in entries:
        by_prompt[entry["request_id"].split("-")[1]].add(entry["endpoint"])
    assert all(len(endpoints) == 1 for endpoints in by_prompt.values()), by_prompt
    for tag, hits in cached.items():
        # The first request of a prompt may find nothing cached; every later one reuses
        # (nearly) the whole system prompt: at least 1,400 of its ~1,500 tokens.
        assert all(hit >= 1_400 for hit in hits[1:]), (tag, hits)
    samples = kvgate_metrics(stack)
    assert samples.total("kvgate_pool_picks_total", pool=POOL, affinity="hit") >= 9


def test_affinity_never_piles_one_prompt_onto_one_pod(stack: Stack, counter: PromptCounter) -> None:
    """A burst that shares one long prefix fills every endpoint (the load gate), instead of
    queueing or refusing behind the endpoint that caches it."""
    for name in _replicas(stack):
        sim_reset(stack, name)
    system = _long_system_prompt(counter, "hot", PROMPT - 60)
    slow = {"x-sim-output-tokens": "40", "x-sim-itl-ms": "50"}
    burst = PER_ENDPOINT * REPLICAS
    with ThreadPoolExecutor(burst) as pool:
        answers = list(
            pool.map(
                lambda i: _chat(stack, _system_chat(system, f"q{i}"), headers=slow),
                range(burst),
            )
        )
    assert [a.status_code for a in answers] == [200] * burst, [a.text for a in answers]
    served = _served_per_replica(stack)
    assert sorted(served.values()) == [PER_ENDPOINT] * REPLICAS, served


def _closed_loop(
    stack: Stack, tenant: str, messages: list[dict[str, Any]], until: float
) -> list[int]:
    """One client sending the same request again and again until `until`; its statuses."""
    statuses = []
    while time.monotonic() < until:
        answer = _chat(
            stack,
            messages,
            tenant=tenant,
            headers={"x-sim-output-tokens": "25", "x-sim-itl-ms": "40"},
        )
        statuses.append(answer.status_code)
    return statuses


def test_a_light_tenant_is_not_starved_behind_a_heavy_one_in_a_full_pool(
    counter: PromptCounter,
) -> None:
    """Heavy runs 10x the clients of light on a full pool with a queue. With FIFO light
    would wait as long as heavy; with the virtual token counter a light request goes ahead
    of the heavy backlog, so its mean wait is a fraction of heavy's. Nobody waits past the
    bound (no 429 at all here: max_wait_s is far above the backlog's drain time), and
    the top-priority tenant is served before both."""
    tenants = [
        {"name": "heavy", "api_key": "sk-heavy"},
        {"name": "light", "api_key": "sk-light"},
        {"name": "urgent", "api_key": "sk-urgent", "priority": 10},
    ]
    with _pool_stack(tenants, queue={"max_wait_s": 20, "poll_interval_s": 0.05}) as stack:
        messages = document_messages(counter, PROMPT, "fair")
        until = time.monotonic() + 12
        with ThreadPoolExecutor(23) as pool:
            heavy = [pool.submit(_closed_loop, stack, "heavy", messages, until) for _ in range(20)]
            light = [pool.submit(_closed_loop, stack, "light", messages, until) for _ in range(2)]
            time.sleep(4)  # the backlog is long now
            urgent = pool.submit(_chat, stack, messages, tenant="urgent")
            statuses = [s for f in heavy + light for s in f.result()]
            assert urgent.result().status_code == 200
        assert set(statuses) == {200}, collections.Counter(statuses)
        samples = kvgate_metrics(stack)

        def mean_wait(tenant: str, priority: str = "0") -> float:
            labels = {"pool": POOL, "tenant": tenant, "priority": priority}
            count = samples.value("kvgate_queue_wait_seconds_count", **labels)
            return samples.value("kvgate_queue_wait_seconds_sum", **labels) / max(count, 1)

        heavy_wait, light_wait = mean_wait("heavy"), mean_wait("light")
        assert heavy_wait > 1.0, heavy_wait  # the pool really was full
        assert light_wait < 0.5 * heavy_wait, (light_wait, heavy_wait)
        assert mean_wait("urgent", "10") < heavy_wait, (mean_wait("urgent", "10"), heavy_wait)
        assert samples.total("kvgate_queue_drops_total") == 0


def test_two_kvgate_replicas_sharing_redis_hold_each_endpoints_budget_and_share_the_queue(
    counter: PromptCounter,
) -> None:
    """Two kvgate processes behind one Envoy, one Redis: the per-endpoint ledgers are
    shared, so a burst three times what the pool holds never puts more on a pod than its
    budget, and with a queue on both replicas every request is admitted in turn (a
    replica learns of room freed by the other through its queue's polling)."""
    with _pool_stack(
        stack_class=RedisStack, queue={"max_wait_s": 20, "poll_interval_s": 0.05}
    ) as stack:
        burst = 3 * PER_ENDPOINT * REPLICAS
        slow = {"x-sim-output-tokens": "20", "x-sim-itl-ms": "50"}
        messages = [document_messages(counter, PROMPT, f"redis-{i}") for i in range(burst)]
        with ThreadPoolExecutor(burst) as pool:
            answers = list(pool.map(lambda m: _chat(stack, m, headers=slow), messages))
        assert [a.status_code for a in answers] == [200] * burst, [
            a.text for a in answers if a.status_code != 200
        ]
        for name in _replicas(stack):
            stats = sim_stats(stack, name)
            assert stats["preemptions"] == 0, (name, stats)
            assert stats["peak_kv_tokens_used"] <= BUDGET, (name, stats)
            # Never more in flight on a pod than its budget holds.
            assert stats["peak_running"] <= PER_ENDPOINT, (name, stats)
        queued = sum(
            kvgate_metrics(stack).total("kvgate_queue_wait_seconds_count", pool=POOL)
            for stack in (stack,)
        )
        assert queued >= 1
