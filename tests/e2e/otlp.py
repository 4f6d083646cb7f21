"""An OTLP/gRPC trace collector, in the test process, for a kvgate process to export its
spans to."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector: keeps every span with its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], trace_pb2.Span]] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        value: common_pb2.AnyValue = item.value
        out[item.key] = getattr(value, value.WhichOneof("value") or "string_value")
    return out
