"""Answers served once (issue 12).

:mod:`kvgate.cache.idempotency` keeps one generation per (tenant, Idempotency-Key) and
replays its answer (memory, or Redis shared by replicas).

The semantic cache's foundations:
:mod:`kvgate.cache.embeddings` turns question texts into L2-normalised vectors: offline
with WordLlama's 256-dimensional weights (the ``semantic`` extra), or through an
OpenAI-compatible ``POST /v1/embeddings`` endpoint (vLLM serving an embedding model). Nothing
here is on the request path yet; numpy (and wordllama) are imported only by the modules that
need them, so importing this package costs nothing.
"""
