"""The writer's counts as Prometheus metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.usage_records.writer import UsageRecordWriter


class UsageRecordsCollector(Collector):
    def __init__(self, writer: UsageRecordWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        writer = self._writer
        counts = writer.counts
        records = CounterMetricFamily(
            "kvgate_usage_records",
            "Usage records by what became of them: added (by the request path), spooled "
            "(fsynced to the local spool), inserted (new rows in the sink), dropped (a full "
            "buffer or spool).",
            labels=["state"],
        )
        for state, value in (
            ("added", counts.added),
            ("spooled", counts.spooled),
            ("inserted", counts.inserted),
            ("dropped", counts.dropped),
        ):
            records.add_metric([state], value)
        yield records
        yield CounterMetricFamily(
            "kvgate_usage_record_sink_failures",
            "Batches the sink failed to take (they stay in the spool and are retried).",
            value=counts.sink_failures,
        )
        yield GaugeMetricFamily(
            "kvgate_usage_record_sink_up",
            "1 while the last write to the usage record sink succeeded.",
            value=1 if writer.sink_up else 0,
        )
        yield GaugeMetricFamily(
            "kvgate_usage_record_spool_bytes",
            "Bytes of usage records waiting in the spool for the sink.",
            value=writer.spool.size_bytes,
        )
        yield GaugeMetricFamily(
            "kvgate_usage_records_buffered",
            "Usage records in memory waiting for the next spool write.",
            value=writer.buffered,
        )
