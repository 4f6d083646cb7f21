"""Work that must finish although the stream that started it is gone (settlements, abandons
of interrupted reserves); shutdown waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def drain(self, timeout_s: float) -> None:
        pending = set(self._running)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
