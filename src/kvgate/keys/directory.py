"""What every key store shares: minting keys, the lookup cache and the generation poll.

A store implements the few reads and atomic writes below; this class turns them into the
`KeyDirectory`. Lookups go through a bounded LRU (records and misses); every `refresh_s` one
read of the store's generation (a counter every create, revoke and rotate bumps, on any
replica or process) empties the cache when it moved, and a change made here empties it at
once. So a revocation anywhere is in force everywhere within `refresh_s` plus one read.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from kvgate.config.model import LevelConfig, hash_api_key
from kvgate.keys.cache import LookupCache
from kvgate.keys.records import KeyRecord, NewKey

log = logging.getLogger("kvgate.keys")

SECRET_PREFIX = "kvg-"
KEY_ID_PREFIX = "key_"
SECRET_BYTES = 32  # 256 bits of entropy


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def new_key_id() -> str:
    return KEY_ID_PREFIX + secrets.token_hex(8)


# A record as flat text fields (a Redis hash, and the same names as the SQLite columns); an
# absent optional value is an empty string.
FIELDS = (
    "key_id",
    "key_hash",
    "tenant",
    "team",
    "user",
    "labels",
    "created_at",
    "expires_at",
    "revoked_at",
    "limits",
)


def _number(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def record_fields(record: KeyRecord) -> dict[str, str]:
    return {
        "key_id": record.key_id,
        "key_hash": record.key_hash,
        "tenant": record.tenant,
        "team": record.team or "",
        "user": record.user or "",
        "labels": json.dumps(dict(record.labels), sort_keys=True),
        "created_at": repr(float(record.created_at)),
        "expires_at": _number(record.expires_at),
        "revoked_at": _number(record.revoked_at),
        "limits": (
            json.dumps(record.limits.model_dump(mode="json"), sort_keys=True)
            if record.limits is not None
            else ""
        ),
    }


def record_from_fields(fields: Mapping[str, str | bytes | float | None]) -> KeyRecord:
    def text(name: str) -> str:
        value = fields.get(name)
        if value is None:
            return ""
        return value.decode() if isinstance(value, bytes) else str(value)

    def number(name: str) -> float | None:
        value = text(name)
        return float(value) if value else None

    limits = text("limits")
    labels = text("labels")
    return KeyRecord(
        key_id=text("key_id"),
        key_hash=text("key_hash"),
        tenant=text("tenant"),
        team=text("team") or None,
        user=text("user") or None,
        labels=MappingProxyType(json.loads(labels) if labels else {}),
        created_at=number("created_at") or 0.0,
        expires_at=number("expires_at"),
        revoked_at=number("revoked_at"),
        limits=LevelConfig.model_validate(json.loads(limits)) if limits else None,
    )


class CachedDirectory(abc.ABC):
    """A `KeyDirectory` over a store's primitives (see the module's docstring)."""

    def __init__(
        self,
        *,
        cache_entries: int,
        refresh_s: float,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._cache = LookupCache(cache_entries)
        self._refresh_s = refresh_s
        self._now = now
        self._poller: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the store's part

    @abc.abstractmethod
    async def _read_by_hash(self, key_hash: str) -> KeyRecord | None: ...

    @abc.abstractmethod
    async def _read_by_id(self, key_id: str) -> KeyRecord | None: ...

    @abc.abstractmethod
    async def _read_page(
        self, tenant: str | None, after_key_id: str, limit: int
    ) -> list[KeyRecord]: ...

    @abc.abstractmethod
    async def _insert(self, record: KeyRecord) -> None:
        """Add the record and bump the generation, atomically."""

    @abc.abstractmethod
    async def _set_revoked(self, key_id: str, at: float) -> KeyRecord | None:
        """Revoked at ``at`` (or earlier, if it already was), generation bumped, atomically."""

    @abc.abstractmethod
    async def _replace(self, key_id: str, new: KeyRecord, revoke_at: float) -> KeyRecord | None:
        """Add ``new`` (the old one's tenant, team, user, labels, expiry and limits) and revoke
        ``key_id`` at ``revoke_at``, atomically; None (and nothing done) when ``key_id`` is
        unknown or already revoked by now. Returns the new record."""

    @abc.abstractmethod
    async def generation(self) -> int:
        """The store's change counter (0 for a store no key was ever written to)."""

    async def _close_store(self) -> None:  # noqa: B027 - optional
        pass

    # ------------------------------------------------------------------ KeyDirectory

    async def lookup(self, key_hash: str) -> KeyRecord | None:
        cached, record = self._cache.get(key_hash)
        if cached:
            return record
        epoch = self._cache.epoch
        record = await self._read_by_hash(key_hash)
        self._cache.put(key_hash, record, epoch)
        return record

    async def create(
        self,
        tenant: str,
        *,
        team: str | None = None,
        user: str | None = None,
        labels: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        limits: LevelConfig | None = None,
    ) -> NewKey:
        secret = new_secret()
        record = KeyRecord(
            key_id=new_key_id(),
            key_hash=hash_api_key(secret),
            tenant=tenant,
            team=team,
            user=user,
            labels=MappingProxyType(dict(labels or {})),
            created_at=self._now(),
            expires_at=expires_at,
            limits=limits,
        )
        try:
            await self._insert(record)
        finally:
            self._cache.clear()  # a cached miss of this hash is wrong now
        log.info("api key created", extra={"key_id": record.key_id, "tenant": tenant})
        return NewKey(secret=secret, record=record)

    async def get(self, key_id: str) -> KeyRecord | None:
        return await self._read_by_id(key_id)

    async def list(
        self, *, tenant: str | None = None, after_key_id: str = "", limit: int = 100
    ) -> Sequence[KeyRecord]:
        if limit <= 0:
            return []
        return await self._read_page(tenant, after_key_id, limit)

    async def revoke(self, key_id: str, *, at: float | None = None) -> KeyRecord | None:
        try:
            record = await self._set_revoked(key_id, self._now() if at is None else at)
        finally:
            self._cache.clear()
        if record is not None:
            log.info("api key revoked", extra={"key_id": key_id, "tenant": record.tenant})
        return record

    async def rotate(self, key_id: str, *, grace_s: float = 0.0) -> NewKey | None:
        now = self._now()
        secret = new_secret()
        template = KeyRecord(
            key_id=new_key_id(), key_hash=hash_api_key(secret), tenant="", created_at=now
        )
        try:
            record = await self._replace(key_id, template, now + max(grace_s, 0.0))
        finally:
            self._cache.clear()
        if record is None:
            return None
        log.info(
            "api key rotated",
            extra={"key_id": key_id, "new_key_id": record.key_id, "grace_s": grace_s},
        )
        return NewKey(secret=secret, record=record)

    async def start(self) -> None:
        """Nothing is loaded: lookups fill the cache. The generation poll begins."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name="kvgate-keys-generation"
            )

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await self._close_store()

    async def refresh(self) -> bool:
        """Read the generation once; empty the cache if it moved (or cannot be read).
        Returns whether the cache was emptied."""
        try:
            generation: int | None = await self.generation()
        except Exception as exc:  # the store's own errors, whatever the store
            log.warning("api key store: generation unreadable", extra={"error": repr(exc)})
            generation = None
        return self._cache.observe_generation(generation)

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh_s)

    @property
    def cached_entries(self) -> int:
        return len(self._cache)
