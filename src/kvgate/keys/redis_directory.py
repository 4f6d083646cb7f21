"""API keys in the state store's Redis: every replica sees every key.

Keys (all under the deployment's hash tag, so one Cluster slot, like the state store's):

    {prefix}:apikey|h|<key hash>   hash: the record's fields (one HGETALL per lookup)
    {prefix}:apikey|id|<key id>    string: the key hash (ids are what operators name)
    {prefix}:apikeys|t|<tenant>    sorted set of key ids, all score 0: a tenant's keys in id order
    {prefix}:apikeys|all           sorted set of every key id, the same way
    {prefix}:apikeys|gen           the generation: INCR by every create, revoke and rotate

Writes are Lua scripts (atomic on one node, also on a Cluster). Nothing is read at start: a
million keys cost a replica nothing until they are used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from kvgate.keys.directory import FIELDS, CachedDirectory, record_fields, record_from_fields
from kvgate.keys.records import KeyRecord
from kvgate.store.errors import StoreUnavailable
from kvgate.store.redis_store import UNAVAILABLE_ERRORS

_T = TypeVar("_T")

# KEYS: record hash, id key, tenant index, global index, generation. ARGV: id, hash, then
# field/value pairs. 0 when the id or hash is taken (random: never in practice).
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
redis.call('INCR', KEYS[5])
return 1
"""

# KEYS: record hash, generation. ARGV: revoked_at. The record's fields after, or nil.
_REVOKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return nil end
local at = tonumber(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[1], 'revoked_at'))
if old == nil or at < old then
  redis.call('HSET', KEYS[1], 'revoked_at', ARGV[1])
end
redis.call('INCR', KEYS[2])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: old record hash, new record hash, new id key, tenant index, global index, generation.
# ARGV: now, revoke_at, new id, new hash, new created_at. The new record's fields, or nil when
# the old key is unknown or already revoked.
_ROTATE = """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return nil end
local old = {}
for i = 1, #fields, 2 do old[fields[i]] = fields[i + 1] end
local now = tonumber(ARGV[1])
local revoked = tonumber(old['revoked_at'])
if revoked ~= nil and revoked <= now then return nil end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  return nil
end
redis.call('HSET', KEYS[2], 'key_id', ARGV[3], 'key_hash', ARGV[4], 'tenant', old['tenant'],
  'team', old['team'] or '', 'user', old['user'] or '', 'labels', old['labels'] or '{}',
  'created_at', ARGV[5], 'expires_at', old['expires_at'] or '', 'revoked_at', '',
  'limits', old['limits'] or '')
redis.call('SET', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[4], 0, ARGV[3])
redis.call('ZADD', KEYS[5], 0, ARGV[3])
local at = tonumber(ARGV[2])
if revoked == nil or at < revoked then
  redis.call('HSET', KEYS[1], 'revoked_at', ARGV[2])
end
redis.call('INCR', KEYS[6])
return redis.call('HGETALL', KEYS[2])
"""


def _pairs(reply: Any) -> dict[str, str]:
    """HGETALL's reply (a dict from redis-py, a flat list from a script) as text."""
    if isinstance(reply, dict):
        items = list(reply.items())
    else:
        flat = list(reply)
        items = list(zip(flat[0::2], flat[1::2], strict=True))
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v.decode() if isinstance(v, bytes) else str(v)
        )
        for k, v in items
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisKeyDirectory(CachedDirectory):
    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        key_tag: str,
        *,
        cache_entries: int,
        refresh_s: float,
        timeout_s: float = 0.25,
        owns_client: bool = False,
        now: Callable[[], float] | None = None,
    ) -> None:
        """``client`` and ``key_tag``: the state store's (`RedisStore.client`, `.key_tag`);
        the directory closes the client only when it ``owns_client``."""
        if now is None:
            super().__init__(cache_entries=cache_entries, refresh_s=refresh_s)
        else:
            super().__init__(cache_entries=cache_entries, refresh_s=refresh_s, now=now)
        self._client = client
        self._owns_client = owns_client
        self._timeout_s = timeout_s
        self._tag = key_tag
        self._generation_key = f"{key_tag}:apikeys|gen"
        self._all_key = f"{key_tag}:apikeys|all"
        self._create = client.register_script(_CREATE)
        self._revoke = client.register_script(_REVOKE)
        self._rotate = client.register_script(_ROTATE)

    def _record_key(self, key_hash: str) -> str:
        return f"{self._tag}:apikey|h|{key_hash}"

    def _id_key(self, key_id: str) -> str:
        return f"{self._tag}:apikey|id|{key_id}"

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._tag}:apikeys|t|{tenant}"

    async def _bounded(self, op: str, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call()
        except UNAVAILABLE_ERRORS as exc:
            raise StoreUnavailable(f"redis keys {op} failed: {type(exc).__name__}: {exc}") from exc

    async def _read_by_hash(self, key_hash: str) -> KeyRecord | None:
        key = self._record_key(key_hash)
        fields = await self._bounded("lookup", lambda: self._client.hgetall(key))
        return record_from_fields(_pairs(fields)) if fields else None

    async def _hash_of(self, key_id: str) -> str | None:
        key = self._id_key(key_id)
        found = await self._bounded("get", lambda: self._client.get(key))
        return _text(found) if found else None

    async def _read_by_id(self, key_id: str) -> KeyRecord | None:
        key_hash = await self._hash_of(key_id)
        return await self._read_by_hash(key_hash) if key_hash else None

    async def _read_page(
        self, tenant: str | None, after_key_id: str, limit: int
    ) -> list[KeyRecord]:
        index = self._tenant_key(tenant) if tenant is not None else self._all_key
        start = f"({after_key_id}" if after_key_id else "-"

        async def read() -> list[KeyRecord]:
            ids = await self._client.zrangebylex(index, start, "+", start=0, num=limit)
            if not ids:
                return []
            hashes = await self._client.mget([self._id_key(_text(i)) for i in ids])
            pipe = self._client.pipeline(transaction=False)
            for key_hash in hashes:
                if key_hash:
                    pipe.hgetall(self._record_key(_text(key_hash)))
            rows = await pipe.execute()
            return [record_from_fields(_pairs(row)) for row in rows if row]

        return await self._bounded("list", read)

    async def _insert(self, record: KeyRecord) -> None:
        fields = record_fields(record)
        args: list[str] = [record.key_id, record.key_hash]
        for name in FIELDS:
            args += [name, fields[name]]
        keys = [
            self._record_key(record.key_hash),
            self._id_key(record.key_id),
            self._tenant_key(record.tenant),
            self._all_key,
            self._generation_key,
        ]
        done = await self._bounded("create", lambda: self._create(keys=keys, args=args))
        if not done:
            raise RuntimeError("api key id or hash already taken")  # 2**-64: a bug, not luck

    async def _set_revoked(self, key_id: str, at: float) -> KeyRecord | None:
        key_hash = await self._hash_of(key_id)
        if key_hash is None:
            return None
        keys = [self._record_key(key_hash), self._generation_key]
        reply = await self._bounded("revoke", lambda: self._revoke(keys=keys, args=[repr(at)]))
        return record_from_fields(_pairs(reply)) if reply else None

    async def _replace(self, key_id: str, new: KeyRecord, revoke_at: float) -> KeyRecord | None:
        old = await self._read_by_id(key_id)
        if old is None:
            return None
        keys = [
            self._record_key(old.key_hash),
            self._record_key(new.key_hash),
            self._id_key(new.key_id),
            self._tenant_key(old.tenant),
            self._all_key,
            self._generation_key,
        ]
        args = [
            repr(new.created_at),
            repr(revoke_at),
            new.key_id,
            new.key_hash,
            repr(new.created_at),
        ]
        reply = await self._bounded("rotate", lambda: self._rotate(keys=keys, args=args))
        return record_from_fields(_pairs(reply)) if reply else None

    async def generation(self) -> int:
        found = await self._bounded("generation", lambda: self._client.get(self._generation_key))
        return int(found) if found else 0

    async def _close_store(self) -> None:
        if self._owns_client:
            await self._client.aclose()
