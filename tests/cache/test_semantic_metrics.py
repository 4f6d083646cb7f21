"""The semantic cache's own metrics, read at scrape time from the embedder and the index."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvgate.cache.embeddings import EmbeddingBusy, WordLlamaEmbedder
from kvgate.cache.semantic import CONTEXT_OVERHEAD_BYTES, MemoryEntryLog, SemanticIndex
from kvgate.metrics.definitions import SemanticCacheCollector


async def test_refusals_and_the_mirror_are_exported() -> None:
    embedder = WordLlamaEmbedder(inline_max_chars=0, max_queued_per_tenant=1, deadline_s=30)
    index = SemanticIndex(
        MemoryEntryLog(1 << 20),
        dimensions=256,
        max_entries_per_context=16,
        max_mirrored_bytes=1 << 20,
    )
    registry = CollectorRegistry()
    registry.register(SemanticCacheCollector(embedder, index))
    try:
        busy = asyncio.create_task(embedder.embed(["a long question " * 500] * 16, tenant="a"))
        await asyncio.sleep(0)
        with pytest.raises(EmbeddingBusy):
            await embedder.embed(["another"], tenant="a")
        await busy
        for i in range(3):
            await index.search(f"ctx-{i}", np.ones(256, dtype=np.float32), min_similarity=0.5)
    finally:
        await embedder.close()
    value = registry.get_sample_value
    assert (
        value("kvgate_semantic_cache_embeddings_refused_total", {"reason": "tenant_queue_full"})
        == 1
    )
    assert value("kvgate_semantic_cache_embeddings_refused_total", {"reason": "deadline"}) == 0
    assert value("kvgate_semantic_cache_mirror_contexts") == 3
    assert value("kvgate_semantic_cache_mirror_bytes") == 3 * CONTEXT_OVERHEAD_BYTES
    assert value("kvgate_semantic_cache_mirror_entries") == 0
