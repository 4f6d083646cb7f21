"""The APIs kvgate meters, one ``ApiProtocol`` per path (see ``kvgate.lifecycle.protocol``).

Adding an API: a module here with its ``ApiProtocol`` (parse to the canonical request,
the forwarded body, the answer's meter, its ``ErrorVocabulary``), one entry in
``METERED_APIS``, and tests of each part without gRPC.
"""

from __future__ import annotations

from kvgate.lifecycle.protocol import ApiProtocol
from kvgate.openai import CHAT_PATH, COMPLETIONS_PATH
from kvgate.openai import errors as openai_errors
from kvgate.protocols.openai_generation import OpenAIGeneration

CHAT_COMPLETIONS = OpenAIGeneration("chat_completions", CHAT_PATH)
COMPLETIONS = OpenAIGeneration("completions", COMPLETIONS_PATH)

# The metered APIs by request path (query string aside).
METERED_APIS: dict[str, ApiProtocol] = {api.path: api for api in (CHAT_COMPLETIONS, COMPLETIONS)}

# The shape of kvgate's answers on a path no metered API serves (/v1/models, unknown
# paths, the usage report): OpenAI's, as every client of an OpenAI-compatible server reads.
DEFAULT_ERRORS = openai_errors

__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "DEFAULT_ERRORS", "METERED_APIS"]
