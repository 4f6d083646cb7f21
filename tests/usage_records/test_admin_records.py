"""The admin API's ListUsageRecords: kvgate in-process with a real SQLite sink, requests
played through its ext_proc stream, their records read back page by page."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import load_config
from tests.session.conftest import (
    SessionRig,
    body_msg,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
)


async def _serve(tmp_path: Path, records: bool) -> KvgateServer:
    config: dict[str, Any] = make_config()
    config["models"][0]["pricing"] = {"input_per_million": "1", "output_per_million": "3"}
    if records:
        config["usage_records"] = {
            "sink": "sqlite",
            "sqlite_path": str(tmp_path / "records.sqlite3"),
            "spool_dir": str(tmp_path / "spool"),
            "flush_interval_s": 0.05,
        }
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    server = KvgateServer(load_config(path), path)
    await server.start()
    return server


async def _request(rig: SessionRig, n: int) -> None:
    stream = rig.stream()
    await stream.exchange(headers_msg(extra={"x-request-id": f"req-{n}"}))
    chat = {
        "model": "qwen2.5-demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
    }
    await stream.exchange(body_msg(chat))
    await stream.exchange(response_headers_msg(content_type="application/json"))
    usage = {"usage": {"prompt_tokens": 100 + n, "completion_tokens": n}}
    await stream.exchange(response_body_msg(json.dumps(usage).encode(), end_of_stream=True))


async def test_records_are_listed_page_by_page(tmp_path: Path) -> None:
    server = await _serve(tmp_path, records=True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    admin = grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}")
    try:
        rig = SessionRig(server, channel)
        for n in range(1, 6):
            await _request(rig, n)
        await server.services.drain(5)
        writer = server.usage_records
        assert writer is not None
        async with asyncio.timeout(10):
            while writer.counts.inserted < 5:  # noqa: ASYNC110 - polling a counter
                await asyncio.sleep(0.02)
        stub = admin_pb2_grpc.AdminStub(admin)
        got: list[admin_pb2.UsageRecord] = []
        token = ""
        pages = 0
        while True:
            page = await stub.ListUsageRecords(
                admin_pb2.ListUsageRecordsRequest(tenant="acme", page_size=2, page_token=token)
            )
            got += page.records
            pages += 1
            token = page.next_page_token
            if not token:
                break
        assert pages == 3
        assert sorted(r.request_id for r in got) == [f"req-{n}" for n in range(1, 6)]
        assert len({r.record_id for r in got}) == 5
        first = next(r for r in got if r.request_id == "req-2")
        assert (first.prompt_tokens, first.output_tokens) == (102, 2)
        # 102 x $1/M + 2 x $3/M
        assert first.cost_usd == "0.000108"
        assert first.answer_source == "backend" and first.settle_cause == "completed"
        assert first.status == 200 and first.HasField("decision_ms")
        assert not first.HasField("reasoning_tokens") and not first.HasField("team_id")

        none = await stub.ListUsageRecords(admin_pb2.ListUsageRecordsRequest(tenant="nobody"))
        assert list(none.records) == [] and none.next_page_token == ""
        later = await stub.ListUsageRecords(
            admin_pb2.ListUsageRecordsRequest(since_unix_s=4_000_000_000.0)
        )
        assert list(later.records) == []
        for bad in (
            admin_pb2.ListUsageRecordsRequest(page_token="not-a-token"),
            admin_pb2.ListUsageRecordsRequest(page_token="W1tdLCAiYSJd"),  # [[], "a"]
            admin_pb2.ListUsageRecordsRequest(page_size=5000),
            admin_pb2.ListUsageRecordsRequest(page_size=-1),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListUsageRecords(bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await admin.close()
        await channel.close()
        await server.stop()


async def test_records_off_is_a_failed_precondition(tmp_path: Path) -> None:
    server = await _serve(tmp_path, records=False)
    admin = grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}")
    try:
        stub = admin_pb2_grpc.AdminStub(admin)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListUsageRecords(admin_pb2.ListUsageRecordsRequest())
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await admin.close()
        await server.stop()
