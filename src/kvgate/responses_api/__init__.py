"""OpenAI's Responses API wire format, as vLLM 0.34 serves it on ``/v1/responses`` for a
chat-template model: request validation and its conversion into the chat request the
engine renders (``requests``), and for a gpt-oss model the harmony conversation it renders
instead (``harmony``), and reading answers for the bill in bounded memory
(``scan``, ``answers``, ``meter``). Refusals are OpenAI's (``kvgate.openai.errors``). No
gRPC, no I/O.
"""

from .answers import ResponseBodyScanner, ResponsesStreamReader, ResponsesUsage, responses_usage
from .harmony import harmony_prompt, with_harmony_prompt
from .meter import ResponsesMeter
from .requests import (
    RESPONSES_PATH,
    ResponsesRequest,
    parse_responses_request,
    rewrite_responses_body,
)

__all__ = [
    "RESPONSES_PATH",
    "ResponseBodyScanner",
    "ResponsesMeter",
    "ResponsesRequest",
    "ResponsesStreamReader",
    "ResponsesUsage",
    "harmony_prompt",
    "parse_responses_request",
    "responses_usage",
    "rewrite_responses_body",
    "with_harmony_prompt",
]
