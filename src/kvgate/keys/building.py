"""From the config's `keys:` section to a key directory (not started)."""

from __future__ import annotations

from pathlib import Path

from kvgate.config import ConfigError, KvgateConfig
from kvgate.keys.records import KeyDirectory
from kvgate.store.redis_store import RedisStore


def build_key_directory(
    config: KvgateConfig, *, redis_store: RedisStore | None = None
) -> KeyDirectory | None:
    """The configured directory; None when `keys.store` is off.

    ``redis_store``: the state store on Redis (when `store` is a Redis URL). The keys share
    its client (one connection pool, the same settings and credentials) and its key prefix;
    the state store closes that client, not the directory."""
    keys = config.keys
    store = keys.store
    if store == "off":
        return None
    if store == "auto":
        store = "redis" if config.uses_redis else "embedded"
    if store == "redis":
        if redis_store is None:
            raise ConfigError("keys.store: redis needs `store` to be a Redis URL")
        from kvgate.keys.redis_directory import RedisKeyDirectory

        return RedisKeyDirectory(
            redis_store.client,
            redis_store.key_tag,
            cache_entries=keys.cache_entries,
            refresh_s=keys.refresh_s,
            timeout_s=config.redis.timeout_s,
        )
    from kvgate.keys.sqlite_directory import SqliteKeyDirectory

    return SqliteKeyDirectory(
        Path(keys.path), cache_entries=keys.cache_entries, refresh_s=keys.refresh_s
    )
