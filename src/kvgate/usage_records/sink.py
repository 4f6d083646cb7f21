"""What a sink is: a database the records are written to in batches and read back from."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.usage_records.record import UsageRecord


@dataclass(frozen=True, slots=True)
class StatementLine:
    """One served model's month for one tenant: the ledger's fields."""

    model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost_pico: int = 0
    cache_hits: int = 0
    cache_saved_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Which records, in (occurred_at, record_id) order, one page at a time."""

    tenant: str | None = None
    # Unix seconds, UTC: since inclusive, until exclusive.
    since: float | None = None
    until: float | None = None
    # The page after this (occurred_at, record_id): keyset paging, stable under inserts.
    after: tuple[float, str] | None = None
    limit: int = 1000


class RecordSink(abc.ABC):
    name: str

    @abc.abstractmethod
    async def insert(self, records: Sequence[UsageRecord]) -> int:
        """Write the batch in one transaction; records already there (same record_id) are
        left as they are. Connects and migrates first when not connected. Returns how many
        were new. Raises on any failure: the caller keeps the batch."""

    @abc.abstractmethod
    async def records(self, query: RecordQuery) -> list[UsageRecord]: ...

    @abc.abstractmethod
    async def statement(self, tenant: str, month: str) -> list[StatementLine]: ...

    @abc.abstractmethod
    async def schema_version(self) -> int: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
