"""vLLM's pooling APIs' wire format (embeddings, ``/pooling``, rerank and score): request
validation into the canonical ``pooling`` request (``requests``, ``scoring``) and the
answer's meter (``meter``).
Refusals are OpenAI's (``kvgate.openai.errors``). No gRPC, no I/O."""

from .meter import PoolingMeter
from .requests import EMBEDDINGS_PATH, MAX_INPUTS, POOLING_PATH, parse_inputs, parse_pooling_request
from .scoring import RERANK_PATHS, SCORE_PATHS, parse_scoring_request

__all__ = [
    "EMBEDDINGS_PATH",
    "MAX_INPUTS",
    "POOLING_PATH",
    "RERANK_PATHS",
    "SCORE_PATHS",
    "PoolingMeter",
    "parse_inputs",
    "parse_pooling_request",
    "parse_scoring_request",
]
