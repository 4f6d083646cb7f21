"""One SQLite connection used from one worker thread, off the event loop.

sqlite3 objects belong to the thread that made them, and a write may wait on the disk: the
embedded stores (the key directory's file, the usage records' file) each run their calls on
a thread of their own, one at a time.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")


class SqliteThread:
    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Opened by the owner's code on the worker thread; None until then.
        self.db: sqlite3.Connection | None = None

    async def run(self, work: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def close(self) -> None:
        def close() -> None:
            if self.db is not None:
                self.db.close()
                self.db = None

        await self.run(close)
        self._executor.shutdown(wait=True)
