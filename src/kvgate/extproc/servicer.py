"""The gRPC ExternalProcessor service: one StreamSession per ext_proc stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate.extproc.route_settings import RouteSettings, RouteSettingsError, parse_route_settings
from kvgate.extproc.services import GatewayServices
from kvgate.extproc.session import StreamSession

log = logging.getLogger("kvgate.extproc")


# xds-protos ships no type information: its servicer base class is Any to the type checker.
class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, services: GatewayServices) -> None:
        self._services = services

    async def Process(  # the gRPC method name
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        session = StreamSession(self._services, route=_route_settings(context))
        try:
            async for message in request_iterator:
                if session.wants_interim(message):
                    # The decision may wait in a pool's queue: Envoy first gets an
                    # extension of its message deadline, then the reply.
                    async for reply in session.handle_with_interim(message):
                        yield reply
                    continue
                reply = await session.handle(message)
                if reply is not None:
                    yield reply
        except asyncio.CancelledError:
            # Envoy reset the stream (client gone, timeout). Settled below.
            raise
        finally:
            # Either the iterator ended or the stream was cancelled: both are "stream over".
            session.close(shutting_down=self._services.shutting_down)


def _route_settings(
    context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
) -> RouteSettings | RouteSettingsError:
    """The per-route settings Envoy sent as the stream's gRPC metadata (or why they are bad:
    the session answers that on the request's first message)."""
    try:
        return parse_route_settings(context.invocation_metadata() or ())
    except RouteSettingsError as error:
        return error
