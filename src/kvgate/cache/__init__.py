"""Answers served once: where stored answers and the semantic index live.

:mod:`kvgate.cache.answers` keeps answers under keys, each claimed by the one request that
produces it (an Idempotency-Key, an exact-cache entry, a semantic-cache entry), in memory or
in Redis shared by replicas. :mod:`kvgate.cache.embeddings` turns questions into
L2-normalised vectors (WordLlama offline, or an OpenAI-compatible ``/v1/embeddings``);
:mod:`kvgate.cache.semantic` indexes and searches them; :mod:`kvgate.cache.semantic_guard`
is the lexical check next to the similarity. numpy (and wordllama) are imported only by the
modules that need them, so importing this package costs nothing.
"""
