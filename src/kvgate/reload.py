"""Hot reload: SIGHUP or a change of the config file applies a new configuration atomically.

The new file is validated, its tokenizers are loaded, and only then is the compiled snapshot
swapped in with one reference assignment. A bad config keeps the old one serving, logs why and
counts a failure. Reservations live in the store, keyed by names, so in-flight requests settle
normally across a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvgate.config import ConfigError, KvgateConfig, SnapshotHolder, compile_snapshot, load_config
from kvgate.metrics import Metrics
from kvgate.tokenize import PromptCounter, TokenizerService, resolve_tokenizer_dir

log = logging.getLogger("kvgate.reload")


def _restart_only_changes(old: KvgateConfig, new: KvgateConfig) -> list[str]:
    changed = []
    if old.server.grpc_listen != new.server.grpc_listen:
        changed.append("server.grpc_listen")
    if old.server.http_listen != new.server.http_listen:
        changed.append("server.http_listen")
    before, after = old.model_dump(), new.model_dump()
    for section in ("store", "redis"):
        if before.get(section) != after.get(section):
            changed.append(section)
    return changed


class ConfigReloader:
    def __init__(
        self,
        path: Path,
        *,
        snapshots: SnapshotHolder,
        tokenizers: TokenizerService,
        metrics: Metrics,
        poll_interval_s: float = 2.0,
        on_applied: Callable[[KvgateConfig], Awaitable[None]] | None = None,
    ) -> None:
        self._on_applied = on_applied
        self._path = path
        self._snapshots = snapshots
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._poll_interval_s = poll_interval_s
        self._lock = asyncio.Lock()
        self._fingerprint = self._stat()
        self._watch_task: asyncio.Task[None] | None = None
        self.generation = 1
        self.last_error: str | None = None
        metrics.config_generation.set(self.generation)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            # Kubernetes swaps ConfigMap files through a symlink: follow it (stat, not lstat).
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def reload(self, trigger: str) -> bool:
        """Apply the file's current contents; True if the new config is now serving."""
        async with self._lock:
            self._fingerprint = self._stat()
            try:
                config = await asyncio.to_thread(load_config, self._path)
                old = self._snapshots.current.config
                blocked = _restart_only_changes(old, config)
                if blocked:
                    raise ConfigError(
                        f"{self._path}: {', '.join(blocked)} cannot change without a restart"
                    )
                await asyncio.to_thread(self._load_tokenizers, old, config)
                snapshot = compile_snapshot(config)
            except Exception as exc:  # any failure keeps the old snapshot
                self.last_error = str(exc)
                self._metrics.config_reloads.labels("failure").inc()
                log.error(
                    "config reload rejected; the previous config keeps serving",
                    extra={"trigger": trigger, "error": str(exc)},
                )
                return False
            self._snapshots.swap(snapshot)
            if self._on_applied is not None:
                try:
                    await self._on_applied(config)
                except Exception:
                    log.exception("applying the reloaded config to live services failed")
            for model in old.models:
                if model.name not in snapshot.models:
                    self._tokenizers.unregister(model.name)
            self.generation += 1
            self.last_error = None
            self._metrics.config_reloads.labels("success").inc()
            self._metrics.config_generation.set(self.generation)
            for backend in snapshot.backends.values():
                self._metrics.kv_budget_tokens.labels(backend.name).set(backend.kv_budget_tokens)
            log.info(
                "config reloaded",
                extra={"trigger": trigger, "generation": self.generation},
            )
            return True

    def _load_tokenizers(self, old: KvgateConfig, new: KvgateConfig) -> None:
        """Load tokenizers of new or changed models before anything is swapped."""
        previous = {m.name: m.tokenizer for m in old.models}
        cache_dir = Path(new.server.tokenizer_cache_dir)
        loaded = {}
        for model in new.models:
            if previous.get(model.name) == model.tokenizer:
                continue
            model_dir = resolve_tokenizer_dir(model.tokenizer, cache_dir)
            loaded[model.name] = PromptCounter.from_model_dir(model_dir, name=model.name)
        for name, counter in loaded.items():
            self._tokenizers.register(name, counter)

    def start_watching(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            current = self._stat()
            if current is not None and current != self._fingerprint:
                await self.reload("file_change")

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
