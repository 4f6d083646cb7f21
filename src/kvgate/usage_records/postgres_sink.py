"""The shared sink: PostgreSQL (asyncpg), which every replica writes.

Connected lazily, on the first batch, and dropped on any failure (the next batch connects
anew): a database that is down at start or goes away later only delays the records, which
wait in the spool. Replicas migrate under an advisory lock, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg

from kvgate.usage_records.record import AnswerSource, UsageRecord
from kvgate.usage_records.schema import (
    COLUMNS,
    LATEST,
    SCHEMA_VERSION_POSTGRES,
    STATEMENT_SQL,
    pending,
)
from kvgate.usage_records.sink import RecordQuery, RecordSink, StatementLine

# Any constant: the lock that serialises migrations across replicas.
_MIGRATION_LOCK = 0x6B76_6761_7465
_TYPES = {
    "occurred_at": "timestamptz",
    "booked_request": "boolean",
    "cache_hit": "boolean",
    "status": "integer",
    **{
        name: "bigint"
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "output_tokens",
            "reasoning_tokens",
            "cost_pico",
            "saved_tokens",
        )
    },
    **{name: "double precision" for name in ("decision_ms", "ttft_ms", "duration_ms")},
}
# One statement per batch: a column array per field (the server reports how many rows were
# new in its status, "INSERT 0 <n>").
_INSERT = (
    f"INSERT INTO usage_records ({', '.join(COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${i + 1}::{_TYPES.get(name, 'text')}[]" for i, name in enumerate(COLUMNS))
    + ") ON CONFLICT (record_id) DO NOTHING"
)
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM usage_records"


def _row(record: UsageRecord) -> tuple[Any, ...]:
    row = [getattr(record, name) for name in COLUMNS]
    row[COLUMNS.index("occurred_at")] = record.occurred_at_utc
    row[COLUMNS.index("answer_source")] = record.answer_source.value
    return tuple(row)


def _record(row: asyncpg.Record) -> UsageRecord:
    values = dict(row.items())
    values["occurred_at"] = values["occurred_at"].timestamp()
    values["answer_source"] = AnswerSource(values["answer_source"])
    return UsageRecord(**values)


class PostgresSink(RecordSink):
    name = "postgres"

    def __init__(self, dsn: str, *, timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self._timeout_s = timeout_s
        self._db: asyncpg.Connection | None = None
        # One batch at a time on the one connection (the writer sends one; a reader waits).
        self._lock = asyncio.Lock()

    async def _connect(self, up_to: int = LATEST) -> asyncpg.Connection:
        if self._db is None or self._db.is_closed():
            self._db = await asyncpg.connect(
                self.dsn, timeout=self._timeout_s, command_timeout=self._timeout_s
            )
            await self._migrate(self._db, up_to)
        return self._db

    async def _migrate(self, db: asyncpg.Connection, up_to: int) -> None:
        async with db.transaction():
            await db.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await db.execute(SCHEMA_VERSION_POSTGRES)
            current = await db.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            for migration in pending(int(current), up_to):
                for statement in migration.postgres:
                    await db.execute(statement)
                await db.execute(
                    "INSERT INTO schema_version (version, what) VALUES ($1, $2)",
                    migration.version,
                    migration.what,
                )

    async def _drop(self) -> None:
        """After a failure: the next call connects anew (a half-dead connection would hang)."""
        db, self._db = self._db, None
        if db is not None:
            db.terminate()

    async def migrate(self, up_to: int = LATEST) -> None:
        async with self._lock:
            db = await self._connect(up_to)
            await self._migrate(db, up_to)

    async def schema_version(self) -> int:
        async with self._lock:
            db = await self._connect(0)
            value = await db.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            return int(value)

    async def insert(self, records: Sequence[UsageRecord]) -> int:
        if not records:
            return 0
        rows = [_row(record) for record in records]
        async with self._lock:
            try:
                db = await self._connect()
                columns = [list(column) for column in zip(*rows, strict=True)]
                status = await db.execute(_INSERT, *columns)
                return int(status.rsplit(" ", 1)[-1])
            except BaseException:
                await self._drop()
                raise

    async def records(self, query: RecordQuery) -> list[UsageRecord]:
        clauses: list[str] = []
        params: list[Any] = []

        def param(value: Any) -> str:
            params.append(value)
            return f"${len(params)}"

        if query.tenant is not None:
            clauses.append(f"tenant = {param(query.tenant)}")
        if query.since is not None:
            clauses.append(f"occurred_at >= {param(_utc(query.since))}")
        if query.until is not None:
            clauses.append(f"occurred_at < {param(_utc(query.until))}")
        if query.after is not None:
            at = param(_utc(query.after[0]))
            clauses.append(f"(occurred_at, record_id) > ({at}, {param(query.after[1])})")
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        sql = f"{_SELECT} {where} ORDER BY occurred_at, record_id LIMIT {param(query.limit)}"
        async with self._lock:
            try:
                rows = await (await self._connect()).fetch(sql, *params)
            except BaseException:
                await self._drop()
                raise
        return [_record(row) for row in rows]

    async def statement(self, tenant: str, month: str) -> list[StatementLine]:
        sql = STATEMENT_SQL.format(tenant="$1", month="$2")
        async with self._lock:
            try:
                rows = await (await self._connect()).fetch(sql, tenant, month)
            except BaseException:
                await self._drop()
                raise
        return [StatementLine(row[0], *(int(value) for value in tuple(row)[1:])) for row in rows]

    async def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                await asyncio.wait_for(db.close(), self._timeout_s)
            except (OSError, TimeoutError, asyncpg.PostgresError):
                db.terminate()


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
