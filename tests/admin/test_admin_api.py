"""The admin gRPC API: generated code is fresh, reflection works, the CLI talks to it."""

from __future__ import annotations

import asyncio
import filecmp
import json
import subprocess
import sys
from pathlib import Path

import grpc
import yaml
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.app import KvgateServer
from kvgate.config import load_config
from kvgate.lifecycle.usage_report import ledger_periods
from tests.session.conftest import (
    SessionRig,
    body_msg,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
)

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """The committed stubs are exactly what protoc makes from protos/ today."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "protos/kvgate/admin/v1/admin.proto"),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = tmp_path / "kvgate/admin/v1" / name
        committed = ROOT / "src/kvgate/admin/v1" / name
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"{committed} is stale: run `make protos`"
        )


async def test_admin_api_usage_backends_reload_and_reflection(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    config = make_config()
    config["models"][0]["pricing"] = {"input_per_million": "1", "output_per_million": "2"}
    config["tenants"][0]["budget"] = {"daily_usd": "5"}
    path.write_text(yaml.safe_dump(config))
    server = KvgateServer(load_config(path), path)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    admin = grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}")
    try:
        rig = SessionRig(server, channel)
        stream = rig.stream()
        await stream.exchange(headers_msg())
        chat = {
            "model": "qwen2.5-demo",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10,
        }
        await stream.exchange(body_msg(chat))
        stub = admin_pb2_grpc.AdminStub(admin)
        backends = await stub.ListBackends(admin_pb2.ListBackendsRequest())
        [backend] = backends.backends
        assert (backend.name, backend.requests_in_flight) == ("gpu-a", 1)
        assert backend.kv_tokens_in_flight > 0

        await stream.exchange(response_headers_msg(content_type="application/json"))
        body = json.dumps({"usage": {"prompt_tokens": 500_000, "completion_tokens": 250_000}})
        await stream.exchange(response_body_msg(body.encode(), end_of_stream=True))
        await server.services.drain(5)

        usage = await stub.GetTenantUsage(admin_pb2.GetTenantUsageRequest(tenant="acme"))
        assert usage.today.prompt_tokens == 500_000
        assert usage.today.cost_usd == "1"  # $0.50 + $0.50
        assert usage.today.remaining_usd == "4"
        assert usage.today.by_model[0].model == "qwen2.5-demo"
        assert usage.today.cache_hits == 0
        # A cache hit booked in the ledger shows in both periods and per model.
        await server.store.record_cache_hit(
            "acme", "qwen2.5-demo", 42, ledger_periods(server.clock)
        )
        usage = await stub.GetTenantUsage(admin_pb2.GetTenantUsageRequest(tenant="acme"))
        for period in (usage.today, usage.this_month):
            assert (period.cache_hits, period.cache_saved_tokens) == (1, 42)
            assert (period.by_model[0].cache_hits, period.by_model[0].cache_saved_tokens) == (1, 42)
        try:
            await stub.GetTenantUsage(admin_pb2.GetTenantUsageRequest(tenant="nobody"))
            raise AssertionError("unknown tenant must be NOT_FOUND")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND

        reloaded = await stub.Reload(admin_pb2.ReloadRequest())
        assert reloaded.applied and reloaded.generation == 2

        # Server reflection: what grpcurl uses to list and describe services.
        # The reflection client is synchronous: run it off this loop, which serves it.
        def list_services() -> list[str]:
            with grpc.insecure_channel(f"127.0.0.1:{server.admin_port}") as sync_channel:
                return list(ProtoReflectionDescriptorDatabase(sync_channel).get_services())

        assert "kvgate.admin.v1.Admin" in await asyncio.to_thread(list_services)

        # The CLI client (a separate process, as an operator runs it).
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvgate.cli",
            "usage",
            "--admin",
            f"127.0.0.1:{server.admin_port}",
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
        assert process.returncode == 0, stderr.decode()
        [report] = json.loads(stdout)
        assert report["tenant"] == "acme"
        assert report["today"]["outputTokens"] == "250000"
    finally:
        await admin.close()
        await channel.close()
        await server.stop()
