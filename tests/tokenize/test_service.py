"""TokenizerService counts off the event loop, caches repeats, and knows its models."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvgate.tokenize import PromptCounter, PromptRenderError, TokenizerService
from kvgate.tokenize.service import THREAD_NAME_PREFIX

MSGS = [{"role": "user", "content": "How many tokens is this?"}]


class SpyCounter(PromptCounter):
    """The real counter, recording which thread each call ran on."""

    def __init__(self, inner: PromptCounter) -> None:
        self.__dict__.update(inner.__dict__)
        self.threads: list[str] = []
        self.calls = 0

    def count_chat(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return super().count_chat(*args, **kwargs)

    def count_completion(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return super().count_completion(*args, **kwargs)

    def count_text(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        return super().count_text(*args, **kwargs)


@pytest.fixture
def spy(counter: PromptCounter) -> SpyCounter:
    return SpyCounter(counter)


@pytest.fixture
def service(spy: SpyCounter) -> Any:
    svc = TokenizerService(max_workers=2, cache_size=8)
    svc.register("demo", spy)
    yield svc
    svc.close()


async def test_runs_off_the_event_loop(service: TokenizerService, spy: SpyCounter) -> None:
    loop_thread = threading.current_thread()
    n = await service.count_chat("demo", MSGS)
    assert n == spy.count_chat(MSGS) > 0
    assert spy.threads[0] != loop_thread.name
    assert spy.threads[0].startswith(THREAD_NAME_PREFIX)
    assert await service.count_completion("demo", "hello world") == 2
    assert await service.count_text("demo", "hello world") == 2
    assert all(name.startswith(THREAD_NAME_PREFIX) for name in spy.threads[2:])


async def test_loop_stays_responsive(service: TokenizerService) -> None:
    big = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 20000}]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await service.count_chat("demo", big)
    task.cancel()
    assert ticks > 1  # the loop kept running while the worker tokenized


async def test_cache_hits_on_repeat(service: TokenizerService, spy: SpyCounter) -> None:
    first = await service.count_chat("demo", MSGS, chat_template_kwargs=None)
    second = await service.count_chat("demo", [dict(m) for m in MSGS])
    assert first == second
    assert spy.calls == 1
    stats = service.cache_stats()
    assert (stats.hits, stats.misses, stats.size) == (1, 1, 1)
    # Any parameter that changes the prompt is part of the key.
    await service.count_chat("demo", MSGS, add_generation_prompt=False)
    await service.count_completion("demo", "How many tokens is this?")
    await service.count_text("demo", "How many tokens is this?")
    assert spy.calls == 4
    assert service.cache_stats().misses == 4


async def test_cache_is_bounded(service: TokenizerService) -> None:
    for i in range(20):
        await service.count_text("demo", f"text {i}")
    stats = service.cache_stats()
    assert stats.size == stats.capacity == 8


async def test_errors_propagate(service: TokenizerService) -> None:
    with pytest.raises(KeyError):
        await service.count_chat("no-such-model", MSGS)
    with pytest.raises(KeyError):
        await service.count_text("no-such-model", "x")
    with pytest.raises(PromptRenderError):
        await service.count_chat("demo", [{"role": "user", "content": [{"type": "image_url"}]}])
    assert service.models() == ["demo"]


async def test_concurrent_requests(service: TokenizerService, spy: SpyCounter) -> None:
    texts = [f"request number {i} " * (i + 1) for i in range(32)]
    got = await asyncio.gather(*(service.count_completion("demo", t) for t in texts))
    assert got == [spy.count_completion(t) for t in texts]


async def test_closed_service_refuses(spy: SpyCounter) -> None:
    svc = TokenizerService(max_workers=1)
    svc.register("demo", spy)
    assert await svc.count_text("demo", "a") == 1
    svc.close()
    with pytest.raises(RuntimeError):
        await svc.count_text("demo", "a")
