"""vLLM's pooling APIs as kvgate meters them: OpenAI's embeddings (``POST /v1/embeddings``)
and vLLM's ``POST /pooling``.

The canonical request is a ``pooling`` request (``kvgate.pooling``): its inputs are the
prompts the engine encodes, counted as completions prompts and truncated as the engine
truncates them; it generates nothing, so admission reserves the prompt's KV, tokens and
money with no output and writes no cap into the body. The client's body is forwarded as
sent (only a budget fallback's ``model`` is rewritten). The answer is one JSON body whose
``usage.prompt_tokens`` settles the bill (``PoolingMeter``). Refusals are OpenAI's, with
x-ratelimit-* headers.

The answer layer: an Idempotency-Key is honoured and the exact cache applies (keyed by the
client's body and the path); an answer is kept only when complete by its grammar (a 200
JSON body with its usage). The semantic cache never applies: its rules are chat's.
"""

from __future__ import annotations

import json

from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ApiError, ParsedRequest, rewrite_body
from kvgate.openai import errors as openai_errors
from kvgate.openai.completeness import AnswerDefect
from kvgate.openai.responses import usage_from_mapping
from kvgate.pooling import PoolingMeter, parse_pooling_request


class OpenAIPooling(ApiProtocol):
    answer_sources = frozenset({SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE})

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path, openai_errors)

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return parse_pooling_request(self.path, body)
        except ApiError as error:
            raise ClientError(error) from None

    def wants_usage_report(self, request: ParsedRequest) -> bool:
        return False  # the JSON answer always carries its usage

    def forward_body(self, ticket: Ticket) -> bytes | None:
        if ticket.new_model is None:
            return None
        return rewrite_body(ticket.request.body, model=ticket.new_model)

    def meter(self, ticket: Ticket) -> AnswerMeter:
        return PoolingMeter()

    def answer_defect(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None:
        if status != 200:
            return AnswerDefect.STATUS
        if not content_type.startswith("application/json"):
            return AnswerDefect.CONTENT_TYPE
        if not body:
            return AnswerDefect.EMPTY
        try:
            answer = json.loads(body)
        except ValueError:
            return AnswerDefect.MALFORMED
        if type(answer) is not dict:
            return AnswerDefect.MALFORMED
        if "error" in answer:
            return AnswerDefect.ERROR
        # vLLM's answer: {"object": "list", "data": [...], "usage": {...}}.
        if type(answer.get("data")) is not list or usage_from_mapping(answer.get("usage")) is None:
            return AnswerDefect.MALFORMED
        return None
