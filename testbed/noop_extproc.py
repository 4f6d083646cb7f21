"""A no-op Envoy ext_proc server: the protocol's own cost, with nothing decided.

It replies CONTINUE (an empty CommonResponse) to every message, in the same grpc.aio +
uvloop setup kvgate uses, and serves grpc.health.v1 as SERVING so Envoy's health check
(with `healthy_panic_threshold: 0`) lets traffic through. Envoy runs it with the same
processing modes as kvgate (envoy/envoy.yaml), so the difference between an Envoy with it
and plain Envoy is what any Python ext_proc server costs before it does any work (the
benchmarks' floor), and the difference between kvgate and it is kvgate's own work. Tests use
it as an ext_proc server that lets everything through but never decides.

    python -m testbed.noop_extproc --listen 127.0.0.1:50061

`noop_extproc_argv` is that command line (`testbed.rig.Rig.noop_extproc` starts one).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# Built once: each reply is an immutable message that grpc serializes on send.
_REPLIES: dict[str, pb.ProcessingResponse] = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # as kvgate: a 100k-token request body is one message


def noop_extproc_argv(listen: str) -> list[str]:
    """The command line of a no-op ext_proc server on `listen` (HOST:PORT); run it from the
    repository root (ManagedProcess's default working directory)."""
    return [sys.executable, "-m", "testbed.noop_extproc", "--listen", listen]


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    async def Process(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        del context
        async for message in request_iterator:
            reply = _REPLIES.get(message.WhichOneof("request") or "")
            if reply is not None:
                yield reply


async def serve(listen: str) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT for gRPC")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.listen))
    else:
        uvloop.run(serve(args.listen))


if __name__ == "__main__":
    main()
