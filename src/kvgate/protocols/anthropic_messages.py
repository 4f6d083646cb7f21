"""Anthropic's Messages API (``POST /v1/messages``), as vLLM 0.34 serves it.

vLLM converts a Messages body into a chat completion request and runs its chat path, so
the canonical request is that converted chat request (``kvgate.anthropic.requests``) and
its prompt is counted as any chat prompt. The client's own body is forwarded (rewritten
only for a budget fallback's model or a clamp's ``max_tokens``). Anthropic streams always
carry their usage (``message_start``, ``message_delta``), so nothing is injected and
nothing stripped; the meter reads Anthropic's JSON ``message`` or its named SSE events.
Refusals are in Anthropic's shape with ``anthropic-ratelimit-*`` headers.

The answer layer: an Idempotency-Key is honoured and the exact cache applies, both keyed
by the client's own body (not the converted chat request), and an answer is kept only when
it is complete by the Messages grammar (``kvgate.anthropic.completeness``: a ``message``, or
``message_start`` ... ``message_stop``, with a finished ``stop_reason``). The semantic cache
does not apply: its rules (a plain-text last user turn, no tools, the rest as context) are
written in chat's grammar, and Anthropic's differs where they matter (tool use and results,
images and documents are content blocks, ``system`` is a field), docs/caching.md.
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.anthropic import (
    COUNT_TOKENS_PATH,
    ERRORS,
    MESSAGES_PATH,
    AnthropicError,
    AnthropicErrors,
    MessagesRequest,
    completeness,
    parse_count_tokens_request,
    parse_messages_request,
    rewrite_messages_body,
)
from kvgate.anthropic.meter import MessagesMeter
from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError, PromptCountApi
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ParsedRequest
from kvgate.openai.completeness import AnswerDefect


class AnthropicMessages(ApiProtocol):
    answer_sources = frozenset({SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE})

    def __init__(
        self,
        name: str = "anthropic_messages",
        path: str = MESSAGES_PATH,
        errors: AnthropicErrors = ERRORS,
    ) -> None:
        super().__init__(name, path, errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return parse_messages_request(body)
        except AnthropicError as error:
            raise ClientError(error) from None

    def wants_usage_report(self, request: ParsedRequest) -> bool:
        # message_start and message_delta always carry the usage.
        return False

    def forward_body(self, ticket: Ticket) -> bytes | None:
        rewrite = ticket.body_rewrite
        if not rewrite.needed:
            return None
        request = ticket.request
        # Only a MessagesRequest reaches a ticket of this API (parse made it).
        assert isinstance(request, MessagesRequest)
        return rewrite_messages_body(
            request.wire_body, model=rewrite.model, max_tokens=rewrite.max_new_tokens
        )

    def meter(self, ticket: Ticket) -> AnswerMeter:
        return MessagesMeter(stream_requested=ticket.request.stream)

    def answer_defect(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None:
        return completeness.answer_defect(
            stream=stream, status=status, content_type=content_type, body=body
        )

    def client_body(self, request: ParsedRequest) -> dict[str, Any]:
        # The canonical request is the converted chat request; the answer is the Messages
        # body's, and every field of it may shape the answer.
        assert isinstance(request, MessagesRequest)
        return request.wire_body


class AnthropicCountTokens(PromptCountApi):
    """``POST /v1/messages/count_tokens``: answered by kvgate from its exact count of the
    prompt vLLM would render for the same Messages body, in vLLM's shape."""

    def __init__(
        self,
        name: str = "anthropic_count_tokens",
        path: str = COUNT_TOKENS_PATH,
        errors: AnthropicErrors = ERRORS,
    ) -> None:
        super().__init__(name, path, errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return parse_count_tokens_request(body)
        except AnthropicError as error:
            raise ClientError(error) from None

    def answer(self, prompt_tokens: int) -> bytes:
        # vLLM 0.34 adds context_management with the same count (nothing is trimmed).
        return json.dumps(
            {
                "input_tokens": prompt_tokens,
                "context_management": {"original_input_tokens": prompt_tokens},
            },
            separators=(",", ":"),
        ).encode()
