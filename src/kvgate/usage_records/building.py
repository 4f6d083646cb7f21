"""From the config's `usage_records:` section to a sink, its spool and its writer."""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.config import ConfigError
from kvgate.config.model import UsageRecordsConfig
from kvgate.usage_records.sink import RecordSink
from kvgate.usage_records.spool import Spool, SpoolBusy
from kvgate.usage_records.writer import UsageRecordWriter


def postgres_dsn(config: UsageRecordsConfig) -> str:
    """The PostgreSQL URL from the environment variable or the file the config names."""
    if config.postgres_dsn_env is not None:
        dsn = os.environ.get(config.postgres_dsn_env, "").strip()
        if not dsn:
            raise ConfigError(f"usage_records: ${config.postgres_dsn_env} is not set")
        return dsn
    assert config.postgres_dsn_file is not None
    try:
        dsn = Path(config.postgres_dsn_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"usage_records: cannot read postgres_dsn_file: {exc}") from None
    if not dsn:
        raise ConfigError("usage_records: postgres_dsn_file is empty")
    return dsn


def build_sink(config: UsageRecordsConfig) -> RecordSink | None:
    """The configured sink (None: records are off). Connects nothing yet."""
    if config.sink == "sqlite":
        from kvgate.usage_records.sqlite_sink import SqliteSink

        return SqliteSink(Path(config.sqlite_path), busy_timeout_s=config.write_timeout_s)
    if config.sink == "postgres":
        from kvgate.usage_records.postgres_sink import PostgresSink

        return PostgresSink(postgres_dsn(config), timeout_s=config.write_timeout_s)
    return None


def build_writer(config: UsageRecordsConfig) -> UsageRecordWriter | None:
    """The writer (not started), or None when records are off."""
    sink = build_sink(config)
    if sink is None:
        return None
    try:
        spool = Spool(Path(config.spool_dir), config.max_spool_bytes)
    except (SpoolBusy, OSError) as exc:
        raise ConfigError(f"usage_records.spool_dir: {exc}") from None
    return UsageRecordWriter(
        sink,
        spool,
        batch_size=config.batch_size,
        flush_interval_s=config.flush_interval_s,
        max_buffered_records=config.max_buffered_records,
        write_timeout_s=config.write_timeout_s,
        retry_interval_s=config.retry_interval_s,
    )
