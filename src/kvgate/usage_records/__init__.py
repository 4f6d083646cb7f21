"""Usage records: one durable row per request in SQLite or PostgreSQL (docs/usage-records.md).

The request path hands a ``UsageRecord`` to ``UsageRecordWriter.add`` (an append to a
bounded list); the writer spools batches to local disk and ships them to the sink in the
background, idempotently by ``record_id``.
"""

from kvgate.usage_records.record import AnswerSource, UsageRecord, pricing_version
from kvgate.usage_records.sink import RecordQuery, RecordSink, StatementLine
from kvgate.usage_records.writer import UsageRecordWriter

__all__ = [
    "AnswerSource",
    "RecordQuery",
    "RecordSink",
    "StatementLine",
    "UsageRecord",
    "UsageRecordWriter",
    "pricing_version",
]
