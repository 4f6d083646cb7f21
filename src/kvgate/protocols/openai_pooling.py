"""vLLM's pooling APIs as kvgate meters them: OpenAI's embeddings (``POST /v1/embeddings``),
vLLM's ``POST /pooling``, and vLLM's rerank (``/rerank``, ``/v1/rerank``, ``/v2/rerank``)
and score (``/score``, ``/v1/score``) for a model served with a score template.

The canonical request is a ``pooling`` request (``kvgate.pooling``): its inputs (or its
query-document pairs, rendered with the model's score template) are the prompts the
engine encodes, counted as completions prompts and truncated as the engine
truncates them; it generates nothing, so admission reserves the prompt's KV, tokens and
money with no output and writes no cap into the body. The client's body is forwarded as
sent (only a budget fallback's ``model`` is rewritten). The answer is one JSON body
(``data``, or a rerank's ``results``) whose ``usage.prompt_tokens`` settles the bill
(``PoolingMeter``). Refusals are OpenAI's, with x-ratelimit-* headers.

The answer layer: an Idempotency-Key is honoured and the exact cache applies (keyed by the
client's body and the path); an answer is kept only when complete by its grammar (a 200
JSON body with its usage). The semantic cache never applies: its rules are chat's.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from kvgate.lifecycle.answer_sources import SourceName
from kvgate.lifecycle.protocol import AnswerMeter, ApiProtocol, ClientError
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ApiError, ParsedRequest, rewrite_body
from kvgate.openai import errors as openai_errors
from kvgate.openai.completeness import AnswerDefect
from kvgate.openai.responses import usage_from_mapping
from kvgate.pooling import PoolingMeter, parse_pooling_request

# Parses one pooling API's body into the canonical request (ApiError for a refusal).
Parser = Callable[[str, bytes], ParsedRequest]


class OpenAIPooling(ApiProtocol):
    answer_sources = frozenset({SourceName.IDEMPOTENCY, SourceName.EXACT_CACHE})

    def __init__(self, name: str, path: str, parser: Parser = parse_pooling_request) -> None:
        super().__init__(name, path, openai_errors)
        self._parser = parser

    def parse(self, body: bytes) -> ParsedRequest:
        try:
            return self._parser(self.path, body)
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
        # vLLM's answer: {"data": [...], "usage": {...}}; a rerank's {"results": [...], ...}.
        items = answer.get("results") if "results" in answer else answer.get("data")
        if type(items) is not list or usage_from_mapping(answer.get("usage")) is None:
            return AnswerDefect.MALFORMED
        return None
