"""The usage-records rig shared by its e2e tests and its benchmark: the model and tenants,
two replicas writing one PostgreSQL, traffic, the records PostgreSQL holds, and records made
with every field set as a settlement would."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import openai

from kvgate.usage_records import AnswerSource, UsageRecord
from testbed.demo_model import demo_model_dir
from testbed.postgres_harness import PostgresServer
from testbed.redis_harness import RedisStack

MODEL = "qwen2.5-demo"


def records_models() -> list[dict[str, Any]]:
    return [
        {
            "name": MODEL,
            "tokenizer": str(demo_model_dir()),
            "max_context": 32768,
            "default_max_new_tokens": 64,
            "backend": "vllm-local",
            "pricing": {
                "input_per_million": "2.5",
                "cached_input_per_million": "1.25",
                "output_per_million": "10.000001",
            },
        }
    ]


TENANTS = [{"name": "demo", "api_key": "sk-demo"}, {"name": "other", "api_key": "sk-other"}]


class RecordingStack(RedisStack):
    """Two replicas writing one PostgreSQL, each with its own spool."""

    def kvgate2_config(self) -> dict[str, Any]:
        config = copy.deepcopy(super().kvgate2_config())
        config["usage_records"]["spool_dir"] = str(self.work_dir / "spool2")
        return config


async def send_traffic(base_url: str, seconds: float, workers: int = 4) -> list[int]:
    """Requests back to back from `workers` clients for `seconds`; their statuses."""
    statuses: list[int] = []
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-demo", max_retries=0)
    ends = time.monotonic() + seconds

    async def worker(n: int) -> None:
        i = 0
        while time.monotonic() < ends:
            i += 1
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"worker {n} request {i}"}],
                max_tokens=8,
                stream=i % 3 == 0,
            )
            statuses.append(raw.http_response.status_code)
            if i % 3 == 0:
                async for _ in raw.parse():
                    pass

    await asyncio.gather(*(worker(n) for n in range(workers)))
    await client.close()
    return statuses


def pg_counts(postgres: PostgresServer, dsn: str) -> tuple[int, int, int]:
    import asyncpg

    async def run() -> tuple[int, int, int]:
        db = await asyncpg.connect(dsn)
        try:
            row = await db.fetchrow(
                "SELECT count(*), count(DISTINCT record_id), count(DISTINCT request_id) "
                "FROM usage_records WHERE tenant = 'demo'"
            )
            assert row is not None
            return int(row[0]), int(row[1]), int(row[2])
        finally:
            await db.close()

    return asyncio.run(run())


def make_record(n: int, *, tenant: str = "acme", at: float = 1_796_000_000.0) -> UsageRecord:
    hit = n % 5 == 0
    return UsageRecord(
        record_id=f"rec-{n:06d}",
        request_id=f"req-{n}",
        occurred_at=at + n * 0.5,
        ledger_day="2026-12-01",
        ledger_month="2026-12",
        tenant=tenant,
        api="chat_completions",
        path="/v1/chat/completions",
        requested_model="m-a" if n % 2 else "m-b",
        served_model="m-a" if n % 2 else "m-b",
        backend=None if hit else "vllm-local",
        endpoint=None,
        prompt_tokens=10 + n,
        cached_tokens=n % 3,
        output_tokens=7 * n,
        reasoning_tokens=None,
        cost_pico=123_456_789 * n + 1,
        pricing_version="abcd",
        answer_source=AnswerSource.EXACT_CACHE if hit else AnswerSource.BACKEND,
        status=200,
        settle_cause="completed",
        booked_request=n % 10 != 0,
        cache_hit=hit,
        saved_tokens=17 if hit else 0,
        decision_ms=1.25,
        ttft_ms=None if hit else 30.5,
        duration_ms=90.0,
    )
