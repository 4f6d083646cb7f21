"""Builders for ext_proc replies. The only module (with the servicer) that knows Envoy's protos.

Facts that bite (see envoy/NOTES.md): header values go in `raw_value`; `clear_route_cache`
is honoured only beside a header mutation; a mutated body needs content-length fixed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvgate.openai import errors as api_errors

METADATA_NAMESPACE = "kvgate"

_Mode = processing_mode_pb2.ProcessingMode


def header_map_to_dict(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-cased header names to values; the first value of a repeated header wins."""
    headers: dict[str, str] = {}
    for header in header_map.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        headers.setdefault(header.key.lower(), value)
    return headers


def header_mutation(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode("utf-8")),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for key, value in (set_headers or {}).items()
        ],
        remove_headers=list(remove),
    )


def metadata(fields: Mapping[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update({METADATA_NAMESPACE: dict(fields)})
    return struct


def continue_request_headers(
    set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (),
    *,
    skip_rest: bool = False,
) -> pb.ProcessingResponse:
    """CONTINUE after request headers; `skip_rest` stops the body and response phases
    for this stream (requests kvgate only authenticates) and re-matches the route on the
    headers just set (Envoy routes pass-through requests only on kvgate's header)."""
    response = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=header_mutation(set_headers, remove), clear_route_cache=skip_rest
            )
        )
    )
    if skip_rest:
        # Body modes left unset would become NONE anyway; set every phase explicitly.
        response.mode_override.CopyFrom(
            _Mode(
                request_body_mode=_Mode.NONE,
                response_header_mode=_Mode.SKIP,
                response_body_mode=_Mode.NONE,
                request_trailer_mode=_Mode.SKIP,
                response_trailer_mode=_Mode.SKIP,
            )
        )
    return response


def continue_request_body(
    set_headers: Mapping[str, str],
    *,
    new_body: bytes | None,
    dynamic_metadata: Mapping[str, Any] | None = None,
) -> pb.ProcessingResponse:
    """CONTINUE after the buffered request body, re-routing on the headers just set."""
    headers = dict(set_headers)
    common = pb.CommonResponse(clear_route_cache=True)
    if new_body is not None:
        common.body_mutation.CopyFrom(pb.BodyMutation(body=new_body))
        headers["content-length"] = str(len(new_body))
    common.header_mutation.CopyFrom(header_mutation(headers))
    response = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    if dynamic_metadata:
        response.dynamic_metadata.CopyFrom(metadata(dynamic_metadata))
    return response


# The rest of a stream once the answer's body is wanted whole: one message instead of one
# per chunk. mode_override replaces every field for both directions, so all are set.
_BUFFERED_ANSWER_MODE = _Mode(
    request_header_mode=_Mode.SEND,
    request_body_mode=_Mode.BUFFERED,
    request_trailer_mode=_Mode.SKIP,
    response_header_mode=_Mode.SEND,
    response_body_mode=_Mode.BUFFERED,
    response_trailer_mode=_Mode.SKIP,
)


def continue_response_headers(
    set_headers: Mapping[str, str] | None = None, *, buffer_body: bool = False
) -> pb.ProcessingResponse:
    """CONTINUE after response headers; `buffer_body` asks Envoy for the whole answer body
    in one message (Envoy honours it in the reply to headers, with allow_mode_override)."""
    common = pb.CommonResponse()
    if set_headers:
        common.header_mutation.CopyFrom(header_mutation(set_headers))
    response = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))
    if buffer_body:
        response.mode_override.CopyFrom(_BUFFERED_ANSWER_MODE)
    return response


# The reply to most response chunks: built once and never mutated (grpc only serializes it).
_PLAIN_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(
    response_body=pb.BodyResponse(response=pb.CommonResponse())
)


def continue_response_body(
    replacement: bytes | None = None,
    dynamic_metadata: Mapping[str, Any] | None = None,
) -> pb.ProcessingResponse:
    """CONTINUE a response chunk; `replacement` rewrites it (b"" drops it)."""
    if replacement is None and not dynamic_metadata:
        return _PLAIN_CONTINUE_RESPONSE_BODY
    common = pb.CommonResponse()
    if replacement is not None:
        if replacement:
            common.body_mutation.CopyFrom(pb.BodyMutation(body=replacement))
        else:
            common.body_mutation.CopyFrom(pb.BodyMutation(clear_body=True))
    response = pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
    if dynamic_metadata:
        response.dynamic_metadata.CopyFrom(metadata(dynamic_metadata))
    return response


def immediate_response(
    status: int,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    details: str = "",
    dynamic_metadata: Mapping[str, Any] | None = None,
) -> pb.ProcessingResponse:
    all_headers = {"content-type": api_errors.CONTENT_TYPE}
    all_headers.update(headers or {})
    response = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation(all_headers),
            body=body,
            details=details,
        )
    )
    if dynamic_metadata:
        response.dynamic_metadata.CopyFrom(metadata(dynamic_metadata))
    return response


def override_message_timeout(seconds: float) -> pb.ProcessingResponse:
    """A reply that only moves Envoy's deadline for the message in hand (Envoy honours it
    once per message, up to the filter's max_message_timeout)."""
    reply = pb.ProcessingResponse()
    reply.override_message_timeout.FromMilliseconds(round(seconds * 1000))
    return reply
