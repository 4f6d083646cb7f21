"""The exact-match response cache: the same model and request again -> the stored answer.

Protocol-free. `lookup` says whether a request may use the cache at all (deterministic, or
sampled where the operator allows it), and returns the stored answer (a hit), or an
`AnswerRecorder` that stores this request's answer when it completes (a miss). An identical
request already running elsewhere is not waited for: this one runs uncached (bypass).

The key is the model plus the canonical request body: every field that can change the
answer, `stream` and `stream_options` included, because the stored bytes are exactly what
the client received (a stream with the usage event only where the client asked for it).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvgate.cache.answers import AnswerStore, ClaimState, StoredAnswer
from kvgate.config.model import ModelConfig, ResponseCacheConfig, TenantConfig
from kvgate.config.snapshot import ModelRoute
from kvgate.lifecycle.idempotency import AnswerRecorder
from kvgate.openai import ParsedRequest
from kvgate.policy import (
    ActualUsage,
    AdmissionRequest,
    BackendLimits,
    Decision,
    SettleCause,
    TenantPolicy,
)
from kvgate.store import StateStore


class CacheResult(enum.StrEnum):
    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"


@dataclass(frozen=True, slots=True)
class CacheLookup:
    result: CacheResult
    answer: StoredAnswer | None = None
    recorder: AnswerRecorder | None = None


BYPASS = CacheLookup(CacheResult.BYPASS)


def cacheable(
    request: ParsedRequest,
    settings: ResponseCacheConfig,
    tenant: TenantConfig | None,
    model: ModelConfig | None = None,
) -> bool:
    """Whether the tenant uses the cache and the request is one it may serve. Whether a
    sampled request may be: the tenant's setting, else the model's, else the cache's."""
    enabled = (
        settings.enabled
        if tenant is None or tenant.response_cache is None
        else (tenant.response_cache)
    )
    if not enabled:
        return False
    if tenant is not None and tenant.response_cache_sampled is not None:
        sampled = tenant.response_cache_sampled
    elif model is not None and model.response_cache_sampled is not None:
        sampled = model.response_cache_sampled
    else:
        sampled = settings.sampled
    return sampled or deterministic(request.body)


def deterministic(body: dict[str, Any]) -> bool:
    """Greedy decoding (`temperature: 0`): the same request gives the same answer."""
    temperature = body.get("temperature")
    return (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and temperature == 0
    )


def cache_key(
    request: ParsedRequest, tenant: str, settings: ResponseCacheConfig, generation: str = ""
) -> str:
    """The entry's key. `generation` is the model's `cache_generation`: a new one (new
    weights behind the same name) makes every earlier entry unreachable at once."""
    scope = f"tenant\x00{tenant}" if settings.scope == "tenant" else "model"
    canonical = json.dumps(request.body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256()
    digest.update(f"{scope}\x00{request.path}\x00{request.model}\x00{generation}\x00".encode())
    digest.update(canonical.encode())
    return "cache|" + digest.hexdigest()


async def lookup(
    store: AnswerStore,
    settings: ResponseCacheConfig,
    *,
    request: ParsedRequest,
    tenant: str,
    owner: str,
    lock_ttl_s: float,
    track: Callable[[Coroutine[Any, Any, None]], Any],
    generation: str = "",
) -> CacheLookup:
    key = cache_key(request, tenant, settings, generation)
    claim = await store.claim(key, key, owner, lock_ttl_s)
    if claim.state is ClaimState.COMPLETED:
        return CacheLookup(CacheResult.HIT, answer=claim.answer)
    if claim.state is ClaimState.IN_FLIGHT:
        return BYPASS
    recorder = AnswerRecorder(
        store,
        key,
        owner,
        max_answer_bytes=settings.max_answer_bytes,
        retention_s=settings.ttl_s,
        track=track,
    )
    return CacheLookup(CacheResult.MISS, recorder=recorder)


# The ledger a charged hit is booked on: no KV (nothing runs), the tenant's limits only.
CACHE_LEDGER = "kvgate-response-cache"
_NO_KV = BackendLimits(
    name=CACHE_LEDGER,
    kv_budget_tokens=1 << 40,
    kv_block_size=1,
    max_concurrent_requests=1 << 30,
)


async def charge_hit(
    store: StateStore,
    tenant: TenantPolicy,
    route: ModelRoute,
    answer: StoredAnswer,
    request_id: str,
) -> Decision:
    """`hit_charge: full`: the hit takes what the stored answer took from the tenant's TPM,
    RPM and budgets, atomically like any admission (a tenant over its limits gets the 429
    it would get for the real request), and is booked in the ledger at the model's prices."""
    request = AdmissionRequest(
        request_id=request_id,
        tenant=tenant.name,
        model=route.name,
        backend=CACHE_LEDGER,
        prompt_tokens=answer.prompt_tokens,
        max_new_tokens=answer.output_tokens,
        cost_pico=route.pricing.worst_case(answer.prompt_tokens, answer.output_tokens),
    )
    decision = await store.reserve(request, _NO_KV, tenant)
    if decision.admitted and decision.reservation is not None:
        usage = ActualUsage(answer.prompt_tokens, answer.output_tokens)
        cost = route.pricing.cost(usage.prompt_tokens, usage.output_tokens, 0)
        await store.settle(
            decision.reservation, SettleCause.COMPLETED, usage, cost_pico=cost, tenant=tenant
        )
    return decision
