"""The OpenAI-compatible wire format: request parsing/rewriting, error bodies,
usage extraction and the streamed-response (SSE) filter.

Pure functions and small classes: no grpc, no asyncio, no I/O.
"""

from .errors import (
    ApiError,
    context_length_exceeded,
    invalid_api_key,
    invalid_request,
    method_not_allowed,
    missing_api_key,
    model_not_found,
    rate_limited,
    service_unavailable,
    unsupported_path,
)
from .requests import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_JSON_DEPTH,
    ParsedRequest,
    RequestKind,
    load_json_object,
    parse_request,
    request_kind,
    rewrite_body,
)
from .responses import JsonUsageScanner, Usage, usage_from_json_body, usage_from_mapping
from .sse import SseStreamFilter

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "MAX_JSON_DEPTH",
    "ApiError",
    "JsonUsageScanner",
    "ParsedRequest",
    "RequestKind",
    "SseStreamFilter",
    "Usage",
    "context_length_exceeded",
    "invalid_api_key",
    "invalid_request",
    "load_json_object",
    "method_not_allowed",
    "missing_api_key",
    "model_not_found",
    "parse_request",
    "rate_limited",
    "request_kind",
    "rewrite_body",
    "service_unavailable",
    "unsupported_path",
    "usage_from_json_body",
    "usage_from_mapping",
]
