"""The records table in both databases, and its versioned migrations.

``schema_version`` holds one row per migration applied. A sink migrates when it connects:
each step in its own transaction (PostgreSQL: under an advisory lock, so replicas starting
together migrate once). A database newer than this kvgate is refused, never written.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.usage_records.record import UsageRecord

# The record's fields in column order (the insert's and the reader's).
COLUMNS: tuple[str, ...] = tuple(UsageRecord.__dataclass_fields__)


class SchemaTooNew(Exception):
    """The database was migrated by a newer kvgate."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    what: str
    sqlite: tuple[str, ...]
    postgres: tuple[str, ...]


def _table(types: dict[str, str]) -> str:
    base = {
        "record_id": "TEXT PRIMARY KEY",
        "request_id": "TEXT NOT NULL",
        "ledger_day": "TEXT NOT NULL",
        "ledger_month": "TEXT NOT NULL",
        "tenant": "TEXT NOT NULL",
        "api": "TEXT NOT NULL",
        "path": "TEXT NOT NULL",
        "requested_model": "TEXT NOT NULL",
        "served_model": "TEXT NOT NULL",
        "backend": "TEXT",
        "endpoint": "TEXT",
        "prompt_tokens": "BIGINT NOT NULL",
        "cached_tokens": "BIGINT NOT NULL",
        "output_tokens": "BIGINT NOT NULL",
        "reasoning_tokens": "BIGINT",
        "cost_pico": "BIGINT NOT NULL",
        "pricing_version": "TEXT",
        "answer_source": "TEXT NOT NULL",
        "status": "INTEGER NOT NULL",
        "settle_cause": "TEXT NOT NULL",
        "saved_tokens": "BIGINT NOT NULL",
        "route": "TEXT",
        "decision_ms": "DOUBLE PRECISION",
        "ttft_ms": "DOUBLE PRECISION",
        "duration_ms": "DOUBLE PRECISION",
        "team_id": "TEXT",
        "user_id": "TEXT",
        "key_id": "TEXT",
    }
    base.update(types)
    columns = [f"{name} {base[name]}" for name in COLUMNS]
    return "CREATE TABLE usage_records (\n  " + ",\n  ".join(columns) + "\n)"


_V1_SQLITE = _table(
    {
        # Unix seconds, UTC: datetime(occurred_at, 'unixepoch') reads it.
        "occurred_at": "REAL NOT NULL",
        "booked_request": "INTEGER NOT NULL",
        "cache_hit": "INTEGER NOT NULL",
    }
)
_V1_POSTGRES = _table(
    {
        "occurred_at": "TIMESTAMPTZ NOT NULL",
        "booked_request": "BOOLEAN NOT NULL",
        "cache_hit": "BOOLEAN NOT NULL",
    }
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the usage_records table", (_V1_SQLITE,), (_V1_POSTGRES,)),
    Migration(
        2,
        "indexes for a tenant's records by time and its monthly statement; cost in dollars",
        (
            "CREATE INDEX usage_records_tenant_time ON usage_records (tenant, occurred_at)",
            "CREATE INDEX usage_records_tenant_month ON usage_records (tenant, ledger_month)",
        ),
        (
            "CREATE INDEX usage_records_tenant_time ON usage_records (tenant, occurred_at)",
            "CREATE INDEX usage_records_tenant_month ON usage_records (tenant, ledger_month)",
            # Exact: pico-dollars are integers, so the dollars are a fixed-point numeric.
            "ALTER TABLE usage_records ADD COLUMN cost_usd NUMERIC(32, 12) "
            "GENERATED ALWAYS AS (cost_pico::numeric / 1000000000000) STORED",
        ),
    ),
)

LATEST = MIGRATIONS[-1].version

SCHEMA_VERSION_SQLITE = (
    "CREATE TABLE IF NOT EXISTS schema_version "
    "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL, what TEXT NOT NULL)"
)
SCHEMA_VERSION_POSTGRES = (
    "CREATE TABLE IF NOT EXISTS schema_version "
    "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), "
    "what TEXT NOT NULL)"
)


def pending(current: int, up_to: int = LATEST) -> list[Migration]:
    """The migrations a database at ``current`` needs to reach ``up_to``."""
    if current > LATEST:
        raise SchemaTooNew(
            f"the usage records database is at schema version {current}; this kvgate knows "
            f"up to {LATEST}"
        )
    return [m for m in MIGRATIONS if current < m.version <= up_to]


# What a monthly statement sums, per served model: the ledger's own fields.
STATEMENT_SQL = (
    "SELECT served_model,"
    " SUM(CASE WHEN booked_request THEN 1 ELSE 0 END),"
    " SUM(CASE WHEN booked_request THEN prompt_tokens ELSE 0 END),"
    " SUM(CASE WHEN booked_request THEN cached_tokens ELSE 0 END),"
    " SUM(CASE WHEN booked_request THEN output_tokens ELSE 0 END),"
    " SUM(CASE WHEN booked_request THEN cost_pico ELSE 0 END),"
    " SUM(CASE WHEN cache_hit THEN 1 ELSE 0 END),"
    " SUM(CASE WHEN cache_hit THEN saved_tokens ELSE 0 END)"
    " FROM usage_records WHERE tenant = {tenant} AND ledger_month = {month}"
    " GROUP BY served_model ORDER BY served_model"
)
