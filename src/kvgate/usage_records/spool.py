"""The spool: batches of records on local disk, fsynced, until a sink has them.

Each batch is one append-only file (``<sequence>.jsonl``, one record a line), written whole
under a temporary name, fsynced, renamed and the directory fsynced: a file with the final
name is complete and durable. A sink's write removes it. Files are shipped oldest first; a
crash leaves them for the next start. Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.usage_records.record import UsageRecord

log = logging.getLogger("kvgate.usage_records")

_SUFFIX = ".jsonl"
_PARTIAL = ".part"


class SpoolFull(Exception):
    """The spool holds its bound: the batch was not written."""


class SpoolBusy(Exception):
    """Another process holds this spool directory."""


@dataclass(frozen=True, slots=True)
class SpoolBatch:
    path: Path
    records: tuple[UsageRecord, ...]
    # Lines that were not records (torn or edited by hand): skipped, counted.
    unreadable_lines: int = 0


class Spool:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        # One process per spool: two writers would ship and remove each other's files.
        self._lock = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise SpoolBusy(f"{directory} is used by another kvgate process") from None
        for partial in directory.glob(f"*{_PARTIAL}"):
            # A write a crash interrupted: never renamed, so never complete.
            partial.unlink(missing_ok=True)
        files = self.files()
        self._next = int(files[-1].stem) + 1 if files else 0
        self._bytes = sum(path.stat().st_size for path in files)
        # write and remove run on different worker threads.
        self._guard = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def files(self) -> list[Path]:
        """The complete batches, oldest first."""
        names = [p for p in self.directory.glob(f"*{_SUFFIX}") if p.stem.isdigit()]
        return sorted(names, key=lambda path: int(path.stem))

    def write(self, records: Sequence[UsageRecord]) -> Path:
        """Write one batch durably; ``SpoolFull`` when it would pass the bound."""
        data = "".join(record.to_json() + "\n" for record in records).encode()
        with self._guard:
            if self._bytes + len(data) > self.max_bytes:
                raise SpoolFull(f"the spool holds {self._bytes} bytes of {self.max_bytes}")
            final = self.directory / f"{self._next:012d}{_SUFFIX}"
            self._next += 1
            self._bytes += len(data)  # taken now: a concurrent write sees it
        partial = final.with_suffix(_PARTIAL)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(partial, final)
        self._sync_directory()
        return final

    def read(self, path: Path) -> SpoolBatch:
        records: list[UsageRecord] = []
        bad = 0
        with path.open("rb") as lines:
            for line in lines:
                try:
                    records.append(UsageRecord.from_json(line))
                except (ValueError, TypeError):
                    bad += 1
        if bad:
            log.warning("unreadable lines in a usage record spool file", extra={"lines": bad})
        return SpoolBatch(path, tuple(records), bad)

    def remove(self, path: Path) -> None:
        """The sink has the batch."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        path.unlink()
        with self._guard:
            self._bytes = max(0, self._bytes - size)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
