"""Session tests: scripted ext_proc message sequences through a real grpc.aio channel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate.app import KvgateServer
from kvgate.config import hash_api_key, parse_config
from testbed.demo_model import demo_model_dir

API_KEY = "sk-test-session"


def make_config(**backend: Any) -> dict[str, Any]:
    return {
        "server": {
            "grpc_listen": "127.0.0.1:0",
            "http_listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
        },
        "tenants": [{"name": "acme", "api_key_sha256": hash_api_key(API_KEY)}],
        "models": [
            {
                "name": "qwen2.5-demo",
                "tokenizer": str(demo_model_dir()),
                "max_context": 32768,
                "default_max_new_tokens": 256,
                "backend": "gpu-a",
            }
        ],
        "backends": [
            {
                "name": "gpu-a",
                "kv_budget_tokens": backend.get("kv_budget_tokens", 48_000),
                "kv_block_size": 16,
                "max_concurrent_requests": backend.get("max_concurrent_requests", 64),
            }
        ],
    }


def headers_msg(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    *,
    key: str | None = API_KEY,
    extra: dict[str, str] | None = None,
    end_of_stream: bool = False,
) -> pb.ProcessingRequest:
    values = {":path": path, ":method": method, "x-request-id": "req-1", **(extra or {})}
    if key is not None:
        values["authorization"] = f"Bearer {key}"
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=end_of_stream,
        )
    )


def body_msg(body: bytes | dict[str, Any], end_of_stream: bool = True) -> pb.ProcessingRequest:
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response_headers_msg(
    status: int = 200,
    content_type: str = "text/event-stream",
    extra: dict[str, str] | None = None,
) -> pb.ProcessingRequest:
    values = {":status": str(status), "content-type": content_type, **(extra or {})}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )
    )


def response_body_msg(chunk: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def header_values(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


class ScriptedStream:
    """Plays Envoy's side of one ext_proc stream: send a message, read its reply."""

    def __init__(
        self,
        stub: pb_grpc.ExternalProcessorStub,
        metadata: Iterable[tuple[str, str]] | None = None,
    ) -> None:
        """`metadata`: gRPC initial metadata, as a route's ext_proc override sends it."""
        self._outbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests(), metadata=tuple(metadata or ()))

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def exchange(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        await self._outbox.put(message)
        return await asyncio.wait_for(self.call.read(), timeout=10)

    async def half_close(self) -> None:
        """The request iterator ends (one way Envoy's stream end shows up)."""
        await self._outbox.put(None)

    def reset(self) -> None:
        """RST_STREAM(CANCEL): how Envoy tells a client went away."""
        self.call.cancel()


class SessionRig:
    def __init__(self, server: KvgateServer, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    def stream(self, metadata: Iterable[tuple[str, str]] | None = None) -> ScriptedStream:
        return ScriptedStream(self.stub, metadata)

    async def in_flight(self) -> tuple[int, int]:
        await self.server.services.drain(timeout_s=5)
        [status] = await self.server.store.backend_status() or [None]
        if status is None:
            return 0, 0
        return status.kv_tokens_in_flight, status.requests_in_flight

    async def in_flight_after_reset(self) -> tuple[int, int]:
        """In-flight state once the server has seen a client-side cancel.

        A cancel travels as RST_STREAM and reaches the server's handler asynchronously, so
        give it a bounded moment; the state is read (and asserted by the caller) either way.
        """
        for _ in range(100):
            if (await self.in_flight())[1] == 0:
                break
            await asyncio.sleep(0.02)
        return await self.in_flight()

    async def usage(self) -> tuple[int, int, int]:
        await self.server.services.drain(timeout_s=5)
        totals = (await self.server.store.usage_totals()).get(("acme", "qwen2.5-demo"))
        if totals is None:
            return 0, 0, 0
        return totals.requests, totals.prompt_tokens, totals.output_tokens


async def _rig(config: dict[str, Any], **server_options: Any) -> AsyncIterator[SessionRig]:
    server = KvgateServer(parse_config(config), **server_options)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        yield SessionRig(server, channel)
    finally:
        await channel.close()
        await server.stop()


@pytest.fixture
async def rig() -> AsyncIterator[SessionRig]:
    async for value in _rig(make_config()):
        yield value


@pytest.fixture
def rig_factory():
    async def factory(**backend: Any) -> AsyncIterator[SessionRig]:
        async for value in _rig(make_config(**backend)):
            yield value

    return factory


def sse_events(events: Iterable[dict[str, Any] | str]) -> bytes:
    out = b""
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
        out += b"data: " + data.encode() + b"\n\n"
    return out
