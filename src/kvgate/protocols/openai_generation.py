"""OpenAI's text-generation APIs: chat completions and completions.

Both read the same request grammar (``kvgate.openai.parse_request`` tells them apart by
path), answer with a JSON body or an SSE stream whose last event may carry usage, and
refuse with OpenAI's error body and x-ratelimit-* headers. Every answer source applies;
an answer is complete by ``kvgate.openai.completeness`` (choices and finish reasons).
"""

from __future__ import annotations

from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.meter import ResponseMeter
from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ApiError, ParsedRequest, parse_request, rewrite_body
from kvgate.openai import errors as openai_errors
from kvgate.openai.completeness import AnswerDefect, answer_defect


class OpenAIGeneration(ApiProtocol):
    answer_sources = frozenset(SourceName)  # the semantic cache's rules are this grammar's

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path, openai_errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return parse_request(self.path, body)
        except ApiError as error:
            raise ClientError(error) from None

    def wants_usage_report(self, request: ParsedRequest) -> bool:
        # Exact output counts need the stream's usage event: asked for when the client
        # did not (stream_options.include_usage), and stripped again by the meter.
        return request.stream and not request.include_usage_requested

    def forward_body(self, ticket: Ticket) -> bytes | None:
        rewrite = ticket.body_rewrite
        if not (rewrite.needed or ticket.usage_injected):
            return None
        return rewrite_body(
            ticket.request.body,
            model=rewrite.model,
            max_tokens=rewrite.max_new_tokens,
            force_usage=ticket.usage_injected,
        )

    def meter(self, ticket: Ticket) -> AnswerMeter:
        return ResponseMeter(
            strip_usage_event=ticket.usage_injected, stream_requested=ticket.request.stream
        )

    def answer_defect(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None:
        return answer_defect(stream=stream, status=status, content_type=content_type, body=body)
