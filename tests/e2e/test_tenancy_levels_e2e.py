"""Teams and users under one tenant, through the real Envoy: a token jwt_authn verified names
the tenant, the team and the user; each team and each user takes from limits of its own in
the same reservation as the tenant's, a refusal names the level that refused, a level's
budget blocks whatever the tenant's budget action is, a team may be held to some models,
and the tenant's usage report answers per level.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testbed.harness import DEFAULT_MODEL_NAME, default_models, wait_until
from tests.e2e.identity_support import ISSUER, PAYLOAD_KEY, JwtStack, Signer

TENANT = "acme"
OTHER_MODEL = "qwen2.5-other"


def _models() -> list[dict[str, Any]]:
    (model,) = default_models()
    priced = {**model, "pricing": {"input_per_million": "2", "output_per_million": "6"}}
    return [priced, {**priced, "name": OTHER_MODEL}]


TENANTS: list[dict[str, Any]] = [
    {
        "name": TENANT,
        # Roomy tenant-wide limits: every refusal below is a level's.
        "limits": {"rpm": 1000, "tpm": 1_000_000},
        # The tenant's own budget would clamp; a level's budget never does.
        "budget": {"daily_usd": "100", "action": "clamp"},
        "teams": {
            "research": {"limits": {"rpm": 2}},
            "ops": {},
            "finance": {"budget": {"daily_usd": "0.000002"}},
            "restricted": {"models": [DEFAULT_MODEL_NAME]},
        },
        "user_limits": {"limits": {"tpm": {"capacity": 400, "refill_per_s": 0.001}}},
    }
]


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Signer:
    return Signer(tmp_path_factory.mktemp("issuer"))


@pytest.fixture(scope="module")
def stack(signer: Signer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JwtStack]:
    records = tmp_path_factory.mktemp("records")
    with JwtStack(
        signer,
        tenants=TENANTS,
        models=_models(),
        kvgate_overrides={
            "keys": {"store": "off"},
            "usage_records": {
                "sink": "sqlite",
                "sqlite_path": str(records / "records.sqlite3"),
                "spool_dir": str(records / "spool"),
                "flush_interval_s": 0.1,
            },
            "identity": {
                "jwt": {
                    "payload_key": PAYLOAD_KEY,
                    "issuers": [ISSUER],
                    "tenant_claim": "tenant",
                    "user_claim": "sub",
                    "team_claim": "team",
                }
            },
        },
    ) as running:
        yield running


def _chat(
    stack: JwtStack,
    signer: Signer,
    *,
    team: str,
    user: str,
    max_tokens: int = 4,
    model: str = DEFAULT_MODEL_NAME,
    request_id: str | None = None,
    **extra: Any,
) -> httpx.Response:
    token = signer.token(tenant=TENANT, team=team, sub=user)
    headers = {"authorization": f"Bearer {token}"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hello there."}],
            "max_tokens": max_tokens,
            **extra,
        },
        headers=headers,
        timeout=30,
    )


def test_a_teams_rate_refuses_naming_the_team_while_the_tenant_has_room(
    stack: JwtStack, signer: Signer
) -> None:
    for n in range(2):
        answer = _chat(stack, signer, team="research", user=f"r{n}")
        assert answer.status_code == 200, answer.text
    refused = _chat(stack, signer, team="research", user="r2")
    assert refused.status_code == 429, refused.text
    assert "for team 'research'" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # Another team of the same tenant is not held back by research's limit.
    assert _chat(stack, signer, team="ops", user="o1").status_code == 200


def test_each_user_has_its_own_tokens_per_minute(stack: JwtStack, signer: Signer) -> None:
    # The engine generates all 300 (no end of sequence): settled, they stay taken.
    first = _chat(stack, signer, team="ops", user="alice", max_tokens=300, ignore_eos=True)
    assert first.status_code == 200, first.text
    again = _chat(stack, signer, team="ops", user="alice", max_tokens=300)
    assert again.status_code == 429, again.text
    assert "for user 'alice'" in again.json()["error"]["message"]
    # Bob's tokens are his own.
    assert _chat(stack, signer, team="ops", user="bob", max_tokens=300).status_code == 200


def test_a_level_budget_blocks_whatever_the_tenants_action(stack: JwtStack, signer: Signer) -> None:
    refused = _chat(stack, signer, team="finance", user="f1", max_tokens=50)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert "team 'finance'" in error["message"]
    assert error["code"] != "rate_limit_exceeded" or "budget" in error["message"]
    # The tenant's own budget (clamp) has room: a team without a budget is served.
    assert _chat(stack, signer, team="ops", user="f2", max_tokens=50).status_code == 200


def test_a_team_may_use_only_its_models(stack: JwtStack, signer: Signer) -> None:
    refused = _chat(stack, signer, team="restricted", user="x1", model=OTHER_MODEL)
    assert refused.status_code == 404, refused.text
    # kvgate's answer (OpenAI's code), not the engine's: nothing was forwarded.
    assert refused.json()["error"]["code"] == "model_not_found"
    # Another team may: kvgate admits it (the simulator serves one model and says 404 itself).
    passed = _chat(stack, signer, team="ops", user="x2", model=OTHER_MODEL)
    assert passed.json()["error"]["code"] == 404, passed.text
    assert _chat(stack, signer, team="restricted", user="x1").status_code == 200


def test_the_usage_report_and_the_access_log_answer_per_level(
    stack: JwtStack, signer: Signer
) -> None:
    answer = _chat(stack, signer, team="ops", user="carol", request_id="levels-report-1")
    assert answer.status_code == 200, answer.text
    entry = stack.wait_access_log(lambda e: e.get("request_id") == "levels-report-1")
    assert (entry["tenant"], entry["team"], entry["user"]) == (TENANT, "ops", "carol")
    token = signer.token(tenant=TENANT, team="ops", sub="carol")
    report = httpx.get(
        f"{stack.base_url}/v1/kvgate/usage",
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    ).json()
    levels = {(level["level"], level["name"]): level for level in report["levels"]}
    # The team is listed (limits of its own or none), the user has user_limits.
    assert set(levels) == {("team", "ops"), ("user", "carol")}
    carol = levels[("user", "carol")]["today"]
    ops = levels[("team", "ops")]["today"]
    # Carol's spend is part of her team's (others of ops spent too).
    assert 0 < float(carol["cost_usd"]) < float(ops["cost_usd"])
    assert "budget_usd" not in ops
    # The request's usage record names the team and the user.
    record = wait_until(
        lambda: _record(stack, "levels-report-1"),
        lambda found: found is not None,
        timeout=30,
        interval=0.3,
    )
    assert record is not None
    assert (record["tenant"], record["team_id"], record["user_id"], record["key_id"]) == (
        TENANT,
        "ops",
        "carol",
        None,
    )


def _record(stack: JwtStack, request_id: str) -> dict[str, Any] | None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "records",
            "--config",
            str(stack.kvgate_config_path),
            "--format",
            "jsonl",
            "--tenant",
            TENANT,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for line in done.stdout.splitlines():
        record: dict[str, Any] = json.loads(line)
        if record["request_id"] == request_id:
            return record
    return None
