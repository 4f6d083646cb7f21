"""The embedded key store: a SQLite file that survives restarts and is made only when needed."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from kvgate.config import ConfigError, parse_config
from kvgate.keys import KeyRefusal
from kvgate.keys.building import build_key_directory
from kvgate.keys.sqlite_directory import SCHEMA_VERSION, SchemaTooNew, SqliteKeyDirectory
from tests.session.conftest import make_config


def directory(path: Path) -> SqliteKeyDirectory:
    return SqliteKeyDirectory(path, cache_entries=100, refresh_s=0.05)


async def test_keys_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "var" / "keys.sqlite3"
    first = directory(path)
    await first.start()
    kept = await first.create("acme", user="u-7")
    gone = await first.create("acme")
    await first.revoke(gone.record.key_id)
    await first.close()

    reopened = directory(path)
    await reopened.start()
    try:
        assert await reopened.lookup(kept.record.key_hash) == kept.record
        revoked = await reopened.lookup(gone.record.key_hash)
        assert revoked is not None and revoked.refusal(time.time()) is KeyRefusal.REVOKED
        assert await reopened.generation() == 3  # two creates and a revoke
    finally:
        await reopened.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == (
            SCHEMA_VERSION
        )


async def test_no_file_until_the_first_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    keys = directory(path)
    await keys.start()
    try:
        assert await keys.lookup("0" * 64) is None
        assert await keys.list() == []
        assert await keys.revoke("key_0000000000000000") is None
        assert await keys.refresh() is False  # generation 0, as at start
        assert not path.exists()
        await keys.create("acme")
        assert path.exists()
    finally:
        await keys.close()


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL)")
        db.execute("INSERT INTO schema_version VALUES (?, 0)", (SCHEMA_VERSION + 1,))
    keys = directory(path)
    try:
        with pytest.raises(SchemaTooNew):
            await keys.lookup("0" * 64)
    finally:
        await keys.close()


def test_building_follows_the_keys_section(tmp_path: Path) -> None:
    config = make_config()
    config["keys"] = {"store": "auto", "path": str(tmp_path / "k.sqlite3")}
    built = build_key_directory(parse_config(config))
    assert isinstance(built, SqliteKeyDirectory) and built.path == tmp_path / "k.sqlite3"
    config["keys"] = {"store": "off"}
    assert build_key_directory(parse_config(config)) is None
    config["keys"] = {"store": "redis"}
    with pytest.raises(ConfigError, match=r"keys\.store"):
        build_key_directory(parse_config(config))
