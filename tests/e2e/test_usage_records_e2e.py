"""Usage records end to end: the official openai SDK -> real Envoy -> kvgate -> simulator,
records in a real SQLite file or a private PostgreSQL server, read back with `kvgate records`
and `kvgate statement`, and compared with the ledger to the last decimal.

- SQLite, one kvgate: chat (JSON and streamed), completions, cache hits charged in full, an
  Idempotency-Key replay, a stream the client cut: one record each, the statement equals the
  ledger's month, no prompt text in any record.
- PostgreSQL, two replicas on one Redis: PostgreSQL stopped for 30 s while requests flow
  (every request answered; afterwards every record there, none twice); PostgreSQL hung and a
  replica SIGKILLed while its batch waits on it (after the restart the records equal the
  ledger).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from testbed.harness import Stack, kvgate_usage, wait_until
from testbed.postgres_harness import PostgresServer
from testbed.usage_records_rig import (
    MODEL,
    TENANTS,
    RecordingStack,
    pg_counts,
    records_models,
    send_traffic,
)

SECRET_WORDS = "zebra-parliament-7731"


def _kvgate(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def statement(config: Path, tenant: str) -> dict[str, Any]:
    month = datetime.now(UTC).strftime("%Y-%m")
    return json.loads(
        _kvgate(
            "statement",
            "--config",
            str(config),
            "--tenant",
            tenant,
            "--month",
            month,
            "--format",
            "json",
        )
    )


def ledger_month(stack: Stack, tenant: str) -> dict[str, Any]:
    """The ledger's month for the tenant, in the statement's fields."""
    for entry in kvgate_usage(stack).get("tenants", []):
        if entry["tenant"] == tenant:
            month = entry["this_month"]
            return {
                "period": month["period"],
                "by_model": month["by_model"],
                **{k: month[k] for k in _TOTALS},
            }
    return {}


_TOTALS = (
    "requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
    "cost_usd",
    "cache_hits",
    "cache_saved_tokens",
)


def statement_equals_ledger(stack: Stack, config: Path, tenant: str) -> tuple[Any, Any]:
    """Both sides (waited for: records land within a flush or two, a cut stream settles
    after its disconnect); the caller asserts them equal."""

    def both() -> tuple[Any, Any]:
        made = statement(config, tenant)
        return {k: made[k] for k in ("period", "by_model", *_TOTALS)}, ledger_month(stack, tenant)

    return wait_until(both, lambda pair: pair[0] == pair[1], timeout=30, interval=0.5)


def records(config: Path, *extra: str, fmt: str = "jsonl") -> str:
    return _kvgate("records", "--config", str(config), "--format", fmt, *extra)


# -- SQLite, one replica ------------------------------------------------------------------


@pytest.fixture(scope="module")
def sqlite_stack() -> Iterator[tuple[Stack, Path]]:
    work = Path(tempfile.mkdtemp(prefix="kvgate-records-"))
    overrides = {
        "response_cache": {"enabled": True, "hit_charge": "full"},
        "usage_records": {
            "sink": "sqlite",
            "sqlite_path": str(work / "records.sqlite3"),
            "spool_dir": str(work / "spool"),
            "flush_interval_s": 0.1,
        },
    }
    try:
        with Stack(
            tenants=TENANTS,
            models=records_models(),
            kvgate_overrides=overrides,
            work_dir=work,
            sim={"itl_ms": 20},  # a 60-token stream takes 1.2 s: the client cuts it
        ) as stack:
            yield stack, stack.kvgate_config_path
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _chat(client: openai.OpenAI, text: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=12,
        **{"temperature": 0, **extra},
    )


def test_every_request_is_one_record_and_the_statement_is_the_ledger(
    sqlite_stack: tuple[Stack, Path],
) -> None:
    stack, config = sqlite_stack
    demo = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-demo", max_retries=0)
    other = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-other", max_retries=0)
    for n in range(4):
        _chat(demo, f"{SECRET_WORDS} question {n}")
    # The same deterministic question again: an exact-cache hit, charged in full.
    _chat(demo, f"{SECRET_WORDS} question 0")
    streamed = _chat(demo, f"{SECRET_WORDS} stream", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    demo.completions.create(model=MODEL, prompt=f"{SECRET_WORDS} once", max_tokens=5)
    key = {"idempotency-key": uuid.uuid4().hex}
    first = _chat(demo, f"{SECRET_WORDS} keyed", temperature=0.7, extra_headers=key)
    replay = _chat(demo, f"{SECRET_WORDS} keyed", temperature=0.7, extra_headers=key)
    assert replay.choices[0].message.content == first.choices[0].message.content
    # A stream the client cuts after its first event.
    with httpx.stream(
        "POST",
        f"{stack.base_url}/v1/chat/completions",
        headers={"authorization": "Bearer sk-demo"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{SECRET_WORDS} cut"}],
            "max_tokens": 60,
            "stream": True,
            "temperature": 0.9,
        },
        timeout=30,
    ) as cut:
        assert cut.status_code == 200
        next(cut.iter_bytes())
    _chat(other, "another tenant's question")

    made, ledger = statement_equals_ledger(stack, config, "demo")
    assert made == ledger
    assert ledger["requests"] == 9  # 4 + the charged hit + stream + completion + keyed + cut
    assert ledger["cache_hits"] == 1
    assert statement_equals_ledger(stack, config, "other")[0]["requests"] == 1

    lines = [json.loads(line) for line in records(config, "--tenant", "demo").splitlines()]
    assert len(lines) == 10  # and the replay
    assert len({line["record_id"] for line in lines}) == 10
    sources = sorted(line["answer_source"] for line in lines)
    assert sources == ["backend"] * 8 + ["exact_cache", "idempotent_replay"]
    causes = {line["settle_cause"] for line in lines}
    assert causes == {"completed", "disconnected"}
    replayed = next(line for line in lines if line["answer_source"] == "idempotent_replay")
    assert not replayed["booked_request"] and replayed["cost_usd"] == "0"
    for line in lines:
        assert line["tenant"] == "demo" and line["served_model"] == MODEL
        assert line["status"] == 200
        assert line["pricing_version"]
        assert line["team_id"] is None and line["user_id"] is None and line["key_id"] is None
    backend = [line for line in lines if line["answer_source"] == "backend"]
    assert all(line["decision_ms"] is not None and line["duration_ms"] for line in backend)
    assert all(line["ttft_ms"] is not None for line in backend)
    assert {(line["api"], line["path"]) for line in backend} == {
        ("chat_completions", "/v1/chat/completions"),
        ("completions", "/v1/completions"),
    }
    hit = next(line for line in lines if line["answer_source"] == "exact_cache")
    assert hit["booked_request"] and hit["cache_hit"] and hit["cost_usd"] != "0"
    cut = next(line for line in lines if line["settle_cause"] == "disconnected")
    assert 0 < cut["output_tokens"] < 60

    exported = records(config, fmt="csv")
    rows = list(csv.DictReader(io.StringIO(exported)))
    assert len(rows) == 11
    assert SECRET_WORDS not in exported and "sk-demo" not in exported
    # Since / until select by time.
    assert records(config, "--since", "2000-01-01", "--until", "2000-01-02") == ""


# -- PostgreSQL, two replicas on one Redis ------------------------------------------------


@pytest.fixture(scope="module")
def pg_stack() -> Iterator[tuple[RecordingStack, PostgresServer, Path]]:
    work = Path(tempfile.mkdtemp(prefix="kvgate-records-pg-"))
    with PostgresServer() as postgres:
        dsn_file = work / "dsn"
        dsn_file.write_text(postgres.create_database())
        overrides = {
            "usage_records": {
                "sink": "postgres",
                "postgres_dsn_file": str(dsn_file),
                "spool_dir": str(work / "spool1"),
                "flush_interval_s": 0.1,
                "write_timeout_s": 60,
                "retry_interval_s": 0.5,
            },
        }
        try:
            with RecordingStack(
                tenants=TENANTS,
                models=records_models(),
                kvgate_overrides=overrides,
                work_dir=work,
                redis_config={"timeout_s": 1.0},
            ) as stack:
                yield stack, postgres, stack.kvgate_config_path
        finally:
            shutil.rmtree(work, ignore_errors=True)


def test_postgres_stopped_for_30_s_loses_and_repeats_nothing(
    pg_stack: tuple[RecordingStack, PostgresServer, Path],
) -> None:
    stack, postgres, config = pg_stack
    dsn = (stack.work_dir / "dsn").read_text()

    async def scenario() -> list[int]:
        traffic = asyncio.create_task(send_traffic(stack.base_url, 40.0))
        await asyncio.sleep(3)
        await asyncio.to_thread(postgres.stop)
        stopped_at = time.monotonic()
        await asyncio.sleep(30)
        spooled = [
            stack.replica_metrics(r).total("kvgate_usage_record_spool_bytes") for r in (1, 2)
        ]
        assert all(size > 0 for size in spooled), spooled
        await asyncio.to_thread(postgres.start)
        assert time.monotonic() - stopped_at >= 30
        return await traffic

    statuses = asyncio.run(scenario())
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    requests = stack.ledger("demo")["requests"]
    assert requests >= len(statuses)
    counts = wait_until(
        lambda: pg_counts(postgres, dsn), lambda c: c[0] == requests, timeout=60, interval=0.5
    )
    assert counts == (requests, requests, requests)
    made, ledger = statement_equals_ledger(stack, config, "demo")
    assert made == ledger
    for replica in (1, 2):
        metrics = stack.replica_metrics(replica)
        assert metrics.total("kvgate_usage_records_total", state="dropped") == 0
        assert metrics.total("kvgate_usage_record_sink_failures_total") > 0


def test_a_replica_killed_while_its_batch_waits_on_postgres_loses_nothing_spooled(
    pg_stack: tuple[RecordingStack, PostgresServer, Path],
) -> None:
    stack, postgres, config = pg_stack
    dsn = (stack.work_dir / "dsn").read_text()
    postgres.pause()
    try:
        statuses = asyncio.run(send_traffic(stack.base_url, 3.0, workers=3))
        assert set(statuses) == {200}

        def replica1() -> tuple[float, float, float]:
            metrics = stack.replica_metrics(1)
            return (
                metrics.total("kvgate_usage_records_total", state="added"),
                metrics.total("kvgate_usage_records_total", state="spooled"),
                metrics.total("kvgate_usage_record_spool_bytes"),
            )

        before_kill = wait_until(
            replica1, lambda m: m[0] == m[1] and m[2] > 0, timeout=10, interval=0.2
        )
        assert before_kill[0] == before_kill[1] and before_kill[2] > 0, before_kill
        # Replica 1's shipping task is inside its insert, waiting on the hung server.
        stack.kill_kvgate()
    finally:
        postgres.resume()
    stack.start_kvgate()
    requests = stack.ledger("demo")["requests"]
    counts = wait_until(
        lambda: pg_counts(postgres, dsn), lambda c: c[0] == requests, timeout=90, interval=0.5
    )
    assert counts == (requests, requests, requests)
    made, ledger = statement_equals_ledger(stack, config, "demo")
    assert made == ledger
