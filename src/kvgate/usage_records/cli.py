"""`kvgate records` (CSV or JSON lines) and `kvgate statement` (a tenant's month, summed as
the ledger sums it), read from the sink the config names."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from kvgate.config import ConfigError, load_config
from kvgate.policy import pico_to_usd
from kvgate.usage_records.building import build_sink
from kvgate.usage_records.record import UsageRecord
from kvgate.usage_records.schema import COLUMNS
from kvgate.usage_records.sink import RecordQuery, RecordSink, StatementLine

PAGE = 5000
_MONTH = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def money(pico: int) -> str:
    """Dollars, exact (no float), as the usage report writes them."""
    return format(pico_to_usd(pico).normalize(), "f")


def parse_time(text: str) -> float:
    """ISO 8601 (a date, or a date and time; UTC unless it says otherwise) as Unix seconds."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date or time: {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def parse_month(text: str) -> str:
    if not _MONTH.match(text):
        raise argparse.ArgumentTypeError(f"not a month YYYY-MM: {text!r}")
    return text


def _cell(value: Any) -> Any:
    """A CSV cell a spreadsheet will not run: text a client chose (its x-request-id) that
    starts like a formula gets a leading apostrophe (OWASP's CSV injection advice)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _row(record: UsageRecord) -> dict[str, Any]:
    row = record.as_dict()
    row["occurred_at"] = record.occurred_at_utc.isoformat()
    row["answer_source"] = record.answer_source.value
    row["cost_usd"] = money(record.cost_pico)
    return row


async def write_records(sink: RecordSink, query: RecordQuery, out: TextIO, fmt: str) -> int:
    """Every record the query selects, page by page; how many."""
    writer: Callable[[dict[str, Any]], Any]
    if fmt == "csv":
        table = csv.DictWriter(out, fieldnames=[*COLUMNS, "cost_usd"], lineterminator="\n")
        table.writeheader()

        def writer(row: dict[str, Any]) -> None:
            table.writerow({name: _cell(value) for name, value in row.items()})
    else:

        def writer(row: dict[str, Any]) -> None:
            out.write(json.dumps(row, separators=(",", ":")) + "\n")

    count = 0
    page_query = query
    while True:
        page = await sink.records(page_query)
        for record in page:
            writer(_row(record))
        count += len(page)
        if len(page) < page_query.limit:
            return count
        last = page[-1]
        page_query = RecordQuery(
            tenant=query.tenant,
            since=query.since,
            until=query.until,
            after=(last.occurred_at, last.record_id),
            limit=query.limit,
        )


def statement_json(tenant: str, month: str, lines: list[StatementLine]) -> dict[str, Any]:
    """The month in the usage report's words (`GET /v1/kvgate/usage`'s this_month)."""

    def totals(line: StatementLine) -> dict[str, Any]:
        return {
            "requests": line.requests,
            "prompt_tokens": line.prompt_tokens,
            "cached_prompt_tokens": line.cached_tokens,
            "output_tokens": line.output_tokens,
            "cost_usd": money(line.cost_pico),
            "cache_hits": line.cache_hits,
            "cache_saved_tokens": line.cache_saved_tokens,
        }

    total = StatementLine(
        model="",
        requests=sum(line.requests for line in lines),
        prompt_tokens=sum(line.prompt_tokens for line in lines),
        cached_tokens=sum(line.cached_tokens for line in lines),
        output_tokens=sum(line.output_tokens for line in lines),
        cost_pico=sum(line.cost_pico for line in lines),
        cache_hits=sum(line.cache_hits for line in lines),
        cache_saved_tokens=sum(line.cache_saved_tokens for line in lines),
    )
    return {
        "object": "kvgate.usage_statement",
        "tenant": tenant,
        "period": month,
        **totals(total),
        "by_model": {line.model: totals(line) for line in lines},
    }


def _statement_text(statement: dict[str, Any], out: TextIO) -> None:
    out.write(f"Usage statement: tenant {statement['tenant']}, {statement['period']} (UTC)\n\n")
    header = ("model", "requests", "prompt", "cached", "output", "cost_usd", "cache_hits")
    rows = [
        (
            model,
            str(t["requests"]),
            str(t["prompt_tokens"]),
            str(t["cached_prompt_tokens"]),
            str(t["output_tokens"]),
            t["cost_usd"],
            str(t["cache_hits"]),
        )
        for model, t in statement["by_model"].items()
    ]
    rows.append(
        (
            "total",
            str(statement["requests"]),
            str(statement["prompt_tokens"]),
            str(statement["cached_prompt_tokens"]),
            str(statement["output_tokens"]),
            statement["cost_usd"],
            str(statement["cache_hits"]),
        )
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        out.write("\n")


def _sink(args: argparse.Namespace) -> RecordSink:
    config = load_config(args.config)
    sink = build_sink(config.usage_records)
    if sink is None:
        raise ConfigError(f"{args.config}: usage_records.sink is none: there are no records")
    return sink


def _records(args: argparse.Namespace) -> int:
    async def run() -> int:
        sink = _sink(args)
        try:
            query = RecordQuery(tenant=args.tenant, since=args.since, until=args.until, limit=PAGE)
            return await write_records(sink, query, sys.stdout, args.format)
        finally:
            await sink.close()

    return _main(run)


def _statement(args: argparse.Namespace) -> int:
    async def run() -> int:
        sink = _sink(args)
        try:
            lines = await sink.statement(args.tenant, args.month)
        finally:
            await sink.close()
        statement = statement_json(args.tenant, args.month, lines)
        if args.format == "json":
            sys.stdout.write(json.dumps(statement, indent=2) + "\n")
        else:
            _statement_text(statement, sys.stdout)
        return 0

    return _main(run)


def _main(run: Callable[[], Any]) -> int:
    try:
        asyncio.run(run())
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (OSError, TimeoutError) as exc:
        print(f"the usage record sink cannot be read: {exc}", file=sys.stderr)
        return 1
    return 0


def add_usage_commands(sub: Any) -> None:
    """`kvgate records` and `kvgate statement` (`kvgate usage` is the admin API's live
    ledger view)."""
    records = sub.add_parser(
        "records", help="usage records, one line per request, oldest first (docs/usage-records.md)"
    )
    records.add_argument("--config", required=True, help="the kvgate config naming the sink")
    records.add_argument("--tenant")
    records.add_argument("--since", type=parse_time, help="ISO 8601, inclusive (UTC default)")
    records.add_argument("--until", type=parse_time, help="ISO 8601, exclusive (UTC default)")
    records.add_argument("--format", choices=("csv", "jsonl"), default="jsonl")
    records.set_defaults(func=_records)

    statement = sub.add_parser(
        "statement", help="a tenant's month from its usage records, summed as the ledger sums it"
    )
    statement.add_argument("--config", required=True, help="the kvgate config naming the sink")
    statement.add_argument("--tenant", required=True)
    statement.add_argument("--month", required=True, type=parse_month, help="YYYY-MM (UTC)")
    statement.add_argument("--format", choices=("text", "json"), default="text")
    statement.set_defaults(func=_statement)
