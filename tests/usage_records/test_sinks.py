"""Both sinks against their real databases: idempotent batches, reading back, the statement,
and the versioned migrations (an empty database, one at an older version, a newer one)."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from kvgate.usage_records import RecordQuery, RecordSink, StatementLine, UsageRecord
from kvgate.usage_records.postgres_sink import PostgresSink
from kvgate.usage_records.schema import COLUMNS, LATEST, SchemaTooNew
from kvgate.usage_records.sqlite_sink import SqliteSink
from testbed.usage_records_rig import make_record

SinkFactory = Callable[[], SqliteSink | PostgresSink]


@pytest.fixture(params=["sqlite", "postgres"])
def new_sink(request: pytest.FixtureRequest, tmp_path: Path) -> SinkFactory:
    """Makes sinks on one database (a second one is another replica or a later start)."""
    if request.param == "sqlite":
        path = tmp_path / "records.sqlite3"
        return lambda: SqliteSink(path)
    dsn = request.getfixturevalue("postgres_dsn")
    return lambda: PostgresSink(dsn)


@pytest.fixture
async def sink(new_sink: SinkFactory) -> AsyncIterator[SqliteSink | PostgresSink]:
    made = new_sink()
    yield made
    await made.close()


async def read_all(sink: RecordSink, **filters: object) -> list[UsageRecord]:
    """Every record the query selects, page by page (a page of 7: paging is exercised)."""
    out: list[UsageRecord] = []
    after = None
    while True:
        page = await sink.records(RecordQuery(after=after, limit=7, **filters))  # type: ignore[arg-type]
        out += page
        if len(page) < 7:
            return out
        after = (page[-1].occurred_at, page[-1].record_id)


async def test_records_come_back_as_written(sink: SqliteSink | PostgresSink) -> None:
    written = [make_record(n) for n in range(1, 40)]
    assert await sink.insert(written) == len(written)
    assert await read_all(sink) == written


async def test_a_batch_written_again_adds_nothing(new_sink: SinkFactory) -> None:
    """A spool replayed after a crash, a retry after a timeout, another replica: the same
    record_id is one row, whoever writes it."""
    first, second = new_sink(), new_sink()
    try:
        batch = [make_record(n) for n in range(1, 21)]
        assert await first.insert(batch) == 20
        assert await first.insert(batch) == 0
        overlapping = [make_record(n) for n in range(15, 31)]
        assert await second.insert(overlapping) == 10
        records = await read_all(first)
        assert [r.record_id for r in records] == [f"rec-{n:06d}" for n in range(1, 31)]
    finally:
        await first.close()
        await second.close()


async def test_filters_by_tenant_and_time(sink: SqliteSink | PostgresSink) -> None:
    records = [make_record(n, tenant="acme") for n in range(1, 30)]
    records += [make_record(n, tenant="other") for n in range(100, 110)]
    await sink.insert(records)
    start = records[4].occurred_at
    end = records[10].occurred_at
    got = await read_all(sink, tenant="acme", since=start, until=end)
    assert got == records[4:10]
    assert await read_all(sink, tenant="nobody") == []
    assert len(await read_all(sink, tenant="other")) == 10


async def test_statement_sums_the_ledger_fields_exactly(sink: SqliteSink | PostgresSink) -> None:
    records = [make_record(n) for n in range(1, 60)]
    other_month = [
        UsageRecord(**{**_fields(make_record(n)), "record_id": f"x{n}", "ledger_month": "2026-11"})
        for n in range(1, 5)
    ]
    await sink.insert(records + other_month)
    expected: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        line = expected[r.served_model]
        if r.booked_request:
            line["requests"] += 1
            line["prompt_tokens"] += r.prompt_tokens
            line["cached_tokens"] += r.cached_tokens
            line["output_tokens"] += r.output_tokens
            line["cost_pico"] += r.cost_pico
        if r.cache_hit:
            line["cache_hits"] += 1
            line["cache_saved_tokens"] += r.saved_tokens
    statement = await sink.statement("acme", "2026-12")
    assert statement == [
        StatementLine(model, **dict(expected[model])) for model in sorted(expected)
    ]
    assert await sink.statement("acme", "2027-01") == []


def _fields(record: UsageRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in UsageRecord.__dataclass_fields__}


async def test_an_empty_database_is_migrated_to_the_latest_version(
    sink: SqliteSink | PostgresSink,
) -> None:
    await sink.migrate()
    assert await sink.schema_version() == LATEST
    await sink.migrate()  # again: nothing to do
    assert await sink.schema_version() == LATEST


async def _raw(
    sink: SqliteSink | PostgresSink, sql: str, *args: object
) -> list[tuple[object, ...]]:
    """A statement on the sink's database, outside the sink (as an older kvgate, or an
    operator, would run it)."""
    if isinstance(sink, SqliteSink):
        with sqlite3.connect(sink.path) as db:
            return [tuple(row) for row in db.execute(sql.replace("$", "?"), args).fetchall()]
    db = await asyncpg.connect(sink.dsn)
    try:
        return [tuple(row) for row in await db.fetch(sql, *args)]
    finally:
        await db.close()


async def test_a_database_at_an_older_version_is_migrated_and_keeps_its_rows(
    new_sink: SinkFactory,
) -> None:
    old = new_sink()
    await old.migrate(up_to=1)
    assert await old.schema_version() == 1
    await old.close()
    row = make_record(3)
    # A row written by a kvgate that knew only version 1.
    values = [getattr(row, name) for name in COLUMNS]
    if not isinstance(old, SqliteSink):
        values[COLUMNS.index("occurred_at")] = row.occurred_at_utc
    placeholders = ", ".join(f"${i + 1}" for i in range(len(COLUMNS)))
    await _raw(
        old, f"INSERT INTO usage_records ({', '.join(COLUMNS)}) VALUES ({placeholders})", *values
    )
    newer = new_sink()
    try:
        assert await read_all(newer) == [row]
        assert await newer.schema_version() == LATEST
        assert await newer.insert([row, make_record(4)]) == 1
    finally:
        await newer.close()
    versions = await _raw(newer, "SELECT version FROM schema_version ORDER BY version")
    assert versions == [(v,) for v in range(1, LATEST + 1)]
    if isinstance(newer, PostgresSink):
        cost = await _raw(
            newer, "SELECT cost_usd FROM usage_records WHERE record_id = $1", row.record_id
        )
        assert cost == [(row.cost_usd,)]
        indexes = await _raw(
            newer, "SELECT indexname FROM pg_indexes WHERE tablename = 'usage_records'"
        )
    else:
        indexes = await _raw(newer, "SELECT name FROM sqlite_master WHERE type = 'index'")
    assert {"usage_records_tenant_time", "usage_records_tenant_month"} <= {i[0] for i in indexes}


async def test_a_database_newer_than_this_kvgate_is_refused(new_sink: SinkFactory) -> None:
    sink = new_sink()
    await sink.migrate()
    await sink.close()
    # A step this kvgate does not know, applied by a newer one.
    await _raw(
        sink,
        "INSERT INTO schema_version (version, applied_at, what) VALUES ($1, $2, 'future')",
        LATEST + 1,
        0.0 if isinstance(sink, SqliteSink) else datetime.now(UTC),
    )
    again = new_sink()
    try:
        with pytest.raises(SchemaTooNew):
            await again.insert([make_record(1)])
    finally:
        await again.close()
    assert await _raw(sink, "SELECT count(*) FROM usage_records") == [(0,)]


async def test_hostile_text_is_clipped_and_stored(sink: SqliteSink | PostgresSink) -> None:
    """A client picks its x-request-id: NUL (PostgreSQL's text refuses it, which would hold
    the whole batch back) and megabytes are not stored as sent."""
    hostile = UsageRecord(
        **{**_fields(make_record(1)), "request_id": "a\x00b" + "x" * 100_000, "path": "/p\x00"}
    )
    assert await sink.insert([hostile, make_record(2)]) == 2
    [stored, _] = await read_all(sink)
    assert stored.request_id == "ab" + "x" * 253  # clipped to 256, then the NUL dropped
    assert stored.path == "/p"
