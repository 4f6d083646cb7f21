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
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """What the client received: replayed byte for byte."""

    status: int
    content_type: str
    body: bytes
    # What producing it took (kvgate's settlement): what a cache hit saves, or is charged.
    prompt_tokens: int = 0
    output_tokens: int = 0

    def encode(self) -> bytes:
        head = json.dumps(
            {
                "s": self.status,
                "t": self.content_type,
                "p": self.prompt_tokens,
                "o": self.output_tokens,
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
        )


class ClaimState(enum.Enum):
    # This caller holds the key now: it runs the request.
    STARTED = "started"
    # Another caller runs it.
    IN_FLIGHT = "in_flight"
    # It ran to completion; the answer is stored.
    COMPLETED = "completed"


@dataclass(frozen=True, slots=True)
class Claim:
    state: ClaimState
    # The fingerprint of the request that holds or completed the key.
    fingerprint: str
    answer: StoredAnswer | None = None


class AnswerStore(Protocol):
    async def claim(self, key: str, fingerprint: str, owner: str, lock_ttl_s: float) -> Claim:
        """Atomically: the stored answer if the key completed; who runs it if another owner's
        lock is alive; else lock it for `owner` (STARTED)."""
        ...

    async def complete(
        self, key: str, owner: str, answer: StoredAnswer, retention_s: float
    ) -> bool:
        """Store the answer for `retention_s` and drop the lock, if `owner` still holds it."""
        ...

    async def release(self, key: str, owner: str) -> None:
        """`owner` gives the key up (failed or cut): nothing stored, the next claim runs."""
        ...

    async def close(self) -> None: ...


class MemoryAnswerStore:
    """One process's keys, bounded in bytes (least recently used dropped first)."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_bytes = max_bytes
        self._clock = clock
        # key -> (fingerprint, owner or "", expires_at, answer or None)
        self._entries: OrderedDict[str, tuple[str, str, float, StoredAnswer | None]] = OrderedDict()
        self._bytes = 0

    async def claim(self, key: str, fingerprint: str, owner: str, lock_ttl_s: float) -> Claim:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[2] > now:
            held_fp, held_owner, _, answer = entry
            self._entries.move_to_end(key)
            if answer is not None:
                return Claim(ClaimState.COMPLETED, held_fp, answer)
            if held_owner != owner:
                return Claim(ClaimState.IN_FLIGHT, held_fp)
        self._put(key, (fingerprint, owner, now + lock_ttl_s, None))
        return Claim(ClaimState.STARTED, fingerprint)

    async def complete(
        self, key: str, owner: str, answer: StoredAnswer, retention_s: float
    ) -> bool:
        entry = self._entries.get(key)
        if entry is None or entry[1] != owner or entry[3] is not None:
            return False
        self._put(key, (entry[0], "", self._clock() + retention_s, answer))
        return True

    async def release(self, key: str, owner: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[1] == owner and entry[3] is None:
            self._drop(key)

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _put(self, key: str, entry: tuple[str, str, float, StoredAnswer | None]) -> None:
        self._drop(key)
        self._entries[key] = entry
        self._bytes += _size(key, entry[3])
        while self._bytes > self._max_bytes and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            self._drop(oldest)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= _size(key, entry[3])


def _size(key: str, answer: StoredAnswer | None) -> int:
    return 200 + len(key) + (len(answer.body) if answer is not None else 0)


# KEYS[1] the key's hash. ARGV: fingerprint, owner, lock TTL (ms). Returns
# {state, fingerprint, answer}.
_CLAIM = """
local h = redis.call('HMGET', KEYS[1], 'fp', 'owner', 'answer')
if h[1] then
  if h[3] then
    return {'completed', h[1], h[3]}
  end
  if h[2] ~= ARGV[2] then
    return {'in_flight', h[1], false}
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'owner', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'started', ARGV[1], false}
"""

# KEYS[1]; ARGV: owner, answer, retention (ms). 1 if stored.
_COMPLETE = """
local h = redis.call('HMGET', KEYS[1], 'owner', 'answer')
if h[1] ~= ARGV[1] or h[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'answer', ARGV[2])
redis.call('HDEL', KEYS[1], 'owner')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1]; ARGV: owner.
_RELEASE = """
local h = redis.call('HMGET', KEYS[1], 'owner', 'answer')
if h[1] == ARGV[1] and not h[2] then
  redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisAnswerStore:
    """Keys shared by every kvgate replica, in the state store's Redis (its hash tag, so a
    Redis Cluster keeps them in the same slot as the rest of kvgate's keys)."""

    def __init__(
        self, client: aioredis.Redis | RedisCluster, key_tag: str, timeout_s: float
    ) -> None:
        self._client = client
        self._prefix = f"{key_tag}:idem|"
        self._timeout_s = timeout_s
        self._claim = client.register_script(_CLAIM)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)

    async def claim(self, key: str, fingerprint: str, owner: str, lock_ttl_s: float) -> Claim:
        state, held_fp, answer = await self._call(
            self._claim, key, fingerprint, owner, max(1, round(lock_ttl_s * 1000))
        )
        fp = _text(held_fp)
        if _text(state) == "completed":
            return Claim(ClaimState.COMPLETED, fp, StoredAnswer.decode(bytes(answer)))
        if _text(state) == "in_flight":
            return Claim(ClaimState.IN_FLIGHT, fp)
        return Claim(ClaimState.STARTED, fp)

    async def complete(
        self, key: str, owner: str, answer: StoredAnswer, retention_s: float
    ) -> bool:
        stored = await self._call(
            self._complete, key, owner, answer.encode(), max(1, round(retention_s * 1000))
        )
        return bool(stored)

    async def release(self, key: str, owner: str) -> None:
        await self._call(self._release, key, owner)

    async def close(self) -> None:
        return None  # the client belongs to the state store

    async def _call(self, script: object, key: str, *args: object) -> list[bytes] | int:
        async with asyncio.timeout(self._timeout_s):
            return await script(keys=[self._prefix + key], args=list(args))  # type: ignore[operator]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
