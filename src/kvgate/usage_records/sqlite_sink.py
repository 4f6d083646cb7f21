"""The embedded sink: one SQLite file in WAL mode, for a single replica.

sqlite3 blocks, so every call runs on one worker thread that owns the connection; the event
loop only awaits it. Commits are ``synchronous=FULL``: a batch the spool removed is on disk.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

from kvgate.sqlite_thread import SqliteThread
from kvgate.usage_records.record import AnswerSource, UsageRecord
from kvgate.usage_records.schema import (
    COLUMNS,
    LATEST,
    SCHEMA_VERSION_SQLITE,
    STATEMENT_SQL,
    pending,
)
from kvgate.usage_records.sink import RecordQuery, RecordSink, StatementLine

T = TypeVar("T")

_INSERT = (
    f"INSERT INTO usage_records ({', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in COLUMNS)}) ON CONFLICT (record_id) DO NOTHING"
)
_BOOLS = ("booked_request", "cache_hit")


_row: Callable[[UsageRecord], tuple[Any, ...]] = attrgetter(*COLUMNS)


def _record(row: sqlite3.Row) -> UsageRecord:
    values = {name: row[name] for name in COLUMNS}
    for name in _BOOLS:
        values[name] = bool(values[name])
    values["answer_source"] = AnswerSource(values["answer_source"])
    return UsageRecord(**values)


class SqliteSink(RecordSink):
    name = "sqlite"

    def __init__(self, path: Path, *, busy_timeout_s: float = 10.0) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._sqlite = SqliteThread("usage-sqlite")
        self._migrated = False

    async def _run(self, work: Callable[[], T]) -> T:
        return await self._sqlite.run(work)

    def _connect(self, up_to: int = LATEST) -> sqlite3.Connection:
        if self._sqlite.db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            self._sqlite.db = db
        self._migrate(self._sqlite.db, up_to)
        return self._sqlite.db

    def _version(self, db: sqlite3.Connection) -> int:
        db.execute(SCHEMA_VERSION_SQLITE)
        row = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        return int(row[0])

    def _migrate(self, db: sqlite3.Connection, up_to: int) -> None:
        if up_to == LATEST and self._migrated:
            return
        if not pending(self._version(db), up_to):  # raises for a newer database
            self._migrated = up_to == LATEST
            return
        db.execute("BEGIN IMMEDIATE")  # one writer migrates; the others see its result
        try:
            for migration in pending(self._version(db), up_to):
                for statement in migration.sqlite:
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_version (version, applied_at, what) VALUES (?, ?, ?)",
                    (migration.version, time.time(), migration.what),
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._migrated = up_to == LATEST

    async def migrate(self, up_to: int = LATEST) -> None:
        await self._run(lambda: self._connect(up_to))

    async def schema_version(self) -> int:
        def version() -> int:
            if self._sqlite.db is None:
                self._sqlite.db = sqlite3.connect(self.path, isolation_level=None)
                self._sqlite.db.row_factory = sqlite3.Row
            return self._version(self._sqlite.db)

        return await self._run(version)

    async def insert(self, records: Sequence[UsageRecord]) -> int:
        rows = [_row(record) for record in records]

        def write() -> int:
            db = self._connect()
            before = db.total_changes
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(_INSERT, rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return db.total_changes - before

        return await self._run(write)

    async def records(self, query: RecordQuery) -> list[UsageRecord]:
        where, params = _where(query)
        sql = f"SELECT * FROM usage_records {where} ORDER BY occurred_at, record_id LIMIT ?"

        def read() -> list[UsageRecord]:
            rows = self._connect().execute(sql, (*params, query.limit)).fetchall()
            return [_record(row) for row in rows]

        return await self._run(read)

    async def statement(self, tenant: str, month: str) -> list[StatementLine]:
        sql = STATEMENT_SQL.format(tenant="?", month="?")

        def read() -> list[StatementLine]:
            rows = self._connect().execute(sql, (tenant, month)).fetchall()
            return [
                StatementLine(row[0], *(int(value) for value in tuple(row)[1:])) for row in rows
            ]

        return await self._run(read)

    async def close(self) -> None:
        await self._sqlite.close()


def _where(query: RecordQuery) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    params: list[Any] = []
    if query.tenant is not None:
        clauses.append("tenant = ?")
        params.append(query.tenant)
    if query.since is not None:
        clauses.append("occurred_at >= ?")
        params.append(query.since)
    if query.until is not None:
        clauses.append("occurred_at < ?")
        params.append(query.until)
    if query.after is not None:
        clauses.append("(occurred_at > ? OR (occurred_at = ? AND record_id > ?))")
        params += [query.after[0], query.after[0], query.after[1]]
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", params
