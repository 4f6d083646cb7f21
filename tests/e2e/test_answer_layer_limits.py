"""The answer layer behind the tenant's limits, end to end: client -> real Envoy -> kvgate ->
simulator.

What kvgate does for a tenant without the backend (a cache hit, an idempotent replay, a
duplicate's wait) counts against that tenant and is bounded per tenant; what is stored is
the answer to the request as asked; one tenant's floods never cost another tenant its
stored answers. Whether the backend worked is read from the simulator's own record.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    Stack,
    demo_model_dir,
    kvgate_metrics,
)
from testbed.redis_harness import RedisStack

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
LIMITED = "sk-answers-limited"
LIMITED_KEYS = "sk-answers-limited-keys"
LIMITED_BIG = "sk-answers-limited-big"
ABUSER = "sk-answers-abuser"
VICTIM = "sk-answers-victim"
WAITER = "sk-answers-waiter"
CLAMPED = "sk-answers-clamped"
SHARER_A = "sk-answers-sharer-a"
SHARER_B = "sk-answers-sharer-b"
LONER = "sk-answers-loner"
SAMPLER = "sk-answers-sampler"
SAMPLER_PEER = "sk-answers-sampler-peer"
LEASE_TTL_S = 1.5
# Each tenant's idempotency keys and their answers may hold this much at once.
TENANT_KEY_BYTES = 64 * 1024
KEY_ANSWER_MAX_BYTES = 12 * 1024


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    tenants: list[dict[str, Any]] = [
        {"name": "limited", "api_key": LIMITED, "limits": {"rpm": {"limit": 3}}},
        {"name": "limited-keys", "api_key": LIMITED_KEYS, "limits": {"rpm": {"limit": 3}}},
        {"name": "limited-big", "api_key": LIMITED_BIG, "limits": {"rpm": {"limit": 1}}},
        {"name": "abuser", "api_key": ABUSER},
        {"name": "victim", "api_key": VICTIM},
        {"name": "waiter", "api_key": WAITER},
        {
            "name": "clamped",
            "api_key": CLAMPED,
            "budget": {"daily_usd": "0.01", "action": "clamp"},
        },
        {"name": "sharer-a", "api_key": SHARER_A, "cache_sharing": True},
        {"name": "sharer-b", "api_key": SHARER_B, "cache_sharing": True},
        {"name": "loner", "api_key": LONER},
        {
            "name": "sampler",
            "api_key": SAMPLER,
            "cache_sharing": True,
            "response_cache_sampled": True,
        },
        {
            "name": "sampler-peer",
            "api_key": SAMPLER_PEER,
            "cache_sharing": True,
            "response_cache_sampled": True,
        },
    ]
    models = [
        {
            "name": DEFAULT_MODEL_NAME,
            "tokenizer": str(demo_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 1024,
            "backend": DEFAULT_BACKEND,
            "pricing": {"input_per_million": "3", "output_per_million": "15"},
        }
    ]
    overrides = {
        "server": {"lease_ttl_s": LEASE_TTL_S},
        "response_cache": {"enabled": True, "scope": "model"},
        "idempotency": {
            "tenant_max_bytes": TENANT_KEY_BYTES,
            "max_answer_bytes": KEY_ANSWER_MAX_BYTES,
            "max_waiting_per_tenant": 2,
            "max_wait_s": 8,
        },
    }
    with Stack(tenants=tenants, models=models, kvgate_overrides=overrides) as running:
        yield running


def _body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }


def _post(stack: Stack, body: dict[str, Any], key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=TIMEOUT,
    )


def _arrived(stack: Stack) -> int:
    """Generation requests that reached the simulator."""
    records = httpx.get(f"{stack.sim_url}/sim/requests?limit=5000", timeout=5).json()
    return sum(1 for r in records["requests"] if r["path"] == "/v1/chat/completions")


def _until_hit(stack: Stack, body: dict[str, Any], key: str) -> httpx.Response:
    """The answer is stored at settlement, just after the client has it: ask until it is."""
    deadline = time.monotonic() + 5
    while True:
        answer = _post(stack, body, key)
        if answer.headers.get("x-kvgate-cache") == "hit" or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


# ---------------------------------------------------------------- free work takes RPM


def test_cache_hits_take_the_tenants_rpm_slots(stack: Stack) -> None:
    body = _body(f"What is 2+2? {uuid.uuid4()}")
    first = _post(stack, body, LIMITED)
    assert first.status_code == 200 and first.headers["x-kvgate-cache"] == "miss"
    time.sleep(0.3)  # stored at settlement
    answers = [_post(stack, body, LIMITED) for _ in range(3)]
    # RPM 3: the miss and two hits are the tenant's three requests; the third hit is one too
    # many, answered 429 like any request over the limit.
    assert [a.status_code for a in answers[:2]] == [200, 200]
    assert all(a.headers["x-kvgate-cache"] == "hit" for a in answers[:2])
    assert answers[2].status_code == 429, answers[2].text
    assert answers[2].json()["error"]["code"] == "rpm_exceeded"
    assert int(answers[2].headers["retry-after"]) >= 1


def test_idempotent_replays_take_the_tenants_rpm_slots(stack: Stack) -> None:
    key = f"replay-{uuid.uuid4()}"
    body = _body(f"A story {uuid.uuid4()}", temperature=0.8)
    statuses = [
        _post(stack, body, LIMITED_KEYS, **{"idempotency-key": key}).status_code for _ in range(4)
    ]
    assert statuses == [200, 200, 200, 429]


def test_a_tenant_over_rpm_is_refused_before_any_answer_source_looks(stack: Stack) -> None:
    """An over-limit request costs no digest, no cache lookup and no idempotency claim."""
    assert _post(stack, _body("Hello"), LIMITED_BIG).status_code == 200  # RPM 1: used
    before = kvgate_metrics(stack)
    body = _body("x" * 2_000_000)
    answers = [
        _post(stack, body, LIMITED_BIG, **{"idempotency-key": f"big-{i}-{uuid.uuid4()}"})
        for i in range(3)
    ]
    assert all(a.status_code == 429 for a in answers), [a.status_code for a in answers]
    after = kvgate_metrics(stack)
    for name in ("kvgate_idempotent_requests_total", "kvgate_response_cache_total"):
        assert after.total(name) == before.total(name), name


# ---------------------------------------------------------------- per-tenant store quotas


def test_a_flood_of_keys_is_bounded_by_the_tenants_quota_and_costs_others_nothing(
    stack: Stack,
) -> None:
    long = {"x-sim-output-tokens": "600"}
    body = _body(f"Write a long poem {uuid.uuid4()}", max_tokens=600)
    victim_key = f"victim-{uuid.uuid4()}"
    victim_first = _post(stack, body, VICTIM, **long, **{"idempotency-key": victim_key})
    assert victim_first.status_code == 200
    # The abuser resends one cached request under ever new Idempotency-Keys: each would
    # keep another copy of the answer.
    statuses = [
        _post(stack, body, ABUSER, **long, **{"idempotency-key": f"flood-{i}"}).status_code
        for i in range(40)
    ]
    assert statuses.count(200) < 40 and set(statuses) == {200, 429}, statuses
    refused = _post(stack, body, ABUSER, **long, **{"idempotency-key": "flood-more"})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "idempotency_keys_exhausted"
    # The victim's key was neither evicted nor charged again: its retry is a replay.
    arrived = _arrived(stack)
    retry = _post(stack, body, VICTIM, **long, **{"idempotency-key": victim_key})
    assert retry.status_code == 200 and retry.headers.get("idempotent-replayed") == "true"
    assert retry.content == victim_first.content
    assert _arrived(stack) == arrived


def test_waiting_duplicates_are_bounded_per_tenant(stack: Stack) -> None:
    key = f"wait-{uuid.uuid4()}"
    slow = {"x-sim-output-tokens": "40", "x-sim-itl-ms": "50", "idempotency-key": key}
    body = _body(f"Slowly {uuid.uuid4()}", max_tokens=40)
    first: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: first.append(_post(stack, body, WAITER, **slow)))
    runner.start()
    time.sleep(0.5)  # the first request runs
    with ThreadPoolExecutor(5) as pool:
        duplicates = list(pool.map(lambda _: _post(stack, body, WAITER, **slow), range(5)))
    runner.join()
    statuses = sorted(d.status_code for d in duplicates)
    # Two waiting places: two duplicates replay the answer, three are told to come back.
    assert statuses == [200, 200, 429, 429, 429], statuses
    refused = [d for d in duplicates if d.status_code == 429]
    assert {d.json()["error"]["code"] for d in refused} == {"idempotency_waiters_exceeded"}
    assert all(int(d.headers["retry-after"]) >= 1 for d in refused)


# ---------------------------------------------------------------- keyed on what was served


def test_a_clamped_answer_is_not_cached_and_its_replay_says_it_was_clamped(
    stack: Stack,
) -> None:
    body = _body(f"Tell me everything {uuid.uuid4()}", max_tokens=5000)
    sim = {"x-sim-output-tokens": "5000"}
    key = f"clamp-{uuid.uuid4()}"
    first = _post(stack, body, CLAMPED, **sim, **{"idempotency-key": key})
    assert first.status_code == 200, first.text
    clamp = first.headers["x-kvgate-max-tokens-clamped"]
    time.sleep(0.3)
    # Not the request's answer (fewer tokens than asked): never a cache hit.
    again = _post(stack, body, CLAMPED, **sim)
    assert again.headers.get("x-kvgate-cache") != "hit"
    # The key's replay is the answer the key produced, with the header that says how.
    replay = _post(stack, body, CLAMPED, **sim, **{"idempotency-key": key})
    assert replay.status_code == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert replay.headers["x-kvgate-max-tokens-clamped"] == clamp


# ---------------------------------------------------------------- sharing


def test_entries_are_shared_only_between_tenants_that_both_opt_in(stack: Stack) -> None:
    body = _body(f"What is the boiling point of water? {uuid.uuid4()}")
    first = _post(stack, body, SHARER_A)
    assert first.headers["x-kvgate-cache"] == "miss"
    shared = _until_hit(stack, body, SHARER_B)
    assert shared.headers["x-kvgate-cache"] == "hit" and shared.content == first.content
    # A tenant that did not opt in neither gets nor gives shared answers.
    assert _post(stack, body, LONER).headers["x-kvgate-cache"] == "miss"


def test_a_sampled_answer_is_never_served_to_another_tenant(stack: Stack) -> None:
    body = _body(f"Invent a name {uuid.uuid4()}", temperature=1.0)
    first = _post(stack, body, SAMPLER)
    assert first.headers["x-kvgate-cache"] == "miss"
    own = _until_hit(stack, body, SAMPLER)
    assert own.headers["x-kvgate-cache"] == "hit"  # its own sample, as it allowed
    arrived = _arrived(stack)
    peer = _post(stack, body, SAMPLER_PEER)
    assert peer.headers["x-kvgate-cache"] == "miss"
    assert _arrived(stack) == arrived + 1


# ---------------------------------------------------------------- keys that keep protecting


def test_a_long_generation_keeps_its_key_past_the_lock_ttl(stack: Stack) -> None:
    key = f"long-{uuid.uuid4()}"
    # About 4 s of generation: more than twice the lock's TTL (the lease TTL, 1.5 s).
    slow = {"x-sim-output-tokens": "80", "x-sim-itl-ms": "50", "idempotency-key": key}
    body = _body(f"A long answer {uuid.uuid4()}", max_tokens=80)
    arrived = _arrived(stack)
    first: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: first.append(_post(stack, body, VICTIM, **slow)))
    runner.start()
    time.sleep(LEASE_TTL_S * 2)
    duplicate = _post(stack, body, VICTIM, **slow)
    runner.join()
    assert duplicate.status_code == 200 and duplicate.headers.get("idempotent-replayed") == "true"
    assert duplicate.content == first[0].content
    assert _arrived(stack) == arrived + 1


def test_an_answer_too_large_to_keep_is_never_generated_twice(stack: Stack) -> None:
    key = f"large-{uuid.uuid4()}"
    big = {"x-sim-output-tokens": "3000", "idempotency-key": key}
    body = _body(f"Everything you know {uuid.uuid4()}", max_tokens=3000, temperature=0.5)
    first = _post(stack, body, VICTIM, **big)
    assert first.status_code == 200 and len(first.content) > KEY_ANSWER_MAX_BYTES
    time.sleep(0.3)
    arrived = _arrived(stack)
    duplicate = _post(stack, body, VICTIM, **big)
    assert duplicate.status_code == 409, duplicate.text
    error = duplicate.json()["error"]
    assert error["code"] == "idempotency_answer_not_kept" and error["param"] == "Idempotency-Key"
    assert _arrived(stack) == arrived


# ---------------------------------------------------------------- the store down


def test_with_redis_down_fail_open_runs_keyed_requests_unchecked_and_says_so() -> None:
    """The documented price of fail_open: while Redis is down a retry with the same key runs
    (and is charged) again, on any replica; each is counted as unchecked."""
    with RedisStack(
        redis_config={"failure_policy": "fail_open", "probe_interval_s": 0.2},
        persistent_redis=False,
    ) as stack:
        key = f"outage-{uuid.uuid4()}"
        body = _body(f"During an outage {uuid.uuid4()}")
        stack.redis.kill()
        arrived = _arrived(stack)
        answers = [
            _post(stack, body, stack.api_key(), **{"idempotency-key": key}) for _ in range(2)
        ]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert all(a.headers.get("idempotent-replayed") is None for a in answers)
        assert _arrived(stack) == arrived + 2
        unchecked = sum(
            stack.replica_metrics(replica).total(
                "kvgate_idempotent_requests_total", result="unchecked"
            )
            for replica in (1, 2)
        )
        assert unchecked == 2
