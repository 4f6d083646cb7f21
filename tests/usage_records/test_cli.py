"""`kvgate records` and `kvgate statement` on a real SQLite sink, as an operator runs them."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import yaml

from kvgate.usage_records import UsageRecord
from kvgate.usage_records.sqlite_sink import SqliteSink
from testbed.usage_records_rig import make_record
from tests.session.conftest import make_config


def _kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=60
    )


async def test_export_and_statement(tmp_path: Path) -> None:
    db = tmp_path / "records.sqlite3"
    config = make_config()
    config["usage_records"] = {"sink": "sqlite", "sqlite_path": str(db)}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    formula = UsageRecord(
        **{
            **{name: getattr(make_record(7), name) for name in UsageRecord.__dataclass_fields__},
            "request_id": '=HYPERLINK("http://evil")',
        }
    )
    sink = SqliteSink(db)
    await sink.insert([make_record(n) for n in range(1, 7)] + [formula])
    await sink.close()

    done = _kvgate("records", "--config", str(path), "--format", "csv", "--tenant", "acme")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [row["record_id"] for row in rows] == [f"rec-{n:06d}" for n in range(1, 8)]
    assert rows[-1]["request_id"] == '\'=HYPERLINK("http://evil")'
    assert rows[0]["cost_usd"] == "0.00012345679"  # 123456790 pico-dollars, exact

    since = make_record(4).occurred_at_utc.isoformat()
    until = make_record(6).occurred_at_utc.replace(tzinfo=None).isoformat()  # UTC implied
    done = _kvgate("records", "--config", str(path), "--since", since, "--until", until)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["record_id"] for line in lines] == ["rec-000004", "rec-000005"]

    done = _kvgate(
        "statement",
        "--config",
        str(path),
        "--tenant",
        "acme",
        "--month",
        "2026-12",
        "--format",
        "json",
    )
    statement = json.loads(done.stdout)
    booked = [make_record(n) for n in range(1, 8) if make_record(n).booked_request]
    assert statement["requests"] == len(booked)
    assert statement["output_tokens"] == sum(r.output_tokens for r in booked)
    text = _kvgate("statement", "--config", str(path), "--tenant", "acme", "--month", "2026-12")
    assert text.returncode == 0 and "total" in text.stdout

    for bad in (["--month", "2026-13"], ["--month", "26-1"]):
        done = _kvgate("statement", "--config", str(path), "--tenant", "acme", *bad)
        assert done.returncode == 2 and "YYYY-MM" in done.stderr
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump(make_config()))
    done = _kvgate("records", "--config", str(off))
    assert done.returncode == 2 and "usage_records.sink is none" in done.stderr
