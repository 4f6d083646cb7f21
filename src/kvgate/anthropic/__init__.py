"""Anthropic's Messages API wire format, as vLLM 0.34 serves it on ``/v1/messages``:
request validation and its conversion into the chat request the engine runs
(``requests``), error bodies and ``anthropic-ratelimit-*`` headers (``errors``), and
reading answers for the bill (``answers``, ``meter``). No gRPC, no I/O.
"""

from .answers import MessagesStreamReader, MessageUsage, MessageUsageScanner, message_usage
from .errors import ERRORS, AnthropicError, AnthropicErrors
from .requests import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
    rewrite_messages_body,
)

__all__ = [
    "COUNT_TOKENS_PATH",
    "ERRORS",
    "MESSAGES_PATH",
    "AnthropicError",
    "AnthropicErrors",
    "MessageUsage",
    "MessageUsageScanner",
    "MessagesRequest",
    "MessagesStreamReader",
    "message_usage",
    "parse_count_tokens_request",
    "parse_messages_request",
    "rewrite_messages_body",
]
