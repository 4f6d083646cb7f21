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
from typing import Any

from kvgate.config import ConfigError, KvgateConfig, SnapshotHolder, compile_snapshot, load_config
from kvgate.config.model import BackendConfig, ModelConfig, engine_tokenize_url
from kvgate.config.reloading import RELOAD as RELOAD  # re-exported: the table's values
from kvgate.config.reloading import RESTART, field_classes
from kvgate.metrics import Metrics
from kvgate.tokenize import CountingApi, TokenizerService
from kvgate.tokenize.engine_counting import EngineCounter, load_model_counter

log = logging.getLogger("kvgate.reload")


# How every configuration field reaches the running process, by path ("*" for any list item
# or mapping key): RELOAD or RESTART, as the field's definition in kvgate.config.model
# declares it (Reload[T], Restart[T]; kvgate.config.reloading says what each means). A
# changed RESTART field refuses the reload, naming the field.
FIELD_CLASSES: dict[str, str] = field_classes(KvgateConfig)


def _value_at(data: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict):
            return None  # an absent optional section (e.g. no redis.sentinel)
        data = data.get(key)
    return data


def restart_only_changes(old: KvgateConfig, new: KvgateConfig) -> list[str]:
    """The changed fields that only a restart can apply, by name."""
    before, after = old.model_dump(), new.model_dump()
    return [
        path
        for path, kind in FIELD_CLASSES.items()
        if kind == RESTART and _value_at(before, path) != _value_at(after, path)
    ]


def _tokenizer_settings(
    model: ModelConfig, backends: dict[str, BackendConfig]
) -> tuple[object, ...]:
    """What a model's counter is loaded from: a change loads it again."""
    if model.counting == "engine":
        backend = backends[model.backend]
        return (
            "engine",
            model.engine_counting,
            model.engine_flags,
            model.cache_generation,
            engine_tokenize_url(model, backend),
            backend.upstream_api_key,
        )
    return (
        model.tokenizer,
        model.counting_engine,
        model.tokenizer_mode,
        model.harmony_system_instructions,
        model.engine_flags,
        model.vision,
    )


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
        prepare: Callable[[KvgateConfig], Callable[[], None]] | None = None,
    ) -> None:
        self._on_applied = on_applied
        # Run (in a worker thread) before the swap: reads what the new config names outside
        # itself (the operator token); raising rejects the reload. What it returns is called
        # right after the swap.
        self._prepare = prepare
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
                blocked = restart_only_changes(old, config)
                if blocked:
                    raise ConfigError(
                        f"{self._path}: {', '.join(blocked)} cannot change without a restart "
                        "(nothing of this file was applied)"
                    )
                apply_prepared = (
                    await asyncio.to_thread(self._prepare, config) if self._prepare else None
                )
                await asyncio.to_thread(self._load_tokenizers, old, config)
                # The serving snapshot's unchanged tenants are reused, not compiled again;
                # off the event loop, as a fleet of tenants takes a while.
                snapshot = await asyncio.to_thread(
                    compile_snapshot, config, self._snapshots.current
                )
                config = snapshot.config  # holding those tenants' (equal) config objects
            except Exception as exc:  # any failure keeps the old snapshot
                self.last_error = str(exc)
                self._metrics.config_reloads.labels("failure").inc()
                log.error(
                    "config reload rejected; the previous config keeps serving",
                    extra={"trigger": trigger, "error": str(exc)},
                )
                return False
            self._snapshots.swap(snapshot)
            if apply_prepared is not None:
                apply_prepared()
            self._apply_server_settings(old, config)
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

    def _apply_server_settings(self, old: KvgateConfig, new: KvgateConfig) -> None:
        """Server fields held outside the snapshot, applied right after the swap."""
        before, after = old.server, new.server
        if before.log_level != after.log_level:
            # Only on a change, so a `--log-level` given at start survives other reloads.
            logging.getLogger().setLevel(after.log_level)
        sizes = ("tokenizer_threads", "tokenizer_cache_entries", "inline_tokenize_max_chars")
        if any(getattr(before, name) != getattr(after, name) for name in sizes):
            self._tokenizers.resize(
                max_workers=after.tokenizer_threads,
                cache_size=after.tokenizer_cache_entries,
                inline_max_cost=after.inline_tokenize_max_chars,
            )

    def _load_tokenizers(self, old: KvgateConfig, new: KvgateConfig) -> None:
        """Load tokenizers of new or changed models before anything is swapped."""
        old_backends = {b.name: b for b in old.backends}
        backends = {b.name: b for b in new.backends}
        previous = {m.name: _tokenizer_settings(m, old_backends) for m in old.models}
        cache_dir = Path(new.server.tokenizer_cache_dir)
        if cache_dir != Path(old.server.tokenizer_cache_dir):
            previous = {}  # every model is loaded again, from the new cache directory
        loaded: dict[str, CountingApi | EngineCounter] = {}
        for model in new.models:
            if previous.get(model.name) == _tokenizer_settings(model, backends):
                continue
            loaded[model.name] = load_model_counter(model, backends[model.backend], cache_dir)
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
