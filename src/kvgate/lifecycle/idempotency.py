"""Idempotency-Key: the first request with a key runs, duplicates get its answer.

Protocol-free: the adapter asks `claim_key` before admission and gets either an
`AnswerRecorder` (this request runs; it records the answer as it passes and stores it at
the end) or a `KeyOutcome` to answer with (the stored answer, or why not). The store
(`kvgate.cache.answers`) decides atomically, across replicas when it is Redis.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvgate.cache.answers import AnswerStore, ClaimState, StoredAnswer
from kvgate.config.model import IdempotencyConfig
from kvgate.policy import ActualUsage, SettleCause

log = logging.getLogger(__name__)

# Duplicates poll the store this often while the first request runs (the store may be
# shared: another replica's completion sends no signal here).
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.25


class KeyVerdict(enum.Enum):
    REPLAY = "replay"  # the stored answer
    MISMATCH = "mismatch"  # the key was used with another body: 422
    IN_PROGRESS = "in_progress"  # still running after the wait bound: 409 + Retry-After


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    verdict: KeyVerdict
    answer: StoredAnswer | None = None
    waited_s: float = 0.0


def scoped_key(tenant: str, key: str) -> str:
    """The store's key: a tenant's keys never meet another tenant's."""
    return hashlib.sha256(f"{tenant}\x00{key}".encode()).hexdigest()


def fingerprint(body: dict[str, Any]) -> str:
    """The request as the key protects it: the parsed body, key order and spacing aside."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


class AnswerRecorder:
    """The request that runs for its key (an Idempotency-Key, or a response-cache entry):
    records what the client receives and, at the end, stores it (a complete 2xx answer)
    or gives the key up (anything else)."""

    def __init__(
        self,
        store: AnswerStore,
        key: str,
        owner: str,
        *,
        max_answer_bytes: int,
        retention_s: float,
        track: Callable[[Coroutine[Any, Any, None]], Any],
        on_stored: Callable[[StoredAnswer], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._on_stored = on_stored
        self._key = key
        self._owner = owner
        self._max_answer_bytes = max_answer_bytes
        self._retention_s = retention_s
        self._track = track
        self._status = 0
        self._content_type = ""
        self._body = bytearray()
        self._too_large = False
        self._done = False

    def on_headers(self, status: int, content_type: str) -> None:
        self._status, self._content_type = status, content_type

    def on_chunk(self, chunk: bytes) -> None:
        if self._too_large:
            return
        if len(self._body) + len(chunk) > self._max_answer_bytes:
            self._too_large = True
            self._body = bytearray()
            return
        self._body += chunk

    def finish(self, cause: SettleCause, usage: ActualUsage | None = None) -> None:
        """The answer ended: keep it if it is whole and 2xx, else let a retry run anew."""
        if self._done:
            return
        self._done = True
        if cause is SettleCause.COMPLETED and 200 <= self._status < 300 and not self._too_large:
            answer = StoredAnswer(
                self._status,
                self._content_type,
                bytes(self._body),
                prompt_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.output_tokens if usage else 0,
            )
            self._track(self._complete(answer))
        else:
            self._track(self._release())

    def abandon(self) -> None:
        """Nothing was forwarded (refused, cancelled): the key is free again."""
        if not self._done:
            self._done = True
            self._track(self._release())

    async def _complete(self, answer: StoredAnswer) -> None:
        try:
            stored = await self._store.complete(self._key, self._owner, answer, self._retention_s)
        except Exception:
            # The lock expires on its own; duplicates then run anew.
            await self._release()
            return
        if stored and self._on_stored is not None:
            try:
                await self._on_stored(answer)
            except Exception as exc:
                # Not indexed: the stored answer is never found and expires.
                log.warning("after storing an answer: %s", exc)

    async def _release(self) -> None:
        try:
            await self._store.release(self._key, self._owner)
        except Exception:
            return  # the lock's TTL frees it


async def claim_key(
    store: AnswerStore,
    settings: IdempotencyConfig,
    *,
    tenant: str,
    key: str,
    body: dict[str, Any],
    owner: str,
    lock_ttl_s: float,
    on_wait: Callable[[float], None],
    track: Callable[[Coroutine[Any, Any, None]], Any],
) -> AnswerRecorder | KeyOutcome:
    """Run, replay, or refuse. A duplicate of a running request waits (polling the store,
    at most `settings.max_wait_s`; `on_wait(max_wait_s)` is called once when it starts
    waiting) and then replays, or runs itself if the first attempt gave up."""
    store_key = scoped_key(tenant, key)
    fp = fingerprint(body)
    started = time.monotonic()
    delay = POLL_FIRST_S
    waiting = False
    while True:
        claim = await store.claim(store_key, fp, owner, lock_ttl_s)
        waited = time.monotonic() - started
        if claim.fingerprint != fp:
            return KeyOutcome(KeyVerdict.MISMATCH, waited_s=waited)
        if claim.state is ClaimState.STARTED:
            return AnswerRecorder(
                store,
                store_key,
                owner,
                max_answer_bytes=settings.max_answer_bytes,
                retention_s=settings.retention_s,
                track=track,
            )
        if claim.state is ClaimState.COMPLETED:
            return KeyOutcome(KeyVerdict.REPLAY, claim.answer, waited)
        if waited >= settings.max_wait_s:
            return KeyOutcome(KeyVerdict.IN_PROGRESS, waited_s=waited)
        if not waiting:
            waiting = True
            on_wait(settings.max_wait_s)
        await asyncio.sleep(min(delay, max(0.0, settings.max_wait_s - waited)))
        delay = min(delay * 2, POLL_MAX_S)
