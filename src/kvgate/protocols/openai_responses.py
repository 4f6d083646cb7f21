"""OpenAI's Responses API (``POST /v1/responses``), as vLLM 0.34 serves it.

vLLM renders a Responses body for a chat-template model as a chat request (its input
items as chat messages, its function and custom tools as chat tools, its reasoning effort
as the template's), so the canonical request is that converted chat request
(``kvgate.responses_api.requests``) and its prompt is counted as any chat prompt; on a
gpt-oss model vLLM renders the body through its own harmony path, whose conversation the
messages carry (``kvgate.responses_api.harmony``). The
client's own body is forwarded, rewritten only for a budget fallback's model or the
reserved ``max_output_tokens`` (a clamp's, or the cap kvgate reserved for a body without
one). Responses streams always end with the response and its usage
(``response.completed``/``incomplete``/``failed``), so nothing is injected and nothing
stripped; the meter reads the ``response`` body or the named SSE events. Refusals are
OpenAI's (``kvgate.openai.errors``), with x-ratelimit-* headers.

Stateful requests (``previous_response_id``, ``conversation``, ``background``) are
refused: the engine's prompt would include a stored conversation kvgate never counted.

The answer layer: an Idempotency-Key is honoured and the exact cache applies, both keyed
by the client's own body (the converted chat request drops fields the response echoes or
the engine reads: ``temperature``, ``metadata``, ``text``...), and an answer is kept only
when it is complete by the Responses grammar (``kvgate.responses_api.completeness``: a
``response``, or ``response.created`` ... ``response.completed``, completed or incomplete
by its own ``max_output_tokens``). The semantic cache does not apply: its rules are
written in chat's grammar, and a Responses body's differs where they matter (``input``
items of many types, ``instructions``, built-in tools, ``enable_response_messages`` echoing
the prompt in the answer), docs/caching.md.
"""

from __future__ import annotations

from typing import Any

from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ApiError, ParsedRequest
from kvgate.openai import errors as openai_errors
from kvgate.openai.completeness import AnswerDefect
from kvgate.responses_api import (
    RESPONSES_PATH,
    ResponsesMeter,
    ResponsesRequest,
    completeness,
    parse_responses_request,
    rewrite_responses_body,
    with_harmony_prompt,
)


class OpenAIResponses(ApiProtocol):
    answer_sources = frozenset({SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE})

    def __init__(self, name: str = "openai_responses", path: str = RESPONSES_PATH) -> None:
        super().__init__(name, path, openai_errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            # Its messages carry the harmony conversation a gpt-oss model renders instead.
            return with_harmony_prompt(parse_responses_request(body))
        except ApiError as error:
            raise ClientError(error) from None

    def wants_usage_report(self, request: ParsedRequest) -> bool:
        # A Responses stream's last event always carries the usage.
        return False

    def forward_body(self, ticket: Ticket) -> bytes | None:
        rewrite = ticket.body_rewrite
        if not rewrite.needed:
            return None
        request = ticket.request
        # Only a ResponsesRequest reaches a ticket of this API (parse made it).
        assert isinstance(request, ResponsesRequest)
        return rewrite_responses_body(
            request.wire_body, model=rewrite.model, max_output_tokens=rewrite.max_new_tokens
        )

    def meter(self, ticket: Ticket) -> AnswerMeter:
        return ResponsesMeter(stream_requested=ticket.request.stream)

    def answer_defect(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None:
        return completeness.answer_defect(
            stream=stream, status=status, content_type=content_type, body=body
        )

    def client_body(self, request: ParsedRequest) -> dict[str, Any]:
        # The canonical request is the converted chat request; the answer is the Responses
        # body's (which echoes much of it), and every field of it may shape the answer.
        assert isinstance(request, ResponsesRequest)
        return request.wire_body
