"""The semantic cache: a similar question, asked in the same context -> the stored answer.

Its rules are written in chat/completions' grammar (messages or a prompt, tool calls, echo
and logprob fields), so it serves those APIs only: an API names the sources it allows
(``ApiProtocol.answer_sources``), and the agent APIs leave this one out (docs/caching.md
says why). Reuse must be safe by construction, so a request is looked up only when
everything but its last user turn is identical to the stored one's (the *context*: scope,
path, model, system prompt and history, every parameter, `stream` included), the last turn
is plain text, and nothing in it can make the answer depend on more than the question:
no tools or tool calls (unless the operator allows them), no echo of the prompt, no prompt
logprobs, no images. Within a context, a stored question answers a new one when their
vectors' cosine similarity reaches the threshold AND the lexical guard agrees (the same
numbers, negations and content words; `kvgate.cache.semantic_guard`): the embedding finds
candidates, the guard refuses the near misses an embedding cannot tell apart (docs/
semantic-cache.md has the measured curve).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from kvgate.cache.answers import AnswerQuota, AnswerStore, ClaimState, StoredAnswer
from kvgate.cache.embeddings import (
    Embedder,
    EmbeddingError,
    OpenAIEmbeddingsClient,
    WordLlamaEmbedder,
)
from kvgate.cache.semantic import Candidate, EntryLog, SemanticEntry, SemanticIndex
from kvgate.cache.semantic_guard import GuardLevel, guard_allows, refusal_reason
from kvgate.config.model import ConfigError, ModelConfig, SemanticCacheConfig, TenantConfig
from kvgate.lifecycle.answer_sources import (
    AnswerJudge,
    AnswerQuery,
    AnswerSource,
    Bypass,
    Hit,
    HitCharge,
    Miss,
    SourceName,
)
from kvgate.lifecycle.idempotency import AnswerRecorder
from kvgate.lifecycle.response_cache import (
    CACHE_HEADER,
    SHARED_SCOPE,
    CacheResult,
    cache_quota,
    cache_scope,
    deterministic,
)
from kvgate.metrics import Metrics
from kvgate.openai import ParsedRequest

log = logging.getLogger(__name__)

# The measured default for WordLlama (`l2_supercat`, 256 dimensions) with the strict guard:
# the threshold with the highest recall whose false-hit rate on the project's paraphrase
# corpus is at most 1 % (tools/semantic_threshold.py; a test checks it against its results).
# The numbers guard's measured 0.97 clears the nearest wrong pair by only 0.002: no default,
# the operator sets it, as for no guard or another embedder.
DEFAULT_THRESHOLDS: dict[GuardLevel, float] = {GuardLevel.STRICT: 0.71}

# Stored questions above the threshold checked by the guard, best first: the rest are less
# similar still, and each costs a guard check and an answer fetch.
MAX_CANDIDATES = 4
# On a semantic hit in the tenant's own scope: the cosine similarity of the stored question.
SIMILARITY_HEADER = "x-kvgate-cache-similarity"

# Request fields that make the answer depend on more than the question (or echo the stored
# prompt back): never looked up.
_TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")
_PROMPT_ECHO_FIELDS = ("echo", "prompt_logprobs", "return_tokens_as_token_ids")


class SemanticResult(enum.StrEnum):
    HIT = "semantic-hit"
    MISS = "miss"
    BYPASS = "bypass"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class SemanticQuery:
    context: str  # hash of everything but the last user turn
    question: str  # the last user turn's text
    stream: bool = False  # the request asked for a stream: its answer must be one


@dataclass(frozen=True, slots=True)
class SemanticLookup:
    result: SemanticResult
    answer: StoredAnswer | None = None
    similarity: float = 0.0
    recorder: AnswerRecorder | None = None
    guard_refusals: int = 0
    bypass_reason: str | None = None  # why the question itself was not compared


class SemanticCache:
    """What a lookup needs at run time: the embedder, the index and the answers' store."""

    def __init__(self, embedder: Embedder, index: SemanticIndex, answers: AnswerStore) -> None:
        self.embedder = embedder
        self.index = index
        self.answers = answers

    async def close(self) -> None:
        await self.embedder.close()
        await self.index.log.close()


def threshold_of(settings: SemanticCacheConfig) -> float:
    if settings.threshold is not None:
        return settings.threshold
    return DEFAULT_THRESHOLDS[GuardLevel(settings.guard)]


def applies(
    settings: SemanticCacheConfig, tenant: TenantConfig | None, model: ModelConfig | None
) -> bool:
    """Both the tenant and the model opted in (and the cache is on)."""
    return (
        settings.enabled
        and tenant is not None
        and tenant.semantic_cache
        and model is not None
        and model.semantic_cache
    )


def semantic_query(
    request: ParsedRequest, scope: str, settings: SemanticCacheConfig, generation: str = ""
) -> SemanticQuery | None:
    """The context and the question, or None when reuse would not be safe by construction.
    `request` is a chat or completions request (the APIs this cache serves), whose `body`
    is the client's own. `scope` is whose entries the request meets
    (`response_cache.cache_scope`); `generation` is the model's `cache_generation` (a new
    one orphans every entry)."""
    body = request.body
    if not settings.sampled and not deterministic(body):
        return None
    if any(body.get(name) for name in _PROMPT_ECHO_FIELDS):
        return None
    if not settings.allow_tools and any(name in body for name in _TOOL_FIELDS):
        return None
    context_body = dict(body)
    if request.kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "user":
            return None
        if not settings.allow_tools and any(_uses_tools(m) for m in messages):
            return None
        question = _plain_text(last.get("content"))
        if question is None:
            return None
        # The history must be identical, the last turn only similar: keep everything of the
        # last message but its content (a `name` on it still has to match).
        context_body["messages"] = [*messages[:-1], {**last, "content": None}]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        question = prompt
        context_body["prompt"] = None
    question = question.strip()
    if not question or len(question) > settings.max_question_chars:
        return None
    canonical = json.dumps(context_body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256()
    digest.update(f"{scope}\x00{request.path}\x00{request.model}\x00{generation}\x00".encode())
    digest.update(canonical.encode())
    return SemanticQuery(context=digest.hexdigest(), question=question, stream=request.stream)


def _uses_tools(message: object) -> bool:
    if not isinstance(message, dict):
        return True
    return message.get("role") in ("tool", "function") or bool(
        message.get("tool_calls") or message.get("function_call")
    )


def _plain_text(content: object) -> str | None:
    """The text of a message's content: a string, or text parts only (an image or audio
    part makes the question more than its words)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


async def lookup(
    cache: SemanticCache,
    settings: SemanticCacheConfig,
    query: SemanticQuery,
    *,
    owner: str,
    lock_ttl_s: float,
    track: Callable[[Coroutine[Any, Any, None]], Any],
    judge: AnswerJudge,
    quota: AnswerQuota | None = None,
    tenant: str = "",
    on_not_kept: Callable[[str], None] | None = None,
) -> SemanticLookup:
    """A stored answer to a similar question (a hit), or a recorder that stores and indexes
    this request's answer when it completes (a miss; complete by `judge`, the request's
    API's rule), in the tenant's `quota`. Any failure
    of the embedder or the store: UNAVAILABLE, and the request runs uncached."""
    refusal = refusal_reason(query.question)
    if refusal is not None:
        # Text the guard cannot see but the model reads: never compared, never stored.
        return SemanticLookup(SemanticResult.BYPASS, bypass_reason=refusal.value)
    try:
        vectors = await cache.embedder.embed([query.question], tenant=tenant)
    except EmbeddingError as exc:
        log.info("semantic cache: no vector for this question: %s", exc)
        return SemanticLookup(SemanticResult.UNAVAILABLE)
    vector = vectors[0]
    if not np.any(vector):
        return SemanticLookup(SemanticResult.BYPASS)  # nothing meaningful to compare
    threshold = threshold_of(settings)
    level = GuardLevel(settings.guard)
    try:
        candidates = await cache.index.search(
            query.context, vector, min_similarity=threshold, limit=MAX_CANDIDATES
        )
        refused = 0
        for candidate in candidates:
            if not guard_allows(candidate.entry.question, query.question, level):
                refused += 1
                continue
            answer = await _stored_answer(cache, query, candidate, owner, lock_ttl_s)
            if answer is not None:
                return SemanticLookup(
                    SemanticResult.HIT,
                    answer=answer,
                    similarity=candidate.similarity,
                    guard_refusals=refused,
                )
        answer_key = f"semantic|{uuid.uuid4().hex}"
        claim = await cache.answers.claim(answer_key, query.context, owner, lock_ttl_s, quota=quota)
    except (TimeoutError, RedisError, OSError) as exc:
        log.warning("semantic cache store unavailable; the request runs uncached: %s", exc)
        return SemanticLookup(SemanticResult.UNAVAILABLE)
    if claim.state is not ClaimState.STARTED:
        return SemanticLookup(SemanticResult.BYPASS, guard_refusals=refused)

    async def index_answer(_: StoredAnswer) -> None:
        entry = SemanticEntry(
            answer_key=answer_key,
            question=query.question,
            vector=vector,
            expires_at=time.time() + settings.ttl_s,
        )
        await cache.index.add(query.context, entry, settings.ttl_s)

    recorder = AnswerRecorder(
        cache.answers,
        answer_key,
        owner,
        max_answer_bytes=settings.max_answer_bytes,
        retention_s=settings.ttl_s,
        track=track,
        judge=judge,
        on_stored=index_answer,
        quota=quota,
        stream=query.stream,
        on_not_kept=on_not_kept,
    )
    return SemanticLookup(SemanticResult.MISS, recorder=recorder, guard_refusals=refused)


async def _stored_answer(
    cache: SemanticCache,
    query: SemanticQuery,
    candidate: Candidate,
    owner: str,
    lock_ttl_s: float,
) -> StoredAnswer | None:
    """The candidate's answer, if the store still has it (it may have expired or been
    evicted before the index entry did)."""
    key = candidate.entry.answer_key
    claim = await cache.answers.claim(key, query.context, owner, lock_ttl_s)
    if claim.state is ClaimState.COMPLETED:
        return claim.answer
    if claim.state is ClaimState.STARTED:
        await cache.answers.release(key, owner)  # the claim took a lock on nothing: undo
        cache.index.forget(query.context, key)
    return None


def build_semantic_cache(
    settings: SemanticCacheConfig, answers: AnswerStore, entries: EntryLog
) -> SemanticCache:
    """The embedder the config names (loaded now: WordLlama reads its weights once), over
    the given answer store and entry log."""
    spec = settings.embedder
    embedder: Embedder
    if spec.kind == "wordllama":
        try:
            embedder = WordLlamaEmbedder(
                dimensions=spec.dimensions,
                max_queued_per_tenant=spec.max_queued_per_tenant,
                deadline_s=spec.timeout_s,
            )
        except (EmbeddingError, ImportError) as exc:
            raise ConfigError(
                f"semantic_cache.embedder wordllama cannot load: {exc} "
                "(install kvgate's `semantic` extra)"
            ) from exc
    else:
        assert spec.base_url is not None and spec.model is not None
        api_key = None
        if spec.api_key_env is not None:
            api_key = os.environ.get(spec.api_key_env)
            if not api_key:
                raise ConfigError(
                    f"semantic_cache.embedder.api_key_env: ${spec.api_key_env} is not set"
                )
        embedder = OpenAIEmbeddingsClient(
            spec.base_url,
            spec.model,
            dimensions=spec.dimensions,
            api_key=api_key,
            send_dimensions=spec.send_dimensions,
            timeout_s=spec.timeout_s,
            connect_timeout_s=min(spec.timeout_s, 0.5),
            max_queued_per_tenant=spec.max_queued_per_tenant,
        )
    index = SemanticIndex(
        entries,
        dimensions=embedder.dimensions,
        max_entries_per_context=settings.max_entries_per_context,
        max_mirrored_bytes=settings.mirror_max_bytes,
    )
    return SemanticCache(embedder, index, answers)


class SemanticCacheSource(AnswerSource):
    """The semantic cache as an answer source: a similar question's stored answer, asked in
    the same context (a hit), or a miss whose complete answer is stored and indexed."""

    name = SourceName.SEMANTIC_CACHE

    def __init__(
        self,
        cache: SemanticCache,
        metrics: Metrics,
        track: Callable[[Coroutine[Any, Any, None]], Any],
    ) -> None:
        self._cache = cache
        self._metrics = metrics
        self._track = track

    def applies(self, query: AnswerQuery) -> bool:
        snapshot = query.snapshot
        return query.sees_answer and applies(
            snapshot.config.semantic_cache,
            snapshot.tenant_configs.get(query.tenant.name),
            snapshot.model_configs.get(query.request.model),
        )

    async def lookup(self, query: AnswerQuery, digest: str) -> Hit | Miss | Bypass:
        del digest  # similar questions have other bodies: the index is keyed by meaning
        snapshot = query.snapshot
        config = snapshot.config
        settings = config.semantic_cache
        metrics = self._metrics
        request = query.request
        tenant = query.tenant.name
        model = snapshot.model_configs.get(request.model)
        assert model is not None  # the model opted in
        scope = cache_scope(
            settings.scope == "model", tenant, snapshot.tenant_configs.get(tenant), query.body
        )
        semantic = semantic_query(request, scope, settings, model.cache_generation)
        if semantic is None:
            metrics.semantic_cache.labels(SemanticResult.BYPASS.value).inc()
            return Bypass()
        found = await lookup(
            self._cache,
            settings,
            semantic,
            owner=query.owner,
            lock_ttl_s=config.server.lease_ttl_s,
            track=self._track,
            judge=query.answer_defect,
            quota=cache_quota(config.response_cache, tenant),
            tenant=tenant,
            on_not_kept=lambda why: metrics.answers_not_stored.labels(why).inc(),
        )
        metrics.semantic_cache.labels(found.result.value).inc()
        if found.bypass_reason is not None:
            metrics.semantic_cache_bypasses.labels(found.bypass_reason).inc()
        if found.guard_refusals:
            metrics.semantic_cache_guard_refusals.inc(found.guard_refusals)
        if found.answer is None:
            if found.recorder is not None:
                return Miss(found.recorder, cache_header=CacheResult.MISS.value)
            return Bypass()
        metrics.semantic_cache_similarity.observe(found.similarity)
        headers = {CACHE_HEADER: SemanticResult.HIT.value}
        if scope != SHARED_SCOPE:
            # Only about the tenant's own question: across tenants a hit reveals nothing
            # beyond the answer.
            headers[SIMILARITY_HEADER] = f"{found.similarity:.4f}"
        return Hit(
            found.answer,
            headers,
            reason="semantic_cache_hit",
            charge=HitCharge(settings.hit_charge, metrics.semantic_cache_saved_tokens),
        )
