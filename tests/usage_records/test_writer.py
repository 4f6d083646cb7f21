"""The writer, the spool and real sinks: batches land once, whatever the sink does."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from kvgate.usage_records import RecordQuery, UsageRecord, UsageRecordWriter
from kvgate.usage_records.postgres_sink import PostgresSink
from kvgate.usage_records.spool import Spool, SpoolBusy, SpoolFull
from kvgate.usage_records.sqlite_sink import SqliteSink
from testbed.postgres_harness import PostgresServer
from testbed.usage_records_rig import make_record


async def _wait_for(predicate: object, within_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def _ids(sink: SqliteSink | PostgresSink) -> list[str]:
    return [r.record_id for r in await sink.records(RecordQuery(limit=100_000))]


def test_spool_keeps_batches_across_a_restart_and_skips_torn_lines(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10 * 1024 * 1024)
    first = spool.write([make_record(1), make_record(2)])
    second = spool.write([make_record(3)])
    # A batch a crash interrupted before its rename, and a line edited by hand.
    (tmp_path / "000000000099.part").write_text(make_record(9).to_json() + "\n")
    with second.open("a") as torn:
        torn.write('{"record_id": "half')
    spool.close()
    again = Spool(tmp_path, max_bytes=10 * 1024 * 1024)
    assert again.files() == [first, second]
    assert not list(tmp_path.glob("*.part"))
    assert again.read(first).records == (make_record(1), make_record(2))
    batch = again.read(second)
    assert batch.records == (make_record(3),)
    assert batch.unreadable_lines == 1
    # New batches follow the old ones.
    assert again.write([make_record(4)]).name == "000000000002.jsonl"
    again.close()


def test_spool_is_bounded_and_has_one_owner(tmp_path: Path) -> None:
    bound = sum(len(make_record(n).to_json()) + 1 for n in (1, 2, 3))
    spool = Spool(tmp_path, max_bytes=bound)
    spool.write([make_record(1), make_record(2)])
    with pytest.raises(SpoolFull):
        spool.write([make_record(3), make_record(4)])
    spool.write([make_record(3)])
    with pytest.raises(SpoolBusy):
        Spool(tmp_path, max_bytes=bound)
    spool.close()


@pytest.mark.parametrize("garbage", ["[]", '{"record_id": 1}', "null", "\xff", '{"a":1}'])
def test_a_spool_line_that_is_not_a_record_is_refused(garbage: str) -> None:
    with pytest.raises(ValueError):
        UsageRecord.from_json(garbage)


def test_a_spool_line_with_a_wrong_type_is_refused() -> None:
    good = make_record(1).to_json()
    for bad in ('"prompt_tokens":-1', '"prompt_tokens":true', '"occurred_at":"x"'):
        field = bad.split(":")[0]
        start = good.index(field)
        end = good.index(",", start)
        with pytest.raises(ValueError):
            UsageRecord.from_json(good[:start] + bad + good[end:])


async def test_records_reach_sqlite_once(tmp_path: Path) -> None:
    sink = SqliteSink(tmp_path / "r.sqlite3")
    writer = UsageRecordWriter(
        sink, Spool(tmp_path / "spool", 10**8), batch_size=50, flush_interval_s=0.05
    )
    writer.start()
    for n in range(1, 501):
        writer.add(make_record(n))
    await _wait_for(lambda: writer.counts.inserted == 500)
    await writer.close()
    assert not list((tmp_path / "spool").glob("*.jsonl"))
    reader = SqliteSink(tmp_path / "r.sqlite3")
    assert await _ids(reader) == [f"rec-{n:06d}" for n in range(1, 501)]
    await reader.close()


async def test_a_locked_sqlite_holds_records_in_the_spool_until_it_frees(tmp_path: Path) -> None:
    """Another process holds the database's write lock (a long report, a backup): batches
    wait in the spool, adding never waits, and all land once the lock is gone."""
    path = tmp_path / "r.sqlite3"
    sink = SqliteSink(path, busy_timeout_s=0.2)
    await sink.migrate()
    writer = UsageRecordWriter(
        sink,
        Spool(tmp_path / "spool", 10**8),
        batch_size=20,
        flush_interval_s=0.05,
        write_timeout_s=1.0,
        retry_interval_s=0.1,
    )
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    writer.start()
    for n in range(1, 201):
        writer.add(make_record(n))
    await _wait_for(lambda: writer.counts.spooled == 200 and writer.counts.sink_failures > 0)
    assert writer.counts.inserted == 0
    assert not writer.sink_up
    holder.execute("ROLLBACK")
    holder.close()
    await _wait_for(lambda: writer.counts.inserted == 200)
    assert writer.sink_up
    await writer.close()
    reader = SqliteSink(path)
    assert await _ids(reader) == [f"rec-{n:06d}" for n in range(1, 201)]
    await reader.close()


async def test_records_written_while_postgres_is_down_arrive_once_it_is_back(
    tmp_path: Path,
) -> None:
    with PostgresServer() as server:
        sink = PostgresSink(server.create_database(), timeout_s=1.0)
        writer = UsageRecordWriter(
            sink,
            Spool(tmp_path / "spool", 10**8),
            batch_size=25,
            flush_interval_s=0.05,
            write_timeout_s=1.0,
            retry_interval_s=0.1,
        )
        writer.start()
        for n in range(1, 101):
            writer.add(make_record(n))
        await _wait_for(lambda: writer.counts.inserted == 100)
        await asyncio.to_thread(server.stop)
        for n in range(101, 301):
            writer.add(make_record(n))
        await _wait_for(lambda: writer.counts.spooled == 300 and not writer.sink_up)
        await asyncio.sleep(0.5)
        assert writer.counts.inserted == 100
        await asyncio.to_thread(server.start)
        await _wait_for(lambda: writer.counts.inserted == 300)
        await writer.close()
        reader = PostgresSink(sink.dsn)
        assert await _ids(reader) == [f"rec-{n:06d}" for n in range(1, 301)]
        await reader.close()


async def test_a_full_buffer_drops_records_and_never_blocks(tmp_path: Path) -> None:
    sink = SqliteSink(tmp_path / "r.sqlite3")
    writer = UsageRecordWriter(
        sink, Spool(tmp_path / "spool", 10**8), max_buffered_records=100, flush_interval_s=5
    )
    for n in range(1, 151):  # not started: nothing drains the buffer
        writer.add(make_record(n))
    assert writer.buffered == 100
    assert writer.counts.dropped == 50
    writer.start()
    await writer.close()
    reader = SqliteSink(tmp_path / "r.sqlite3")
    assert len(await _ids(reader)) == 100
    await reader.close()


async def test_batches_a_previous_run_left_in_the_spool_are_shipped_first(tmp_path: Path) -> None:
    """What a killed process had spooled: read back from its files at the next start, with a
    batch the sink already had (its commit landed before the kill) written once."""
    left = Spool(tmp_path / "spool", 10**8)
    left.write([make_record(n) for n in range(1, 11)])
    left.write([make_record(n) for n in range(11, 21)])
    left.close()
    sink = SqliteSink(tmp_path / "r.sqlite3")
    await sink.insert([make_record(n) for n in range(1, 11)])
    writer = UsageRecordWriter(sink, Spool(tmp_path / "spool", 10**8), flush_interval_s=0.05)
    writer.start()
    writer.add(make_record(21))
    await _wait_for(lambda: writer.counts.inserted == 11 and writer.spool.size_bytes == 0)
    await writer.close()
    reader = SqliteSink(tmp_path / "r.sqlite3")
    assert await _ids(reader) == [f"rec-{n:06d}" for n in range(1, 22)]
    await reader.close()
