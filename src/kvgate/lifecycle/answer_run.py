"""One request's walk through the answer sources (``answer_sources``), and the recorders
that keep its answer while it runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.lifecycle.admission import Rejected, rejection_of
from kvgate.lifecycle.answer_sources import AnswerQuery, AnswerSource, Hit, Miss, SourceName
from kvgate.lifecycle.idempotency import AnswerRecorder
from kvgate.lifecycle.response_cache import CacheResult, charge_hit
from kvgate.lifecycle.usage_report import record_cache_hit
from kvgate.metrics import Metrics
from kvgate.policy import ActualUsage, Clock, SettleCause
from kvgate.store import StateStore, StoreUnavailable
from kvgate.usage_records.facts import RequestFacts, served_record
from kvgate.usage_records.record import AnswerSource as RecordSource
from kvgate.usage_records.record import UsageRecord

log = logging.getLogger("kvgate.answers")

Track = Callable[[Coroutine[Any, Any, None]], Any]

# Who answered, in a usage record, by the source that served a stored answer.
_RECORD_SOURCES = {
    SourceName.IDEMPOTENCY: RecordSource.IDEMPOTENT_REPLAY,
    SourceName.EXACT_CACHE: RecordSource.EXACT_CACHE,
    SourceName.SEMANTIC_CACHE: RecordSource.SEMANTIC_CACHE,
}


@dataclass(slots=True)
class AnswerRun:
    """One request's walk through the answer sources, and what keeps its answer."""

    sources: Sequence[AnswerSource]
    store: StateStore
    clock: Clock
    metrics: Metrics
    track: Track
    recorders: list[AnswerRecorder] = field(default_factory=list)
    # This request's Idempotency-Key recorder (among recorders), if it runs for a key.
    key_recorder: AnswerRecorder | None = None
    # x-kvgate-cache on the forwarded answer: hit | miss | bypass.
    cache_header: str = CacheResult.BYPASS.value
    # Takes the usage record of a served stored answer (None: records are off), and what
    # the exchange knows of the request for it (read when a hit is served).
    usage_records: Callable[[UsageRecord], None] | None = None
    request_facts: Callable[[], RequestFacts] | None = None

    async def lookup(self, query: AnswerQuery, digest: str) -> Hit | None:
        """Ask each source in turn: the first hit, charged and booked (None: the request
        runs, with the recorders the misses left). A refusal abandons every recorder."""
        try:
            for source in self.sources:
                outcome = await source.lookup(query, digest)
                if isinstance(outcome, Hit):
                    await self._serve(query, outcome)
                    self._record(query, outcome, source.name)
                    return outcome
                if outcome.cache_header is not None:
                    self.cache_header = outcome.cache_header
                if isinstance(outcome, Miss):
                    self.recorders.append(outcome.recorder)
                    if outcome.keeps_any_answer:
                        self.key_recorder = outcome.recorder
        except BaseException:
            self.abandon()
            raise
        return None

    async def _serve(self, query: AnswerQuery, hit: Hit) -> None:
        """A hit: charged as its source says and booked in the ledger (a replay was charged
        when it ran); it completes the request's Idempotency-Key too, and gives up any
        cache entry this request would have made (a similar question's answer is not the
        exact answer to this one)."""
        charge = hit.charge
        if charge is not None:
            request = query.request
            route = query.snapshot.models.get(request.model)
            answer = hit.answer
            if charge.mode == "full" and route is not None:
                decision = await charge_hit(
                    self.store, query.tenant, route, answer, query.owner, request_slot_taken=True
                )
                if not decision.admitted:
                    raise Rejected(rejection_of(decision))
            saved = answer.prompt_tokens + answer.output_tokens
            charge.saved_tokens.labels(query.tenant.name, request.model).inc(saved)
            self.track(self._book_hit(query.tenant.name, request.model, saved))
        for recorder in self.recorders:
            if recorder is not self.key_recorder:
                recorder.abandon()
                continue
            recorder.on_headers(hit.answer.status, hit.answer.content_type)
            recorder.on_chunk(hit.answer.body)
            recorder.finish(SettleCause.COMPLETED)
        self.recorders.clear()

    def _record(self, query: AnswerQuery, hit: Hit, source: str) -> None:
        """The usage record of a served stored answer (never fails the answer)."""
        if self.usage_records is None:
            return
        try:
            request = query.request
            route = query.snapshot.models.get(request.model)
            charge = hit.charge
            record = served_record(
                record_id=query.owner,
                facts=self.request_facts() if self.request_facts is not None else None,
                tenant=query.tenant.name,
                path=request.path,
                model=request.model,
                source=_RECORD_SOURCES.get(SourceName(source), RecordSource.EXACT_CACHE),
                status=hit.answer.status,
                prompt_tokens=hit.answer.prompt_tokens,
                output_tokens=hit.answer.output_tokens,
                pricing=route.pricing if route is not None else None,
                booked_request=charge is not None and charge.mode == "full" and route is not None,
                cache_hit=charge is not None,
                wall=self.clock.wall(),
            )
            self.usage_records(record)
        except Exception:
            log.exception("no usage record for a served stored answer")

    async def _book_hit(self, tenant: str, model: str, saved_tokens: int) -> None:
        """The ledger records the hit and the tokens it saved (after the answer: a store
        that is slow or down delays and fails no hit)."""
        try:
            await record_cache_hit(self.store, self.clock, tenant, model, saved_tokens)
        except StoreUnavailable as exc:
            log.warning("a cache hit was not booked in the ledger: %s", exc)

    def keep_what_serves(self, describing: Mapping[str, str]) -> None:
        """What is stored must be what was asked: an answer from another model (a budget
        fallback) or with fewer tokens (a clamp), named by ``describing``'s headers, is
        kept for the Idempotency-Key (with those headers, replayed) but never cached as
        the request's answer."""
        if not describing:
            return
        kept: list[AnswerRecorder] = []
        for recorder in self.recorders:
            if recorder is self.key_recorder:
                recorder.describe(dict(describing))
                kept.append(recorder)
            else:
                recorder.abandon()
                self.metrics.answers_not_stored.labels("served_otherwise").inc()
        if len(kept) != len(self.recorders):
            self.cache_header = CacheResult.BYPASS.value
        self.recorders = kept

    # -- the forwarded answer, seen by every recorder ---------------------------------------

    def on_headers(self, status: int, content_type: str) -> None:
        for recorder in self.recorders:
            recorder.on_headers(status, content_type)

    def on_chunk(self, chunk: bytes) -> None:
        for recorder in self.recorders:
            recorder.on_chunk(chunk)

    def finish(self, cause: SettleCause, charged: ActualUsage | None) -> None:
        for recorder in self.recorders:
            recorder.finish(cause, charged)

    def abandon(self) -> None:
        """Nothing ran, or the answer was cut: a retry with the key runs anew."""
        for recorder in self.recorders:
            recorder.abandon()
        self.recorders.clear()
