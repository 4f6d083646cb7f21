"""vLLM's pooling APIs' wire format (embeddings, ``/pooling``): request validation into
the canonical ``pooling`` request (``requests``) and the answer's meter (``meter``).
Refusals are OpenAI's (``kvgate.openai.errors``). No gRPC, no I/O."""

from .meter import PoolingMeter
from .requests import EMBEDDINGS_PATH, MAX_INPUTS, POOLING_PATH, parse_inputs, parse_pooling_request

__all__ = [
    "EMBEDDINGS_PATH",
    "MAX_INPUTS",
    "POOLING_PATH",
    "PoolingMeter",
    "parse_inputs",
    "parse_pooling_request",
]
