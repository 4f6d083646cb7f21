"""API keys in a SQLite file (WAL): the embedded default, for one replica; survives restarts.

sqlite3 blocks, so every call runs on one worker thread that owns the connection; the event
loop only awaits it. The file is made by the first key created: a deployment that never makes
one gets no file, and until then every lookup is a miss without opening anything.

The generation is a row every change bumps in the same transaction, so polling it also sees
changes another process (another kvgate on the same file) made.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvgate.keys.directory import FIELDS, CachedDirectory, record_fields, record_from_fields
from kvgate.keys.records import KeyRecord
from kvgate.sqlite_thread import SqliteThread

_T = TypeVar("_T")

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL)",
    # Absent optional values are '' (the same flat fields as the Redis hash).
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_id TEXT PRIMARY KEY,
        key_hash TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        team TEXT NOT NULL,
        user TEXT NOT NULL,
        labels TEXT NOT NULL,
        created_at TEXT NOT NULL,
        expires_at TEXT NOT NULL,
        revoked_at TEXT NOT NULL,
        limits TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS api_keys_by_tenant ON api_keys (tenant, key_id)",
    """CREATE TABLE IF NOT EXISTS generation (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        value INTEGER NOT NULL
    )""",
    "INSERT OR IGNORE INTO generation (id, value) VALUES (1, 0)",
)
_COLUMNS = ", ".join(FIELDS)
_INSERT = f"INSERT INTO api_keys ({_COLUMNS}) VALUES ({', '.join('?' for _ in FIELDS)})"
_BUMP = "UPDATE generation SET value = value + 1 WHERE id = 1"


class SchemaTooNew(RuntimeError):
    pass


class SqliteKeyDirectory(CachedDirectory):
    def __init__(
        self,
        path: Path,
        *,
        cache_entries: int,
        refresh_s: float,
        busy_timeout_s: float = 10.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(cache_entries=cache_entries, refresh_s=refresh_s, now=now)
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._sqlite = SqliteThread("keys-sqlite")

    async def _run(self, work: Callable[[], _T]) -> _T:
        return await self._sqlite.run(work)

    # ------------------------------------------------------------------ on the worker thread

    def _connect(self, *, create: bool) -> sqlite3.Connection | None:
        """The connection; None when the file does not exist and ``create`` is false."""
        if self._sqlite.db is not None:
            return self._sqlite.db
        if not create and not self.path.exists():
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a key the CLI was shown is on disk
        self._migrate(db)
        self._sqlite.db = db
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")  # one process migrates; the others see its result
        try:
            db.execute(_SCHEMA[0])
            row = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
            version = int(row[0])
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self.path}: key store schema {version} is newer than this kvgate's "
                    f"({SCHEMA_VERSION})"
                )
            if version < SCHEMA_VERSION:
                for statement in _SCHEMA[1:]:
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                    (SCHEMA_VERSION, time.time()),
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _select(self, where: str, params: tuple[str, ...]) -> KeyRecord | None:
        db = self._connect(create=False)
        if db is None:
            return None
        row = db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE {where}", params).fetchone()
        return record_from_fields(dict(row)) if row is not None else None

    def _write(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """``work`` and the generation's bump in one transaction."""
        db = self._connect(create=True)
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            result = work(db)
            db.execute(_BUMP)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return result

    # ------------------------------------------------------------------ the store's part

    async def _read_by_hash(self, key_hash: str) -> KeyRecord | None:
        return await self._run(lambda: self._select("key_hash = ?", (key_hash,)))

    async def _read_by_id(self, key_id: str) -> KeyRecord | None:
        return await self._run(lambda: self._select("key_id = ?", (key_id,)))

    async def _read_page(
        self, tenant: str | None, after_key_id: str, limit: int
    ) -> list[KeyRecord]:
        where = "key_id > ?" + (" AND tenant = ?" if tenant is not None else "")
        params: tuple[str | int, ...] = (after_key_id, *((tenant,) if tenant is not None else ()))

        def read() -> list[KeyRecord]:
            db = self._connect(create=False)
            if db is None:
                return []
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM api_keys WHERE {where} ORDER BY key_id LIMIT ?",
                (*params, limit),
            ).fetchall()
            return [record_from_fields(dict(row)) for row in rows]

        return await self._run(read)

    async def _insert(self, record: KeyRecord) -> None:
        fields = record_fields(record)
        row = tuple(fields[name] for name in FIELDS)
        await self._run(lambda: self._write(lambda db: db.execute(_INSERT, row)))

    async def _set_revoked(self, key_id: str, at: float) -> KeyRecord | None:
        def revoke(db: sqlite3.Connection) -> KeyRecord | None:
            row = db.execute("SELECT revoked_at FROM api_keys WHERE key_id = ?", (key_id,))
            found = row.fetchone()
            if found is None:
                return None
            if not found[0] or at < float(found[0]):
                db.execute(
                    "UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (repr(at), key_id)
                )
            return self._select("key_id = ?", (key_id,))

        def run() -> KeyRecord | None:
            if self._connect(create=False) is None:
                return None
            return self._write(revoke)

        return await self._run(run)

    async def _replace(self, key_id: str, new: KeyRecord, revoke_at: float) -> KeyRecord | None:
        def replace(db: sqlite3.Connection) -> KeyRecord | None:
            old = self._select("key_id = ?", (key_id,))
            now = new.created_at
            if old is None or (old.revoked_at is not None and old.revoked_at <= now):
                return None
            record = KeyRecord(
                key_id=new.key_id,
                key_hash=new.key_hash,
                tenant=old.tenant,
                team=old.team,
                user=old.user,
                labels=old.labels,
                created_at=new.created_at,
                expires_at=old.expires_at,
                limits=old.limits,
            )
            fields = record_fields(record)
            db.execute(_INSERT, tuple(fields[name] for name in FIELDS))
            if old.revoked_at is None or revoke_at < old.revoked_at:
                db.execute(
                    "UPDATE api_keys SET revoked_at = ? WHERE key_id = ?",
                    (repr(revoke_at), key_id),
                )
            return record

        def run() -> KeyRecord | None:
            if self._connect(create=False) is None:
                return None
            return self._write(replace)

        return await self._run(run)

    async def generation(self) -> int:
        def read() -> int:
            db = self._connect(create=False)
            if db is None:
                return 0
            return int(db.execute("SELECT value FROM generation WHERE id = 1").fetchone()[0])

        return await self._run(read)

    async def _close_store(self) -> None:
        await self._sqlite.close()
