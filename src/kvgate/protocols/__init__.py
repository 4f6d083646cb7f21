"""The APIs kvgate meters, one ``ApiProtocol`` per path (see ``kvgate.lifecycle.protocol``).

Adding an API: a module here with its ``ApiProtocol`` (parse to the canonical request,
the forwarded body, the answer's meter, its ``ErrorVocabulary``), one entry in
``METERED_APIS``, and tests of each part without gRPC. An endpoint kvgate answers itself
with a prompt's count is a ``PromptCountApi`` in ``PROMPT_COUNT_APIS``.
"""

from __future__ import annotations

from kvgate.anthropic import AnthropicErrors
from kvgate.lifecycle.protocol import ApiProtocol, PromptCountApi
from kvgate.openai import CHAT_PATH, COMPLETIONS_PATH
from kvgate.openai import errors as openai_errors
from kvgate.protocols.anthropic_messages import AnthropicCountTokens, AnthropicMessages
from kvgate.protocols.openai_generation import OpenAIGeneration
from kvgate.protocols.openai_responses import OpenAIResponses

CHAT_COMPLETIONS = OpenAIGeneration("chat_completions", CHAT_PATH)
COMPLETIONS = OpenAIGeneration("completions", COMPLETIONS_PATH)
# Anthropic's Messages API, as vLLM serves it (converted into a chat request). Without its
# anthropic-ratelimit-* headers for now: the Envoy configurations' ext_proc mutation_rules
# (envoy/*.yaml, deploy/) do not allow those names yet, and Envoy would fail an answer that
# sets them (503) and drop every header of a refusal that does (retry-after too).
_ANTHROPIC_ERRORS = AnthropicErrors(rate_limit_headers=False)
ANTHROPIC_MESSAGES = AnthropicMessages(errors=_ANTHROPIC_ERRORS)
# Anthropic's messages.count_tokens, answered by kvgate from its own count.
ANTHROPIC_COUNT_TOKENS = AnthropicCountTokens(errors=_ANTHROPIC_ERRORS)
# OpenAI's Responses API, as vLLM serves it for chat-template models (rendered as a chat
# request); stateful requests are refused.
OPENAI_RESPONSES = OpenAIResponses()

# The metered APIs by request path (query string aside).
METERED_APIS: dict[str, ApiProtocol] = {
    api.path: api for api in (CHAT_COMPLETIONS, COMPLETIONS, ANTHROPIC_MESSAGES, OPENAI_RESPONSES)
}

# The endpoints kvgate answers itself with a prompt's exact count, by request path.
PROMPT_COUNT_APIS: dict[str, PromptCountApi] = {api.path: api for api in (ANTHROPIC_COUNT_TOKENS,)}

# The shape of kvgate's answers on a path no metered API serves (/v1/models, unknown
# paths, the usage report): OpenAI's, as every client of an OpenAI-compatible server reads.
DEFAULT_ERRORS = openai_errors

__all__ = [
    "ANTHROPIC_COUNT_TOKENS",
    "ANTHROPIC_MESSAGES",
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "DEFAULT_ERRORS",
    "METERED_APIS",
    "OPENAI_RESPONSES",
    "PROMPT_COUNT_APIS",
]
