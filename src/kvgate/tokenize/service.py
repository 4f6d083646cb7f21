"""The async facade the gRPC server uses to count tokens without blocking its loop.

Rendering and tokenizing run in a thread pool: the Rust tokenizer releases the GIL
while it encodes, and even the canonical JSON + hash of a large request is done off the
loop. Results are kept in a bounded LRU keyed by a digest of (model, kind, inputs), so
identical prompts (retries, fan-out of one conversation) are counted once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.errors import PromptRenderError

THREAD_NAME_PREFIX = "kvgate-tokenize"


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    capacity: int


class _LRU:
    """A thread-safe LRU of digest -> count (small values: memory is bounded by entries)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> int | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, value: int) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, len(self._data), self.capacity)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def _digest(model: str, kind: str, payload: Any) -> bytes:
    # Canonical = compact and deterministic, but key order is kept: chat templates
    # render tool schemas with tojson(sort_keys=False), so reordered keys can change
    # the prompt and therefore the count.
    try:
        blob = json.dumps(
            [model, kind, payload], ensure_ascii=False, separators=(",", ":"), allow_nan=True
        )
    except (TypeError, ValueError) as exc:
        raise PromptRenderError("the request contains values that are not JSON") from exc
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class TokenizerService:
    """Counts tokens for registered models on a worker pool, with an LRU in front."""

    def __init__(self, *, max_workers: int = 4, cache_size: int = 4096) -> None:
        self._counters: dict[str, PromptCounter] = {}
        self._cache = _LRU(cache_size)
        self._executor = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix=THREAD_NAME_PREFIX
        )
        self._closed = False

    # -- registry -----------------------------------------------------------------------

    def register(self, model_name: str, counter: PromptCounter) -> None:
        if model_name in self._counters:
            # A reload swapped this model's tokenizer: cached counts may be wrong now.
            self._cache.clear()
        self._counters[model_name] = counter

    def unregister(self, model_name: str) -> None:
        self._counters.pop(model_name, None)

    def models(self) -> list[str]:
        return sorted(self._counters)

    def counter(self, model: str) -> PromptCounter:
        """The model's counter; ``KeyError`` if the model is not registered."""
        try:
            return self._counters[model]
        except KeyError:
            raise KeyError(model) from None

    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    # -- async counting API -------------------------------------------------------------

    async def count_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        counter = self.counter(model)
        payload = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
            "add_special_tokens": add_special_tokens,
        }

        def work() -> int:
            return counter.count_chat(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
            )

        return await self._run(model, "chat", payload, work)

    async def count_completion(
        self, model: str, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> int:
        """Prompt tokens of a completions request; a batch counts as the sum."""
        counter = self.counter(model)
        return await self._run(
            model, "completion", prompt, lambda: counter.count_completion(prompt)
        )

    async def count_text(self, model: str, text: str) -> int:
        counter = self.counter(model)
        return await self._run(model, "text", text, lambda: counter.count_text(text))

    async def _run(self, model: str, kind: str, payload: Any, work: Callable[[], int]) -> int:
        if self._closed:
            raise RuntimeError("TokenizerService is closed")

        def job() -> int:
            key = _digest(model, kind, payload)
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            value = work()
            self._cache.put(key, value)
            return value

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, job)

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker pool; queued jobs are cancelled, running ones finish."""
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)
