"""The writer: records from the request path to the sink, without the request waiting.

The request path calls ``add`` (an append to a bounded in-memory list, nothing else). Every
``flush_interval_s`` (or at ``batch_size`` records) a background task writes the list to the
spool, fsynced, off the event loop; another ships spool files to the sink oldest first, each
in one idempotent transaction, and removes them. A sink that is slow or down holds up only
the shipping task: batches wait in the spool (bounded) and are shipped when it is back.

What a SIGKILL can lose: the records added since the last spool write (at most
``flush_interval_s`` of settlements plus the write itself). Anything spooled is shipped after
the restart; a batch the sink committed but the spool did not yet remove is shipped again and
changes nothing (every insert is ``ON CONFLICT (record_id) DO NOTHING``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.usage_records.record import UsageRecord
from kvgate.usage_records.sink import RecordSink
from kvgate.usage_records.spool import Spool, SpoolFull

log = logging.getLogger("kvgate.usage_records")

# The longest wait between retries of a sink that keeps failing.
MAX_RETRY_INTERVAL_S = 30.0


@dataclass(slots=True)
class WriterCounts:
    """What the writer did since it started (exported as metrics by whoever owns it)."""

    added: int = 0
    # Dropped: the memory buffer or the spool was full.
    dropped: int = 0
    spooled: int = 0
    # Inserted new into the sink (replays of records already there are not counted).
    inserted: int = 0
    sink_failures: int = 0
    unreadable_spool_lines: int = 0


class UsageRecordWriter:
    def __init__(
        self,
        sink: RecordSink,
        spool: Spool,
        *,
        batch_size: int = 1000,
        flush_interval_s: float = 0.2,
        max_buffered_records: int = 100_000,
        write_timeout_s: float = 10.0,
        retry_interval_s: float = 1.0,
        on_sink_state: Callable[[bool], None] | None = None,
    ) -> None:
        self.sink = sink
        self.spool = spool
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._max_buffered = max_buffered_records
        self._write_timeout_s = write_timeout_s
        self._retry_interval_s = retry_interval_s
        self._on_sink_state = on_sink_state
        self._buffer: list[UsageRecord] = []
        # Batches this process spooled, still in memory: shipped without reading their file
        # back (a file a previous run left is read).
        self._spooled_batches: dict[Path, Sequence[UsageRecord]] = {}
        self._flush_now = asyncio.Event()
        self._spooled = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.counts = WriterCounts()
        self.sink_up = True

    # -- the request path -----------------------------------------------------------------

    def add(self, record: UsageRecord) -> None:
        """Keep one record for the next batch; never blocks, never raises."""
        if len(self._buffer) >= self._max_buffered:
            self.counts.dropped += 1
            if self.counts.dropped == 1 or self.counts.dropped % 10_000 == 0:
                log.error(
                    "usage records dropped: the memory buffer is full",
                    extra={"dropped": self.counts.dropped},
                )
            return
        self._buffer.append(record)
        self.counts.added += 1
        if len(self._buffer) >= self._batch_size:
            self._flush_now.set()

    # -- background -------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flushing(), name="usage-records-spool"),
            asyncio.create_task(self._shipping(), name="usage-records-ship"),
        ]
        self._spooled.set()  # whatever a previous run left in the spool ships first

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    async def _flushing(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), self._flush_interval_s)
            self._flush_now.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write the buffer to the spool (in batches), off the event loop."""
        while self._buffer:
            batch = self._buffer[: self._batch_size]
            del self._buffer[: self._batch_size]
            try:
                path = await asyncio.to_thread(self.spool.write, batch)
            except SpoolFull as full:
                self.counts.dropped += len(batch)
                log.error("usage records dropped: %s", full, extra={"records": len(batch)})
                continue
            except OSError:
                self.counts.dropped += len(batch)
                log.exception("usage records dropped: the spool cannot be written")
                continue
            self._spooled_batches[path] = batch
            self.counts.spooled += len(batch)
            self._spooled.set()

    async def _shipping(self) -> None:
        wait = self._retry_interval_s
        while True:
            await self._spooled.wait()
            self._spooled.clear()
            while True:
                if await self.ship_once():
                    wait = self._retry_interval_s
                    break
                await asyncio.sleep(wait)
                wait = min(wait * 2, MAX_RETRY_INTERVAL_S)

    async def ship_once(self) -> bool:
        """Ship every spool file, oldest first; False when the sink failed (the file stays)."""
        for path in await asyncio.to_thread(self.spool.files):
            records = self._spooled_batches.get(path)
            if records is None:
                batch = await asyncio.to_thread(self.spool.read, path)
                self.counts.unreadable_spool_lines += batch.unreadable_lines
                records = batch.records
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    inserted = await self.sink.insert(records)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.counts.sink_failures += 1
                self._sink_state(False, exc)
                return False
            self.counts.inserted += inserted
            await asyncio.to_thread(self.spool.remove, path)
            self._spooled_batches.pop(path, None)
            self._sink_state(True, None)
        return True

    def _sink_state(self, up: bool, error: Exception | None) -> None:
        if up == self.sink_up:
            return
        self.sink_up = up
        if up:
            log.warning("the usage record sink is back; the spool is being shipped")
        else:
            log.error(
                "the usage record sink failed; records wait in the spool: %r",
                error,
                extra={"sink": self.sink.name},
            )
        if self._on_sink_state is not None:
            self._on_sink_state(up)

    async def close(self, ship_timeout_s: float = 2.0) -> None:
        """Stop: the buffer goes to the spool, then one last try to ship (bounded)."""
        if self._closing:
            return
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.flush()
        try:
            async with asyncio.timeout(ship_timeout_s):
                await self.ship_once()
        except TimeoutError:
            log.warning("usage records left in the spool for the next start")
        await self.sink.close()
        self.spool.close()
