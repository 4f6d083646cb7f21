"""OpenAI's Responses API (``POST /v1/responses``), as vLLM 0.34 serves it.

vLLM renders a Responses body for a chat-template model as a chat request (its input
items as chat messages, its function and custom tools as chat tools, its reasoning effort
as the template's), so the canonical request is that converted chat request
(``kvgate.responses_api.requests``) and its prompt is counted as any chat prompt. The
client's own body is forwarded, rewritten only for a budget fallback's model or the
reserved ``max_output_tokens`` (a clamp's, or the cap kvgate reserved for a body without
one). Responses streams always end with the response and its usage
(``response.completed``/``incomplete``/``failed``), so nothing is injected and nothing
stripped; the meter reads the ``response`` body or the named SSE events. Refusals are
OpenAI's (``kvgate.openai.errors``), with x-ratelimit-* headers.

Stateful requests (``previous_response_id``, ``conversation``, ``background``) are
refused: the engine's prompt would include a stored conversation kvgate never counted.

kvgate's answer layer (Idempotency-Key replays, the exact and semantic caches) judges an
answer complete by the chat/completions rules (``kvgate.openai.completeness``: choices and
finish reasons), which do not read a Responses answer; it does not apply to this API
(``reuses_answers``), and an Idempotency-Key sent with it is ignored.
"""

from __future__ import annotations

from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ApiError, ParsedRequest
from kvgate.openai import errors as openai_errors
from kvgate.responses_api import (
    RESPONSES_PATH,
    ResponsesMeter,
    ResponsesRequest,
    parse_responses_request,
    rewrite_responses_body,
)


class OpenAIResponses(ApiProtocol):
    reuses_answers = False

    def __init__(self, name: str = "openai_responses", path: str = RESPONSES_PATH) -> None:
        super().__init__(name, path, openai_errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return parse_responses_request(body)
        except ApiError as error:
            raise ClientError(error) from None

    def wants_usage_report(self, request: ParsedRequest) -> bool:
        # A Responses stream's last event always carries the usage.
        return False

    def forward_body(self, ticket: Ticket) -> bytes | None:
        new_cap = ticket.max_new_tokens if ticket.body_needs_cap else None
        if not (ticket.new_model or new_cap is not None):
            return None
        request = ticket.request
        # Only a ResponsesRequest reaches a ticket of this API (parse made it).
        assert isinstance(request, ResponsesRequest)
        return rewrite_responses_body(
            request.wire_body, model=ticket.new_model, max_output_tokens=new_cap
        )

    def meter(self, ticket: Ticket) -> AnswerMeter:
        return ResponsesMeter(stream_requested=ticket.request.stream)
