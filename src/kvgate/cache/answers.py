"""Stored answers, each produced once: the store behind Idempotency-Key and both caches.

Built for idempotency keys: a client that times out and resends, or retries in a loop,
must not make the GPU generate the same answer again, nor pay for it again. The first
request with a key runs; a duplicate that arrives while it runs waits for it and gets the
same answer; a duplicate after it completed gets the stored answer (within the retention
window); the same key with another body is refused; a first attempt that failed or was cut
lets the next one run anew (draft-ietf-httpapi-idempotency-key-header). The exact-match and
semantic caches keep their answers here too, under their own keys.

The store keeps, per key: the request's fingerprint, who is running it (a lock with a TTL),
and once complete the answer. `claim` decides atomically, so two replicas sharing Redis
never both run a key.

Every entry is charged to one tenant's byte quota (`AnswerQuota`: per tenant and namespace)
and expires. Over its quota a tenant's new entries are refused; nothing of another tenant's
is ever evicted to make room, so one tenant can neither fill the shared store nor push out
the answers and locks other tenants' retries depend on.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript
    from redis.typing import EncodableT

# What an answer store raises when it cannot be reached in time: its callers' failure policy
# (fail open or closed) decides, and no caller needs to know which store it was.
ANSWER_STORE_FAILURES: tuple[type[BaseException], ...] = (TimeoutError, RedisError, OSError)
# What an entry costs besides its key and answer (the store's own bookkeeping); a lock is
# charged this much, so a lock can always be turned into a not-kept marker in place.
ENTRY_OVERHEAD_BYTES = 512
# A marker's headers are the answer's descriptive headers only: bounded so a marker always
# fits in the bytes its lock was charged.
MARKER_MAX_HEADER_BYTES = 256


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """What the client received: replayed byte for byte."""

    status: int
    content_type: str
    body: bytes
    # What producing it took (kvgate's settlement): what a cache hit saves, or is charged.
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Headers that describe how it was produced (a budget fallback, a clamp): replayed.
    headers: tuple[tuple[str, str], ...] = ()
    # Non-empty: the request completed but its answer was not kept (why: "too_large",
    # "over_quota"); a duplicate learns that, and never runs a second generation.
    not_kept: str = ""

    def encode(self) -> bytes:
        head = json.dumps(
            {
                "s": self.status,
                "t": self.content_type,
                "p": self.prompt_tokens,
                "o": self.output_tokens,
                "h": [list(pair) for pair in self.headers],
                "n": self.not_kept,
            }
        ).encode()
        return len(head).to_bytes(4, "big") + head + self.body

    @classmethod
    def decode(cls, data: bytes) -> StoredAnswer:
        size = int.from_bytes(data[:4], "big")
        head = json.loads(data[4 : 4 + size])
        return cls(
            status=int(head["s"]),
            content_type=str(head["t"]),
            body=data[4 + size :],
            prompt_tokens=int(head.get("p", 0)),
            output_tokens=int(head.get("o", 0)),
            headers=tuple((str(k), str(v)) for k, v in head.get("h", ())),
            not_kept=str(head.get("n", "")),
        )

    def marker(self, reason: str) -> StoredAnswer:
        """This answer's not-kept marker: how it was produced, without its body."""
        headers: list[tuple[str, str]] = []
        used = 0
        for name, value in self.headers:
            used += len(name) + len(value)
            if used > MARKER_MAX_HEADER_BYTES:
                break
            headers.append((name, value))
        return StoredAnswer(
            self.status,
            self.content_type,
            b"",
            self.prompt_tokens,
            self.output_tokens,
            tuple(headers),
            not_kept=reason,
        )


@dataclass(frozen=True, slots=True)
class AnswerQuota:
    """Whose bytes an entry counts against: one tenant's entries of one namespace
    (idempotency keys, cached answers), at most `max_bytes` of them alive at once."""

    namespace: str
    tenant: str
    max_bytes: int


class ClaimState(enum.Enum):
    # This caller holds the key now: it runs the request.
    STARTED = "started"
    # Another caller runs it.
    IN_FLIGHT = "in_flight"
    # It ran to completion; the answer is stored.
    COMPLETED = "completed"
    # Not locked: the tenant's quota (or the whole store) has no room for another entry.
    OVER_QUOTA = "over_quota"


class StoreResult(enum.Enum):
    STORED = "stored"
    # Completed, but the answer did not fit (the tenant's quota, the store's bound): the
    # marker was kept in its place if one was given, else the key was released.
    NOT_KEPT = "not_kept"
    # The caller no longer held the key (its lock expired, or it completed already).
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Claim:
    state: ClaimState
    # The fingerprint of the request that holds or completed the key.
    fingerprint: str
    answer: StoredAnswer | None = None


class AnswerStore(Protocol):
    async def claim(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl_s: float,
        *,
        quota: AnswerQuota | None = None,
    ) -> Claim:
        """Atomically: the stored answer if the key completed; who runs it if another owner's
        lock is alive; else lock it for `owner` (STARTED), charged to `quota`."""
        ...

    async def complete(
        self,
        key: str,
        owner: str,
        answer: StoredAnswer,
        retention_s: float,
        *,
        quota: AnswerQuota | None = None,
        marker: StoredAnswer | None = None,
    ) -> StoreResult:
        """Store the answer for `retention_s` and drop the lock, if `owner` still holds it
        and the answer fits `quota`; else keep `marker` (or release the key)."""
        ...

    async def renew(
        self, key: str, owner: str, lock_ttl_s: float, *, quota: AnswerQuota | None = None
    ) -> bool:
        """Extend `owner`'s lock (it still runs); False if it no longer holds it."""
        ...

    async def release(self, key: str, owner: str, *, quota: AnswerQuota | None = None) -> None:
        """`owner` gives the key up (failed or cut): nothing stored, the next claim runs."""
        ...

    async def close(self) -> None: ...


def entry_bytes(key: str, answer: StoredAnswer | None) -> int:
    """What an entry is charged: a lock, or a stored answer (its encoded size)."""
    return ENTRY_OVERHEAD_BYTES + len(key) + (len(answer.encode()) if answer is not None else 0)


@dataclass(slots=True)
class _Entry:
    fingerprint: str
    owner: str  # "" once completed
    expires_at: float
    answer: StoredAnswer | None
    size: int
    account: tuple[str, str] | None  # (namespace, tenant) charged, if any


class MemoryAnswerStore:
    """One process's keys, bounded in bytes per tenant and in all. Full means refused, never
    another entry evicted: expired entries are the only ones that go."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_bytes = max_bytes
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        self._account_bytes: dict[tuple[str, str], int] = {}
        # (expires_at, key): entries are dropped when their time passes (stale rows, whose
        # entry was renewed, completed or dropped since, are skipped).
        self._expiries: list[tuple[float, str]] = []

    @property
    def bytes_used(self) -> int:
        return self._bytes

    async def claim(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl_s: float,
        *,
        quota: AnswerQuota | None = None,
    ) -> Claim:
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.answer is not None:
                return Claim(ClaimState.COMPLETED, entry.fingerprint, entry.answer)
            if entry.owner != owner:
                return Claim(ClaimState.IN_FLIGHT, entry.fingerprint)
        size = entry_bytes(key, None)
        if not self._fits(size, quota, replacing=entry):
            return Claim(ClaimState.OVER_QUOTA, fingerprint)
        self._put(key, _Entry(fingerprint, owner, now + lock_ttl_s, None, size, _account(quota)))
        return Claim(ClaimState.STARTED, fingerprint)

    async def complete(
        self,
        key: str,
        owner: str,
        answer: StoredAnswer,
        retention_s: float,
        *,
        quota: AnswerQuota | None = None,
        marker: StoredAnswer | None = None,
    ) -> StoreResult:
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(key)
        if entry is None or entry.owner != owner or entry.answer is not None:
            return StoreResult.LOST
        account = _account(quota) or entry.account
        size = entry_bytes(key, answer)
        if self._fits(size, quota, replacing=entry):
            self._put(key, _Entry(entry.fingerprint, "", now + retention_s, answer, size, account))
            return StoreResult.STORED
        if marker is not None:
            # In the lock's place, charged no more than the lock was (room it already had).
            kept = _Entry(entry.fingerprint, "", now + retention_s, marker, entry.size, account)
            self._put(key, kept)
        else:
            self._drop(key)
        return StoreResult.NOT_KEPT

    async def renew(
        self, key: str, owner: str, lock_ttl_s: float, *, quota: AnswerQuota | None = None
    ) -> bool:
        del quota  # the entry knows what it is charged to
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(key)
        if entry is None or entry.owner != owner or entry.answer is not None:
            return False
        entry.expires_at = now + lock_ttl_s
        heapq.heappush(self._expiries, (entry.expires_at, key))
        return True

    async def release(self, key: str, owner: str, *, quota: AnswerQuota | None = None) -> None:
        del quota  # the entry knows what it is charged to
        entry = self._entries.get(key)
        if entry is not None and entry.owner == owner and entry.answer is None:
            self._drop(key)

    async def close(self) -> None:
        self._entries.clear()
        self._account_bytes.clear()
        self._expiries.clear()
        self._bytes = 0

    def _fits(self, size: int, quota: AnswerQuota | None, *, replacing: _Entry | None) -> bool:
        freed = replacing.size if replacing is not None else 0
        if self._bytes - freed + size > self._max_bytes:
            return False
        if quota is None:
            return True
        used = self._account_bytes.get((quota.namespace, quota.tenant), 0)
        if replacing is not None and replacing.account != _account(quota):
            freed = 0
        return used - freed + size <= quota.max_bytes

    def _put(self, key: str, entry: _Entry) -> None:
        self._drop(key)
        self._entries[key] = entry
        self._bytes += entry.size
        if entry.account is not None:
            self._account_bytes[entry.account] = (
                self._account_bytes.get(entry.account, 0) + entry.size
            )
        heapq.heappush(self._expiries, (entry.expires_at, key))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._bytes -= entry.size
        if entry.account is not None:
            left = self._account_bytes[entry.account] - entry.size
            if left:
                self._account_bytes[entry.account] = left
            else:
                del self._account_bytes[entry.account]

    def _expire(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires_at, key = heapq.heappop(expiries)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at == expires_at:
                self._drop(key)


def _account(quota: AnswerQuota | None) -> tuple[str, str] | None:
    return (quota.namespace, quota.tenant) if quota is not None else None


# Shared by the scripts below. A tenant's entries of one namespace are indexed in a sorted
# set (entry -> expiry, ms) and a hash (entry -> bytes, plus the running total in "~total").
# Redis expires an entry's own key by itself; its bytes leave the total when the index
# sees its expiry pass (at most 128 per call: the total may lag high, never low).
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function purge(zset, sizes, now)
  local gone = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, 128)
  local total = tonumber(redis.call('HGET', sizes, '~total') or '0')
  if #gone == 0 then
    return total
  end
  for _, member in ipairs(gone) do
    total = total - tonumber(redis.call('HGET', sizes, member) or '0')
    redis.call('HDEL', sizes, member)
  end
  redis.call('ZREM', zset, unpack(gone))
  redis.call('HSET', sizes, '~total', total)
  return total
end
local function charged(sizes, member)
  return tonumber(redis.call('HGET', sizes, member) or '0')
end
local function account(zset, sizes, member, size, now, ttl)
  redis.call('HINCRBY', sizes, '~total', size - charged(sizes, member))
  redis.call('HSET', sizes, member, size)
  redis.call('ZADD', zset, now + ttl, member)
  for _, index in ipairs({zset, sizes}) do
    if redis.call('PTTL', index) < ttl then
      redis.call('PEXPIRE', index, ttl + 60000)
    end
  end
end
local function unaccount(zset, sizes, member)
  local size = charged(sizes, member)
  if size > 0 then
    redis.call('HINCRBY', sizes, '~total', -size)
    redis.call('HDEL', sizes, member)
    redis.call('ZREM', zset, member)
  end
end
"""

# KEYS: the entry's hash, the tenant's index set and sizes (the entry itself when there is
# no quota). ARGV: fingerprint, owner, lock TTL (ms), quota bytes (-1: none), the lock's
# bytes, member, room ("1": the store has memory for it). Returns {state, fp, answer}.
_CLAIM = (
    _PRELUDE
    + """
local h = redis.call('HMGET', KEYS[1], 'fp', 'owner', 'answer')
if h[1] then
  if h[3] then
    return {'completed', h[1], h[3]}
  end
  if h[2] ~= ARGV[2] then
    return {'in_flight', h[1], false}
  end
end
local quota = tonumber(ARGV[4])
local size = tonumber(ARGV[5])
local now = 0
if quota >= 0 then
  now = now_ms()
  local used = purge(KEYS[2], KEYS[3], now) - charged(KEYS[3], ARGV[6])
  if ARGV[7] ~= '1' or used + size > quota then
    return {'over_quota', ARGV[1], false}
  end
elseif ARGV[7] ~= '1' then
  return {'over_quota', ARGV[1], false}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'owner', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if quota >= 0 then
  account(KEYS[2], KEYS[3], ARGV[6], size, now, tonumber(ARGV[3]))
end
return {'started', ARGV[1], false}
"""
)

# KEYS as for claim. ARGV: owner, answer, retention (ms), quota (-1: none), the answer's
# bytes, member, room ("1"/"0"), marker ("" : none). 1 stored, 2 not kept, 0 lost.
_COMPLETE = (
    _PRELUDE
    + """
local h = redis.call('HMGET', KEYS[1], 'owner', 'answer')
if h[1] ~= ARGV[1] or h[2] then
  return 0
end
local quota = tonumber(ARGV[4])
local ttl = tonumber(ARGV[3])
local now = 0
local fits = ARGV[7] == '1'
if quota >= 0 then
  now = now_ms()
  local used = purge(KEYS[2], KEYS[3], now) - charged(KEYS[3], ARGV[6])
  fits = fits and used + tonumber(ARGV[5]) <= quota
end
if fits then
  redis.call('HSET', KEYS[1], 'answer', ARGV[2])
  redis.call('HDEL', KEYS[1], 'owner')
  redis.call('PEXPIRE', KEYS[1], ttl)
  if quota >= 0 then
    account(KEYS[2], KEYS[3], ARGV[6], tonumber(ARGV[5]), now, ttl)
  end
  return 1
end
if ARGV[8] ~= '' then
  -- In the lock's place, charged what the lock was.
  redis.call('HSET', KEYS[1], 'answer', ARGV[8])
  redis.call('HDEL', KEYS[1], 'owner')
  redis.call('PEXPIRE', KEYS[1], ttl)
  if quota >= 0 then
    account(KEYS[2], KEYS[3], ARGV[6], charged(KEYS[3], ARGV[6]), now, ttl)
  end
  return 2
end
redis.call('DEL', KEYS[1])
if quota >= 0 then
  unaccount(KEYS[2], KEYS[3], ARGV[6])
end
return 2
"""
)

# KEYS as for claim; ARGV: owner, lock TTL (ms), member, has quota ("1"/"0"). 1 if renewed.
_RENEW = (
    _PRELUDE
    + """
local h = redis.call('HMGET', KEYS[1], 'owner', 'answer')
if h[1] ~= ARGV[1] or h[2] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[4] == '1' then
  account(KEYS[2], KEYS[3], ARGV[3], charged(KEYS[3], ARGV[3]), now_ms(), tonumber(ARGV[2]))
end
return 1
"""
)

# KEYS as for claim; ARGV: owner, member, has quota.
_RELEASE = (
    _PRELUDE
    + """
local h = redis.call('HMGET', KEYS[1], 'owner', 'answer')
if h[1] == ARGV[1] and not h[2] then
  redis.call('DEL', KEYS[1])
  if ARGV[3] == '1' then
    unaccount(KEYS[2], KEYS[3], ARGV[2])
  end
end
return 0
"""
)

# Redis memory is looked at this often (INFO memory), off the request path's answer.
MEMORY_CHECK_INTERVAL_S = 1.0


class RedisAnswerStore:
    """Keys shared by every kvgate replica, in the state store's Redis (its hash tag, so a
    Redis Cluster keeps them in the same slot as the rest of kvgate's keys).

    Redis runs with `noeviction`: were it to reach `maxmemory`, every write would fail, the
    reserve scripts included, and every tenant would get 503. So past `max_memory_fraction`
    of `maxmemory` this store takes no new entries (a cache runs uncached, an idempotency
    key answers 429) until memory is back below it."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        key_tag: str,
        timeout_s: float,
        *,
        max_memory_fraction: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._prefix = f"{key_tag}:idem|"
        self._index_prefix = f"{key_tag}:idemq|"
        self._timeout_s = timeout_s
        self._max_memory_fraction = max_memory_fraction
        self._clock = clock
        self._memory_checked_at = -MEMORY_CHECK_INTERVAL_S
        self._memory_room = True
        self._claim = client.register_script(_CLAIM)
        self._complete = client.register_script(_COMPLETE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    async def claim(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl_s: float,
        *,
        quota: AnswerQuota | None = None,
    ) -> Claim:
        await self._check_memory()
        reply = await self._call(
            self._claim,
            key,
            quota,
            fingerprint,
            owner,
            _ms(lock_ttl_s),
            quota.max_bytes if quota is not None else -1,
            entry_bytes(key, None),
            key,
            "1" if self._memory_room else "0",
        )
        assert isinstance(reply, list)  # the claim script always answers {state, fp, answer}
        state, held_fp, answer = reply
        fp = _text(held_fp)
        if _text(state) == "completed":
            return Claim(ClaimState.COMPLETED, fp, StoredAnswer.decode(bytes(answer)))
        if _text(state) == "in_flight":
            return Claim(ClaimState.IN_FLIGHT, fp)
        if _text(state) == "over_quota":
            return Claim(ClaimState.OVER_QUOTA, fp)
        return Claim(ClaimState.STARTED, fp)

    async def complete(
        self,
        key: str,
        owner: str,
        answer: StoredAnswer,
        retention_s: float,
        *,
        quota: AnswerQuota | None = None,
        marker: StoredAnswer | None = None,
    ) -> StoreResult:
        await self._check_memory()
        encoded = answer.encode()
        outcome = await self._call(
            self._complete,
            key,
            quota,
            owner,
            encoded,
            _ms(retention_s),
            quota.max_bytes if quota is not None else -1,
            ENTRY_OVERHEAD_BYTES + len(key) + len(encoded),
            key,
            "1" if self._memory_room else "0",
            marker.encode() if marker is not None else b"",
        )
        return {1: StoreResult.STORED, 2: StoreResult.NOT_KEPT}.get(
            int(outcome),  # type: ignore[arg-type]
            StoreResult.LOST,
        )

    async def renew(
        self, key: str, owner: str, lock_ttl_s: float, *, quota: AnswerQuota | None = None
    ) -> bool:
        indexed = "1" if quota is not None else "0"
        renewed = await self._call(self._renew, key, quota, owner, _ms(lock_ttl_s), key, indexed)
        return bool(renewed)

    async def release(self, key: str, owner: str, *, quota: AnswerQuota | None = None) -> None:
        indexed = "1" if quota is not None else "0"
        await self._call(self._release, key, quota, owner, key, indexed)

    async def close(self) -> None:
        return None  # the client belongs to the state store

    async def _check_memory(self) -> None:
        """Look at Redis memory at most once a second (a failed look changes nothing)."""
        now = self._clock()
        if now - self._memory_checked_at < MEMORY_CHECK_INTERVAL_S:
            return
        self._memory_checked_at = now
        try:
            async with asyncio.timeout(self._timeout_s):
                info = await self._client.info("memory")
        except Exception:
            return
        if isinstance(info, dict) and "used_memory" not in info:
            # A cluster client answers per node: the fullest node decides.
            nodes = [v for v in info.values() if isinstance(v, dict)]
        else:
            nodes = [info]
        room = True
        for node in nodes:
            limit = int(node.get("maxmemory", 0) or 0)
            used = int(node.get("used_memory", 0) or 0)
            if limit > 0 and used >= limit * self._max_memory_fraction:
                room = False
        self._memory_room = room

    async def _call(
        self, script: AsyncScript, key: str, quota: AnswerQuota | None, *args: EncodableT
    ) -> list[bytes] | int:
        index = self._index_key(key, quota)
        keys = [self._prefix + key, index + "|z", index + "|s"]
        async with asyncio.timeout(self._timeout_s):
            # redis-py leaves a script's reply untyped: these scripts answer a list or an int.
            return cast("list[bytes] | int", await script(keys=keys, args=list(args)))

    def _index_key(self, key: str, quota: AnswerQuota | None) -> str:
        if quota is None:
            return self._index_prefix + "none"
        return f"{self._index_prefix}{quota.namespace}|{quota.tenant}"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
