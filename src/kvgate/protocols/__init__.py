"""The APIs kvgate meters, one ``ApiProtocol`` per path (see ``kvgate.lifecycle.protocol``).

Adding an API: a module here with its ``ApiProtocol`` (parse to the canonical request,
the forwarded body, the answer's meter, its ``ErrorVocabulary``), one entry in
``METERED_APIS``, and tests of each part without gRPC. An endpoint kvgate answers itself
with a prompt's count is a ``PromptCountApi`` in ``PROMPT_COUNT_APIS``.
"""

from __future__ import annotations

from kvgate.anthropic import errors as anthropic_errors
from kvgate.lifecycle.protocol import ApiProtocol, PromptCountApi, UnmeteredApi
from kvgate.openai import CHAT_PATH, COMPLETIONS_PATH
from kvgate.openai import errors as openai_errors
from kvgate.pooling import (
    EMBEDDINGS_PATH,
    POOLING_PATH,
    RERANK_PATHS,
    SCORE_PATHS,
    parse_scoring_request,
)
from kvgate.protocols.anthropic_messages import AnthropicCountTokens, AnthropicMessages
from kvgate.protocols.openai_generation import OpenAIGeneration
from kvgate.protocols.openai_pooling import OpenAIPooling
from kvgate.protocols.openai_responses import OpenAIResponses
from kvgate.protocols.vllm_tokenization import DETOKENIZE, TOKENIZE

CHAT_COMPLETIONS = OpenAIGeneration("chat_completions", CHAT_PATH)
COMPLETIONS = OpenAIGeneration("completions", COMPLETIONS_PATH)
# Anthropic's Messages API, as vLLM serves it (converted into a chat request), with its
# anthropic-ratelimit-* headers: every shipped Envoy configuration's ext_proc mutation_rules
# allow them (envoy/*.yaml, deploy/; Envoy fails an answer that sets a header outside them).
ANTHROPIC_MESSAGES = AnthropicMessages(errors=anthropic_errors.ERRORS)
# Anthropic's messages.count_tokens, answered by kvgate from its own count.
ANTHROPIC_COUNT_TOKENS = AnthropicCountTokens(errors=anthropic_errors.ERRORS)
# OpenAI's Responses API, as vLLM serves it for chat-template models (rendered as a chat
# request); stateful requests are refused.
OPENAI_RESPONSES = OpenAIResponses()
# vLLM's pooling APIs: OpenAI's embeddings and vLLM's /pooling (prompts encoded, nothing
# generated: reserved and charged for their input tokens only).
EMBEDDINGS = OpenAIPooling("embeddings", EMBEDDINGS_PATH)
POOLING = OpenAIPooling("pooling", POOLING_PATH)
# vLLM's rerank and score (query-document pairs through the model's score template).
RERANK = tuple(OpenAIPooling("rerank", path, parse_scoring_request) for path in RERANK_PATHS)
SCORE = tuple(OpenAIPooling("score", path, parse_scoring_request) for path in SCORE_PATHS)

# The metered APIs by request path (query string aside).
METERED_APIS: dict[str, ApiProtocol] = {
    api.path: api
    for api in (
        CHAT_COMPLETIONS,
        COMPLETIONS,
        ANTHROPIC_MESSAGES,
        OPENAI_RESPONSES,
        EMBEDDINGS,
        POOLING,
        *RERANK,
        *SCORE,
    )
}

# The endpoints kvgate answers itself with a prompt's exact count, by request path.
PROMPT_COUNT_APIS: dict[str, PromptCountApi] = {api.path: api for api in (ANTHROPIC_COUNT_TOKENS,)}

# The endpoints that generate nothing and hold no KV (vLLM's tokenizer endpoints): forwarded
# after the tenant's key and RPM slot, with no reservation and no charge.
UNMETERED_APIS: dict[str, UnmeteredApi] = {api.path: api for api in (TOKENIZE, DETOKENIZE)}

# The shape of kvgate's answers on a path no metered API serves (/v1/models, unknown
# paths, the usage report): OpenAI's, as every client of an OpenAI-compatible server reads.
DEFAULT_ERRORS = openai_errors

__all__ = [
    "ANTHROPIC_COUNT_TOKENS",
    "ANTHROPIC_MESSAGES",
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "DEFAULT_ERRORS",
    "EMBEDDINGS",
    "METERED_APIS",
    "OPENAI_RESPONSES",
    "POOLING",
    "PROMPT_COUNT_APIS",
    "RERANK",
    "SCORE",
    "UNMETERED_APIS",
]
