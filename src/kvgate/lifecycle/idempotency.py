"""Idempotency-Key: the first request with a key runs, duplicates get its answer.

Protocol-free: `IdempotencySource`, the first answer source, asks `claim_key` before
admission and gets either an `AnswerRecorder` (this request runs; it records the answer as
it passes and stores it at the end) or a `KeyOutcome` to answer with (the stored answer, or
why not). The store (`kvgate.cache.answers`) decides atomically, across replicas when it is
Redis.

Everything a key costs is the tenant's: the key and its answer count against the tenant's
idempotency quota, and a duplicate that waits holds one of the tenant's few waiting places.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvgate.cache.answers import (
    ANSWER_STORE_FAILURES,
    AnswerQuota,
    AnswerStore,
    ClaimState,
    StoredAnswer,
    StoreResult,
)
from kvgate.config.model import IdempotencyConfig
from kvgate.lifecycle.admission import Rejected, Rejection
from kvgate.lifecycle.answer_sources import (
    AnswerJudge,
    AnswerQuery,
    AnswerSource,
    Bypass,
    Hit,
    Miss,
    SourceName,
)
from kvgate.lifecycle.protocol import ClientError
from kvgate.metrics import Metrics
from kvgate.policy import ActualUsage, Reason, SettleCause

log = logging.getLogger(__name__)

# Duplicates poll the store this often while the first request runs (the store may be
# shared: another replica's completion sends no signal here).
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.25
# The store's namespace of idempotency keys (quotas are per tenant and namespace).
IDEMPOTENCY_NAMESPACE = "idempotency"
# Why a completed answer was not kept (a duplicate is told, and nothing runs again).
TOO_LARGE = "too_large"
OVER_QUOTA = "over_quota"
# A tenant with no room for another Idempotency-Key: when to try again (its oldest keys
# are not known to the replica; a minute is the scale on which keys and answers expire).
KEYS_EXHAUSTED_RETRY_S = 60


class KeyVerdict(enum.Enum):
    REPLAY = "replay"  # the stored answer
    NOT_KEPT = "not_kept"  # completed, its answer not kept: 409 naming why
    MISMATCH = "mismatch"  # the key was used with another body: 422
    IN_PROGRESS = "in_progress"  # still running after the wait bound: 409 + Retry-After
    TOO_MANY_WAITING = "too_many_waiting"  # the tenant's waiting places are taken: 429
    QUOTA_EXHAUSTED = "quota_exhausted"  # no room for another of the tenant's keys: 429


@dataclass(frozen=True, slots=True)
class KeyOutcome:
    verdict: KeyVerdict
    answer: StoredAnswer | None = None
    waited_s: float = 0.0


def scoped_key(tenant: str, key: str) -> str:
    """The store's key: a tenant's keys never meet another tenant's."""
    return hashlib.sha256(f"{tenant}\x00{key}".encode()).hexdigest()


class TenantWaiters:
    """How many duplicates of each tenant wait for a running request on this replica:
    bounded, so one tenant's retry storm cannot hold the event loop's polling for others."""

    def __init__(self) -> None:
        self._waiting: dict[str, int] = {}

    def enter(self, tenant: str, limit: int) -> bool:
        count = self._waiting.get(tenant, 0)
        if count >= limit:
            return False
        self._waiting[tenant] = count + 1
        return True

    def leave(self, tenant: str) -> None:
        count = self._waiting.get(tenant, 0) - 1
        if count > 0:
            self._waiting[tenant] = count
        else:
            self._waiting.pop(tenant, None)


class AnswerRecorder:
    """The request that runs for its key (an Idempotency-Key, or a response-cache entry):
    records what the client receives and, at the end, stores it (a 2xx answer complete by
    its API's grammar: `judge`, the request's `ApiProtocol.answer_defect`) or gives the key
    up (anything else).

    `keep_marker`: an answer that completed but cannot be kept (too large, over quota)
    leaves a marker, so that a duplicate is told so and never runs a second generation (an
    Idempotency-Key); without it the key is released (a cache entry is simply not made).
    `lock_ttl_s`: the lock's TTL, renewed every third of it while the request runs, so a
    generation longer than the TTL keeps its key."""

    def __init__(
        self,
        store: AnswerStore,
        key: str,
        owner: str,
        *,
        max_answer_bytes: int,
        retention_s: float,
        track: Callable[[Coroutine[Any, Any, None]], Any],
        judge: AnswerJudge,
        on_stored: Callable[[StoredAnswer], Awaitable[None]] | None = None,
        quota: AnswerQuota | None = None,
        keep_marker: bool = False,
        lock_ttl_s: float | None = None,
        on_not_kept: Callable[[str], None] | None = None,
        stream: bool | None = None,
    ) -> None:
        # `stream`: whether the request asked for a stream (its answer must be one); None:
        # the answer's own content type says which grammar it is held to.
        self._stream = stream
        self._judge = judge
        self._store = store
        self._on_stored = on_stored
        self._on_not_kept = on_not_kept
        self._key = key
        self._owner = owner
        self._max_answer_bytes = max_answer_bytes
        self._retention_s = retention_s
        self._track = track
        self._quota = quota
        self._keep_marker = keep_marker
        self._status = 0
        self._content_type = ""
        self._headers: tuple[tuple[str, str], ...] = ()
        self._body = bytearray()
        self._too_large = False
        self._done = False
        self._renewal: asyncio.Task[None] | None = None
        if lock_ttl_s is not None:
            self._renewal = asyncio.get_running_loop().create_task(self._keep_lock(lock_ttl_s))

    def describe(self, headers: dict[str, str]) -> None:
        """Headers that say how the answer was produced (a fallback, a clamp): kept with it
        and replayed."""
        self._headers = tuple(sorted(headers.items()))

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
        """The answer ended: keep it if it is whole and 2xx, else let a retry run anew. A
        2xx answer that is not complete by the API's grammar (an in-band error, no [DONE],
        an aborted choice, an HTML page...) is a failed one: `on_not_kept` names why."""
        if self._done:
            return
        self._done = True
        self._stop_renewal()
        defect = None
        if cause is SettleCause.COMPLETED and 200 <= self._status < 300 and not self._too_large:
            stream = self._stream
            if stream is None:
                stream = self._content_type.lower().startswith("text/event-stream")
            defect = self._judge(
                stream=stream,
                status=self._status,
                content_type=self._content_type,
                body=bytes(self._body),
            )
            if defect is not None:
                self._not_kept(defect.value)
        if cause is SettleCause.COMPLETED and 200 <= self._status < 300 and defect is None:
            answer = StoredAnswer(
                self._status,
                self._content_type,
                bytes(self._body),
                prompt_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.output_tokens if usage else 0,
                headers=self._headers,
            )
            self._track(self._complete(answer))
        else:
            self._track(self._release())

    def abandon(self) -> None:
        """Nothing was forwarded (refused, cancelled): the key is free again."""
        if not self._done:
            self._done = True
            self._stop_renewal()
            self._track(self._release())

    async def _complete(self, answer: StoredAnswer) -> None:
        marker = None
        if self._keep_marker:
            marker = answer.marker(TOO_LARGE if self._too_large else OVER_QUOTA)
        try:
            if self._too_large:
                # Completed, and charged: a duplicate must learn that, not run again.
                result = StoreResult.NOT_KEPT
                if marker is not None:
                    result = await self._store.complete(
                        self._key, self._owner, marker, self._retention_s, quota=self._quota
                    )
                else:
                    await self._release()
                self._not_kept(TOO_LARGE)
                return
            result = await self._store.complete(
                self._key,
                self._owner,
                answer,
                self._retention_s,
                quota=self._quota,
                marker=marker,
            )
        except Exception:
            # The lock expires on its own; duplicates then run anew.
            await self._release()
            return
        if result is StoreResult.NOT_KEPT:
            self._not_kept(OVER_QUOTA)
        if result is StoreResult.STORED and self._on_stored is not None:
            try:
                await self._on_stored(answer)
            except Exception as exc:
                # Not indexed: the stored answer is never found and expires.
                log.warning("after storing an answer: %s", exc)

    def _not_kept(self, reason: str) -> None:
        if self._on_not_kept is not None:
            self._on_not_kept(reason)

    async def _release(self) -> None:
        try:
            await self._store.release(self._key, self._owner, quota=self._quota)
        except Exception:
            return  # the lock's TTL frees it

    async def _keep_lock(self, lock_ttl_s: float) -> None:
        while True:
            await asyncio.sleep(lock_ttl_s / 3)
            try:
                held = await self._store.renew(
                    self._key, self._owner, lock_ttl_s, quota=self._quota
                )
            except Exception as exc:
                log.warning("could not renew an idempotency key's lock: %s", exc)
                continue
            if not held:
                return

    def _stop_renewal(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None


def idempotency_quota(settings: IdempotencyConfig, tenant: str) -> AnswerQuota:
    return AnswerQuota(IDEMPOTENCY_NAMESPACE, tenant, settings.tenant_max_bytes)


async def claim_key(
    store: AnswerStore,
    settings: IdempotencyConfig,
    *,
    tenant: str,
    key: str,
    fingerprint: str,
    owner: str,
    lock_ttl_s: float,
    on_wait: Callable[[float], None],
    track: Callable[[Coroutine[Any, Any, None]], Any],
    waiters: TenantWaiters,
    judge: AnswerJudge,
    on_not_kept: Callable[[str], None] | None = None,
    stream: bool | None = None,
) -> AnswerRecorder | KeyOutcome:
    """Run, replay, or refuse. A duplicate of a running request waits (polling the store,
    at most `settings.max_wait_s`, in one of the tenant's `max_waiting_per_tenant` places;
    `on_wait(max_wait_s)` is called once when it starts waiting) and then replays, or runs
    itself if the first attempt gave up. `fingerprint` is the request body's digest; `judge`
    the request's API's completeness rule (what the recorder keeps)."""
    store_key = scoped_key(tenant, key)
    quota = idempotency_quota(settings, tenant)
    started = time.monotonic()
    delay = POLL_FIRST_S
    waiting = False
    try:
        while True:
            claim = await store.claim(store_key, fingerprint, owner, lock_ttl_s, quota=quota)
            waited = time.monotonic() - started
            if claim.state is ClaimState.OVER_QUOTA:
                return KeyOutcome(KeyVerdict.QUOTA_EXHAUSTED, waited_s=waited)
            if claim.fingerprint != fingerprint:
                return KeyOutcome(KeyVerdict.MISMATCH, waited_s=waited)
            if claim.state is ClaimState.STARTED:
                return AnswerRecorder(
                    store,
                    store_key,
                    owner,
                    max_answer_bytes=settings.max_answer_bytes,
                    retention_s=settings.retention_s,
                    track=track,
                    judge=judge,
                    quota=quota,
                    keep_marker=True,
                    lock_ttl_s=lock_ttl_s,
                    on_not_kept=on_not_kept,
                    stream=stream,
                )
            if claim.state is ClaimState.COMPLETED:
                assert claim.answer is not None
                if claim.answer.not_kept:
                    return KeyOutcome(KeyVerdict.NOT_KEPT, claim.answer, waited)
                return KeyOutcome(KeyVerdict.REPLAY, claim.answer, waited)
            if waited >= settings.max_wait_s:
                return KeyOutcome(KeyVerdict.IN_PROGRESS, waited_s=waited)
            if not waiting:
                if not waiters.enter(tenant, settings.max_waiting_per_tenant):
                    return KeyOutcome(KeyVerdict.TOO_MANY_WAITING, waited_s=waited)
                waiting = True
                on_wait(settings.max_wait_s)
            await asyncio.sleep(min(delay, max(0.0, settings.max_wait_s - waited)))
            delay = min(delay * 2, POLL_MAX_S)
    finally:
        if waiting:
            waiters.leave(tenant)


class IdempotencySource(AnswerSource):
    """A request with an Idempotency-Key: it runs (its recorder keeps whatever answers it),
    replays the key's stored answer, or is refused: 422 for another body under the key,
    409 while the first request still runs or when its answer was not kept, 429 when the
    tenant has no room for another key or waiter."""

    name = SourceName.IDEMPOTENCY

    def __init__(
        self,
        store: AnswerStore,
        waiters: TenantWaiters,
        metrics: Metrics,
        track: Callable[[Coroutine[Any, Any, None]], Any],
    ) -> None:
        self._store = store
        self._waiters = waiters
        self._metrics = metrics
        self._track = track

    def applies(self, query: AnswerQuery) -> bool:
        return query.sees_answer and query.idempotency_key is not None

    async def lookup(self, query: AnswerQuery, digest: str) -> Hit | Miss | Bypass:
        assert query.idempotency_key is not None
        config = query.snapshot.config
        metrics = self._metrics
        errors = query.errors
        try:
            outcome = await claim_key(
                self._store,
                config.idempotency,
                tenant=query.tenant.name,
                key=query.idempotency_key,
                fingerprint=digest,
                owner=query.owner,
                lock_ttl_s=config.server.lease_ttl_s,
                on_wait=query.on_wait,
                track=self._track,
                waiters=self._waiters,
                judge=query.answer_defect,
                on_not_kept=lambda why: metrics.answers_not_stored.labels(why).inc(),
                stream=query.request.stream,
            )
        except ANSWER_STORE_FAILURES as exc:
            if config.uses_redis and config.redis.failure_policy == "fail_closed":
                raise Rejected(
                    Rejection(
                        Reason.STORE_UNAVAILABLE,
                        "kvgate cannot reach its shared state store to check this "
                        "Idempotency-Key. Please retry.",
                        retry_after_s=config.redis.unavailable_retry_after_s,
                    )
                ) from exc
            # fail_open: the request runs without its key's protection (counted): a retry
            # while the store is down may run again, and is charged again.
            metrics.idempotent_requests.labels("unchecked").inc()
            log.warning("idempotency store unavailable; the request runs unchecked: %s", exc)
            return Bypass()
        if isinstance(outcome, AnswerRecorder):
            metrics.idempotent_requests.labels("started").inc()
            return Miss(outcome, keeps_any_answer=True)
        metrics.idempotent_requests.labels(outcome.verdict.value).inc()
        answer = outcome.answer
        if outcome.verdict is KeyVerdict.REPLAY:
            assert answer is not None
            return Hit(
                answer,
                {**dict(answer.headers), "idempotent-replayed": "true"},
                reason="idempotent_replay",
            )
        if outcome.verdict is KeyVerdict.NOT_KEPT:
            assert answer is not None
            raise ClientError(errors.idempotency_answer_not_kept(answer.not_kept))
        if outcome.verdict is KeyVerdict.MISMATCH:
            raise ClientError(errors.idempotency_key_reused())
        if outcome.verdict is KeyVerdict.TOO_MANY_WAITING:
            raise ClientError(errors.idempotency_waiters_exceeded(retry_after_s=1))
        if outcome.verdict is KeyVerdict.QUOTA_EXHAUSTED:
            metrics.answers_not_stored.labels("no_room").inc()
            raise ClientError(
                errors.idempotency_keys_exhausted(retry_after_s=KEYS_EXHAUSTED_RETRY_S)
            )
        raise ClientError(errors.idempotency_key_in_progress(retry_after_s=1))
