"""API keys as data on two kvgate replicas sharing one Redis, behind one real Envoy.

A key made through one replica's admin API (and `kvgate keys`) is usable on both without a
reload; revoked, it is refused on both (401 naming why, never which other keys exist); an
expired key is refused the same way; a key's own budget refuses that key while its
tenant's other keys still pass; a rotated key hands over with its grace; the records and the
access log name the key, its team and its user.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from testbed.harness import DEFAULT_MODEL_NAME, default_models, wait_until
from testbed.redis_harness import RedisStack

TENANT = "acme"
BURST_TENANT = "burst"
BURST_RPM = 7
# Envoy spreads requests over both replicas: this many in a row reach each at least once.
SPREAD = 8
PROPAGATION_DEADLINE_S = 10.0  # generous: the bound under test is keys.refresh_s


def _models() -> list[dict[str, Any]]:
    (model,) = default_models()
    return [{**model, "pricing": {"input_per_million": "2", "output_per_million": "6"}}]


@pytest.fixture(scope="module")
def stack() -> Iterator[RedisStack]:
    with RedisStack(
        # A tenant with no key in the file: only the key directory names it.
        tenants=[
            {"name": TENANT, "teams": {"research": {}}},
            {"name": BURST_TENANT, "limits": {"rpm": BURST_RPM}},
        ],
        models=_models(),
        kvgate_overrides={"keys": {"refresh_s": 0.25}},
    ) as running:
        yield running


@pytest.fixture(scope="module")
def admin(stack: RedisStack) -> Iterator[admin_pb2_grpc.AdminStub]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.kvgate_admin_port}") as channel:
        yield admin_pb2_grpc.AdminStub(channel)


def _chat(stack: RedisStack, key: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_NAME,
            "messages": [{"role": "user", "content": "Hello."}],
            "max_tokens": 4,
            **extra.pop("body", {}),
        },
        headers={"authorization": f"Bearer {key}", **extra.pop("headers", {})},
        timeout=30,
    )


def _outcomes(stack: RedisStack, reason: str) -> tuple[float, ...]:
    """How many requests each replica decided for ``reason`` ("admitted", or why not)."""
    return tuple(
        stack.replica_metrics(replica).total("kvgate_requests_total", reason=reason)
        for replica in (1, 2)
    )


def _statuses(stack: RedisStack, key: str) -> list[int]:
    return [_chat(stack, key).status_code for _ in range(SPREAD)]


def _until_every_answer_is(stack: RedisStack, key: str, status: int) -> float:
    """Seconds until SPREAD answers in a row (both replicas) have ``status``."""
    started = time.monotonic()
    wait_until(
        lambda: _statuses(stack, key),
        lambda statuses: set(statuses) == {status},
        timeout=PROPAGATION_DEADLINE_S,
    )
    return time.monotonic() - started


def test_a_key_made_on_one_replica_works_on_both_and_a_revocation_reaches_both(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    made = admin.CreateKey(
        admin_pb2.CreateKeyRequest(tenant=TENANT, team="research", user="ann"), timeout=5
    )
    assert made.secret.startswith("kvg-") and made.key.key_id.startswith("key_")
    admitted_before = _outcomes(stack, "admitted")
    took = _until_every_answer_is(stack, made.secret, 200)
    admitted_after = _outcomes(stack, "admitted")
    assert all(a > b for a, b in zip(admitted_after, admitted_before, strict=True))
    print(f"a new key served by both replicas after {took:.2f} s")

    revoked = admin.RevokeKey(admin_pb2.RevokeKeyRequest(key_id=made.key.key_id), timeout=5)
    assert revoked.state == "revoked"
    refused_before = _outcomes(stack, "revoked_api_key")
    took = _until_every_answer_is(stack, made.secret, 401)
    print(f"a revocation in force on both replicas after {took:.2f} s")
    refused_after = _outcomes(stack, "revoked_api_key")
    # Both replicas refused it themselves, saying why.
    assert all(a > b for a, b in zip(refused_after, refused_before, strict=True))
    error = _chat(stack, made.secret).json()["error"]
    assert error["code"] == "invalid_api_key"
    assert error["message"] == "This API key has been revoked."
    # A key nobody made is refused without a word about why.
    unknown = _chat(stack, "kvg-" + "x" * 43).json()["error"]
    assert unknown["message"] == "Incorrect API key provided."


def test_an_expired_key_is_refused_naming_why(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    made = admin.CreateKey(admin_pb2.CreateKeyRequest(tenant=TENANT, ttl_s=2.0), timeout=5)
    assert _chat(stack, made.secret).status_code == 200
    refused = wait_until(
        lambda: _chat(stack, made.secret),
        lambda answer: answer.status_code == 401,
        timeout=PROPAGATION_DEADLINE_S,
    )
    assert refused.json()["error"]["message"] == "This API key has expired."


def test_a_keys_budget_refuses_that_key_while_the_tenants_other_keys_pass(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    tight = admin.CreateKey(
        admin_pb2.CreateKeyRequest(
            tenant=TENANT, limits_json='{"budget": {"daily_usd": "0.0002"}}'
        ),
        timeout=5,
    )
    other = admin.CreateKey(admin_pb2.CreateKeyRequest(tenant=TENANT), timeout=5)
    # Each request may cost up to (prompt + 4) tokens' worth; the budget holds a few.
    statuses = [_chat(stack, tight.secret, body={"max_tokens": 20}) for _ in range(12)]
    refused = [answer for answer in statuses if answer.status_code == 429]
    assert refused, [answer.status_code for answer in statuses]
    assert statuses[0].status_code == 200
    message = refused[0].json()["error"]["message"]
    assert f"key '{tight.key.key_id}'" in message and "budget" in message
    assert _chat(stack, other.secret).status_code == 200


def test_a_rotated_key_hands_over_within_its_grace(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    old = admin.CreateKey(admin_pb2.CreateKeyRequest(tenant=TENANT, user="rot"), timeout=5)
    new = admin.RotateKey(
        admin_pb2.RotateKeyRequest(key_id=old.key.key_id, grace_s=30.0), timeout=5
    )
    assert new.secret != old.secret and new.key.user == "rot"
    _until_every_answer_is(stack, new.secret, 200)
    assert set(_statuses(stack, old.secret)) == {200}  # still in its grace
    admin.RevokeKey(admin_pb2.RevokeKeyRequest(key_id=old.key.key_id), timeout=5)
    _until_every_answer_is(stack, old.secret, 401)
    assert set(_statuses(stack, new.secret)) == {200}


def test_the_cli_makes_a_key_and_the_access_log_names_it(stack: RedisStack) -> None:
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "keys",
            "create",
            "--admin",
            f"127.0.0.1:{stack.kvgate_admin_port}",
            "--tenant",
            TENANT,
            "--team",
            "research",
            "--user",
            "cli-user",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    secret = made.stdout.strip()
    assert secret.startswith("kvg-") and "\n" not in secret
    answer = wait_until(
        lambda: _chat(stack, secret, headers={"x-request-id": "keys-cli-1"}),
        lambda reply: reply.status_code == 200,
        timeout=PROPAGATION_DEADLINE_S,
    )
    assert answer.status_code == 200
    entry = stack.wait_access_log(lambda e: e.get("request_id") == "keys-cli-1")
    assert (entry["tenant"], entry["team"], entry["user"]) == (TENANT, "research", "cli-user")
    assert entry["key_id"].startswith("key_")
    # The secret never reaches the log.
    assert secret not in "\n".join(str(e) for e in stack.access_log())


async def _burst(stack: RedisStack, keys: list[str], per_key: int) -> list[int]:
    limits = httpx.Limits(max_connections=len(keys) * per_key)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": DEFAULT_MODEL_NAME,
                        "messages": [{"role": "user", "content": "Hi."}],
                        "max_tokens": 2,
                    },
                    headers={"authorization": f"Bearer {key}"},
                )
                for key in keys
                for _ in range(per_key)
            )
        )
    return [answer.status_code for answer in answers]


def test_a_burst_across_many_keys_never_overshoots_their_tenants_limit(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    """Fourteen keys of one tenant, each with room of its own, two requests each at once
    over both replicas: the tenant's RPM admits exactly its limit (one atomic reservation
    takes from the key's and the tenant's buckets together)."""
    keys = [
        admin.CreateKey(
            admin_pb2.CreateKeyRequest(tenant=BURST_TENANT, limits_json='{"limits": {"rpm": 100}}'),
            timeout=5,
        ).secret
        for _ in range(14)
    ]
    for key in keys:  # every key known to both replicas, without spending the tenant's RPM
        wait_until(
            lambda key=key: _chat(stack, key, body={"model": "no-such-model"}).status_code,
            lambda status: status == 404,
            timeout=PROPAGATION_DEADLINE_S,
        )
    statuses = asyncio.run(_burst(stack, keys, per_key=2))
    assert statuses.count(200) == BURST_RPM, statuses
    assert statuses.count(429) == len(statuses) - BURST_RPM


def test_the_operator_reads_the_spend_of_a_team_and_a_key(
    stack: RedisStack, admin: admin_pb2_grpc.AdminStub
) -> None:
    made = admin.CreateKey(
        admin_pb2.CreateKeyRequest(
            tenant=TENANT,
            team="research",
            limits_json='{"budget": {"monthly_usd": "5"}}',
        ),
        timeout=5,
    )
    answer = wait_until(
        lambda: _chat(stack, made.secret),
        lambda reply: reply.status_code == 200,
        timeout=PROPAGATION_DEADLINE_S,
    )
    usage = answer.json()["usage"]
    cost = (usage["prompt_tokens"] * 2 + usage["completion_tokens"] * 6) / 1_000_000
    report = wait_until(
        lambda: admin.GetTenantUsage(
            admin_pb2.GetTenantUsageRequest(
                tenant=TENANT, teams=["research"], key_ids=[made.key.key_id]
            ),
            timeout=5,
        ),
        lambda got: all(float(level.this_month.cost_usd) > 0 for level in got.levels),
        timeout=PROPAGATION_DEADLINE_S,
    )
    levels = {(level.level, level.name): level for level in report.levels}
    key = levels[("key", made.key.key_id)]
    # The key's spend is exactly its one request's; its budget is its own.
    assert float(key.this_month.cost_usd) == pytest.approx(cost)
    assert key.this_month.budget_usd == "5"
    assert float(key.this_month.remaining_usd) == pytest.approx(5 - cost)
    # The team's spend holds this key's and every other research key's.
    assert float(levels[("team", "research")].this_month.cost_usd) >= cost
    assert levels[("team", "research")].this_month.budget_usd == ""
    # A key of another tenant is not this tenant's to read.
    other = admin.CreateKey(admin_pb2.CreateKeyRequest(tenant=BURST_TENANT), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        admin.GetTenantUsage(
            admin_pb2.GetTenantUsageRequest(tenant=TENANT, key_ids=[other.key.key_id]),
            timeout=5,
        )
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "usage",
            "--admin",
            f"127.0.0.1:{stack.kvgate_admin_port}",
            "--tenant",
            TENANT,
            "--key",
            made.key.key_id,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"key {made.key.key_id}" in shown and "of $5" in shown
