"""Admission: from a parsed request to a ticket, or a rejection with its reason and numbers.

Counts the prompt (refusing from a cheap bound first what cannot fit), sizes the request,
reserves on its backend, and applies the tenant's budget action (block, fall back to a
cheaper model, or clamp max_tokens) when money runs out. Protocol-free: the outcomes are
domain values; the Envoy adapter turns them into HTTP answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvgate.capacity.registry import CapacityRegistry
from kvgate.config.snapshot import ModelRoute, RuntimeSnapshot
from kvgate.lifecycle.scheduler import PoolScheduler, PoolUnavailable
from kvgate.lifecycle.ticket import Ticket
from kvgate.openai import ParsedRequest
from kvgate.openai.requests import PromptBound, prompt_lower_bound
from kvgate.policy import (
    AdmissionRequest,
    BackendLimits,
    BudgetAction,
    Decision,
    RateLimitView,
    Reason,
    TenantPolicy,
    plan_new_tokens,
    requests_only,
)
from kvgate.store import StateStore, StoreUnavailable
from kvgate.tokenize import CountingApi, PromptRenderError, TokenizerBusy
from kvgate.tokenize.engine_counting import EngineCountUnavailable

# Rejections a lower bound on the prompt answers exactly: they do not depend on its size
# (or, for a request larger than the whole bucket, no wait can help).
_SIZE_INDEPENDENT_REJECTIONS = frozenset(
    {
        Reason.RPM_EXCEEDED,
        Reason.BACKEND_CONCURRENCY_LIMIT,
        Reason.TENANT_CONCURRENCY_EXCEEDED,
        Reason.REQUEST_EXCEEDS_TPM,
    }
)

# The ledger of what is answered without a backend (cache hits, replays): no KV, nothing
# in flight, only the tenant's own limits.
ANSWER_LEDGER = "kvgate-answers"
NO_KV = BackendLimits(
    name=ANSWER_LEDGER,
    kv_budget_tokens=1 << 40,
    kv_block_size=1,
    max_concurrent_requests=1 << 30,
)

# A prompt at least this long (by its lower bound) that cannot fit is refused without
# counting it; a shorter one is counted for an exact answer (counting it costs < 10 ms).
_EARLY_REFUSAL_MIN_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class ContextOverflow:
    """The numbers of a request that does not fit its model's context."""

    prompt_tokens: int
    max_new_tokens: int | None
    max_context: int
    at_least: bool = False  # prompt_tokens is a lower bound (found without counting)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is not admitted, in domain terms (no HTTP)."""

    reason: Reason
    message: str
    retry_after_s: float | None = None
    rate_limits: RateLimitView | None = None
    # The request field at fault, when there is one.
    param: str | None = None
    context: ContextOverflow | None = None


class Rejected(Exception):
    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


def rejection_of(decision: Decision) -> Rejection:
    """The policy's refusal as a rejection."""
    param = (
        "max_tokens"
        if decision.reason in (Reason.REQUEST_EXCEEDS_KV_BUDGET, Reason.REQUEST_EXCEEDS_TPM)
        else None
    )
    return Rejection(
        reason=decision.reason,
        message=decision.detail,
        retry_after_s=decision.retry_after_s,
        rate_limits=decision.rate_limits,
        param=param,
    )


class PromptTokenizers(Protocol):
    """Counting off the event loop, scheduled fairly between tenants."""

    async def count_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tenant: str = "",
        cost: int | None = None,
        response_format: Any = None,
        tool_choice: Any = None,
    ) -> int: ...

    async def count_completion(
        self, model: str, prompt: Any, *, tenant: str = "", cost: int | None = None
    ) -> int: ...

    async def count_text(self, model: str, text: str, *, tenant: str = "") -> int: ...

    def counter(self, model: str) -> CountingApi: ...


@dataclass(frozen=True, slots=True)
class _Sized:
    route: ModelRoute
    prompt_tokens: int
    max_new_tokens: int


class Admission:
    """Admits one request against one config snapshot."""

    def __init__(
        self,
        *,
        snapshot: RuntimeSnapshot,
        store: StateStore,
        tokenizers: PromptTokenizers,
        capacity: CapacityRegistry,
        record_violations: Callable[[str, Decision], None],
        track: Callable[[Coroutine[Any, Any, None]], Any],
        scheduler: PoolScheduler | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._priority = 0
        self._on_queued: Callable[[float], None] | None = None
        self._snapshot = snapshot
        self._store = store
        self._tokenizers = tokenizers
        self._capacity = capacity
        self._record_violations = record_violations
        self._track = track

    async def admit(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        request_id: str,
        admission_id: str,
        *,
        priority: int = 0,
        on_queued: Callable[[float], None] | None = None,
        backend: str | None = None,
        request_slot_taken: bool = False,
    ) -> Ticket:
        """A ticket for the admitted request, or `Rejected`. `admission_id` keys the
        reservation in the store (unique per request); `request_id` is the client's.
        `priority` is its class in a pool's queue; `on_queued(max_wait_s)` is called when
        it starts waiting there (the adapter extends its deadlines); `backend` replaces the
        model's own backend (a route's setting); `request_slot_taken`: the request's RPM slot
        was taken already (`take_request_slot`, before the answer sources)."""
        self._priority = priority
        self._on_queued = on_queued
        route = self._route_of(request.model, tenant)
        if backend is not None and backend != route.backend:
            # The request's Envoy route names the backend (or pool) that serves it. A budget
            # fallback model is still served by its own.
            route = replace(route, backend=backend)
        self._refuse_too_many_inputs(request)
        # Once the pre-check took the tenant's RPM request, no later step takes it again (the
        # clamp's retry, the fallback's pre-check and reserve): one request, one slot.
        request_slot_taken = await self._reject_early(
            request, tenant, route, admission_id, request_slot_taken
        )
        sized = await self._size(request, tenant, route, request.max_new_tokens)
        decision, endpoint = await self._reserve(
            request, tenant, sized, admission_id, request_slot_taken
        )
        if decision.admitted:
            return self._ticket(decision, sized, request, request_id, endpoint=endpoint)
        # A level's budget (team, user, key) blocks: the tenant's budget action is its own.
        if decision.reason is Reason.BUDGET_EXCEEDED and not decision.level_budget_refused:
            if tenant.budget_action is BudgetAction.CLAMP:
                clamped = await self._clamp(
                    request, tenant, sized, decision, request_id, admission_id, request_slot_taken
                )
                if clamped is not None:
                    return clamped
            elif tenant.budget_action is BudgetAction.FALLBACK and tenant.fallback_model:
                fallen = await self._fall_back(
                    request,
                    tenant,
                    tenant.fallback_model,
                    request_id,
                    admission_id,
                    request_slot_taken,
                )
                if fallen is not None:
                    return fallen
        raise Rejected(rejection_of(decision))

    def _route_of(self, model: str, tenant: TenantPolicy) -> ModelRoute:
        """The model's route; a model unknown, or outside the allow-list of any of the
        caller's levels (team, user, key), is refused alike: it does not exist for them."""
        route = self._snapshot.models.get(model)
        if route is None or not tenant.allows_model(model):
            raise Rejected(Rejection(Reason.MODEL_NOT_FOUND, model, param="model"))
        return route

    def _refuse_too_many_inputs(self, request: ParsedRequest) -> None:
        """A pooling request's inputs (or pairs), each a prompt the engine encodes, are at
        most server.max_pooling_inputs."""
        limit = self._snapshot.config.server.max_pooling_inputs
        if request.generates or request.num_prompts <= limit:
            return
        param = request.prompt_param
        raise Rejected(
            Rejection(
                Reason.TOO_MANY_INPUTS,
                f"Invalid '{param}': at most {limit} inputs per request, but got "
                f"{request.num_prompts}.",
                param=param,
            )
        )

    async def take_request_slot(self, model: str, tenant: TenantPolicy, admission_id: str) -> bool:
        """Take the request's RPM slot before any answer source looks at it: a cache hit,
        a replay or a duplicate's wait is a request the tenant made. O(1): nothing of the
        body is read. Rejected when over RPM, or when a level of the caller may not use the
        model (before an answer source could answer for it); False when the store could not
        answer (the admission's own pre-check then takes the slot)."""
        if not tenant.allows_model(model):
            raise Rejected(Rejection(Reason.MODEL_NOT_FOUND, model, param="model"))
        lower_bound = AdmissionRequest(
            request_id=admission_id,
            tenant=tenant.name,
            model=model,
            backend=ANSWER_LEDGER,
            prompt_tokens=0,
            max_new_tokens=0,
        )
        try:
            early = await self._store.precheck(
                lower_bound, NO_KV, requests_only(tenant), take_request_slot=True
            )
        except StoreUnavailable:
            return False
        if early is None:
            return True
        self._record_violations(tenant.name, early)
        raise Rejected(rejection_of(early))

    async def count_prompt(
        self, request: ParsedRequest, tenant: TenantPolicy, admission_id: str
    ) -> int:
        """The exact prompt tokens of ``request`` on its model, for an endpoint that answers
        with the count (no backend, no reservation): the tenant's RPM slot is taken first,
        and the count runs in the tenant's fair share of the counting workers."""
        route = self._route_of(request.model, tenant)
        await self.take_request_slot(request.model, tenant, admission_id)
        counts = await self._count(request, route.name, tenant.name)
        if counts is None:
            # The model's engine counts its prompts and could not: no count to give.
            raise Rejected(
                Rejection(
                    Reason.COUNTING_UNAVAILABLE,
                    "kvgate cannot count this prompt now. Please retry.",
                    retry_after_s=1,
                )
            )
        return sum(counts)

    async def admit_unreserved(
        self, model: str, tenant: TenantPolicy, admission_id: str, backend: str | None = None
    ) -> tuple[ModelRoute, str | None]:
        """Admit a request that generates nothing and holds no KV (vLLM's /tokenize): the
        model must exist and the tenant's RPM slot is taken; nothing is reserved or charged.
        Returns the model's route (on `backend` when the request's route names one) and, for
        a pool, the endpoint to send it to."""
        route = self._route_of(model, tenant)
        if backend is not None and backend != route.backend:
            route = replace(route, backend=backend)
        if not await self.take_request_slot(model, tenant, admission_id):
            # No later step would take the slot: refused, as a reserve would be (503).
            raise Rejected(
                Rejection(
                    Reason.STORE_UNAVAILABLE,
                    "kvgate cannot reach its shared state store to admit this request. "
                    "Please retry.",
                    retry_after_s=1,
                )
            )
        scheduler = self._scheduler
        if scheduler is None or not scheduler.is_pool(route.backend):
            return route, None
        address = scheduler.any_endpoint(route.backend)
        if address is None:
            raise Rejected(
                Rejection(
                    Reason.NO_HEALTHY_ENDPOINT,
                    f"No endpoint of {route.backend} can take requests now. Please retry.",
                    retry_after_s=1,
                )
            )
        return route, address

    # ------------------------------------------------------------------ steps

    async def _reject_early(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        route: ModelRoute,
        admission_id: str,
        request_slot_taken: bool,
    ) -> bool:
        """Turn away a tenant that is over a limit before paying for tokenization: a 429
        should cost far less than an admit. A pre-check that passes takes the tenant's RPM
        request (unless `request_slot_taken`: an earlier pre-check of this request took it), so a
        flood of large bodies is cut at RPM before any of it is tokenized.

        Returns whether the request's RPM slot is taken now (its reserve must not take it)."""
        limits = self._precheck_limits(route.backend)
        bound = self._prompt_lower_bound(request, route)
        if bound.longest >= _EARLY_REFUSAL_MIN_TOKENS and (
            bound.longest + (request.max_new_tokens or 0) > route.max_context
            # A generation needs one token of room; a pooling prompt may fill the context.
            or (request.generates and bound.longest >= route.max_context)
        ):
            # Cannot fit whatever its exact count: refuse before paying for tokenizing. (A
            # small prompt is counted instead: that is cheap, and the answer is exact.)
            raise Rejected(
                Rejection(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    "The prompt does not fit the model's context.",
                    param=request.prompt_param,
                    context=ContextOverflow(
                        bound.longest,
                        request.max_new_tokens,
                        route.max_context,
                        at_least=not bound.exact,
                    ),
                )
            )
        lower_bound = AdmissionRequest(
            request_id=admission_id,
            tenant=tenant.name,
            model=route.name,
            backend=route.backend,
            prompt_tokens=bound.total,
            max_new_tokens=(request.max_new_tokens or 1) if request.generates else 0,
            choices=request.num_sequences,
            request_slot_taken=request_slot_taken,
        ).priced(route.pricing)
        try:
            early = await self._store.precheck(
                lower_bound, limits, tenant, take_request_slot=not request_slot_taken
            )
        except StoreUnavailable:
            # The full decision below answers with the store's failure policy, and takes
            # the slot if none was taken (unknown here: counting it twice beats never).
            return request_slot_taken
        if early is None:
            return True  # taken now, or before
        if early.reason not in _SIZE_INDEPENDENT_REJECTIONS:
            # A token or money shortfall depends on the exact size: the full decision
            # answers it, so its Retry-After and message are those of the real request
            # (a wait computed for a lower bound would be refused again). Nothing was
            # taken: the reserve takes the slot.
            return request_slot_taken
        self._record_violations(tenant.name, early)
        raise Rejected(rejection_of(early))

    def _prompt_lower_bound(self, request: ParsedRequest, route: ModelRoute) -> PromptBound:
        """Prompt tokens the request needs at least, from its text length alone."""
        try:
            per_token = self._tokenizers.counter(route.name).max_token_chars
        except KeyError:
            return PromptBound(total=1, longest=1, exact=False)
        bound = prompt_lower_bound(request, per_token)
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens < 0:
            # -1: the engine truncates each prompt to the model's context.
            longest = min(bound.longest, route.max_context)
            return replace(
                bound, longest=longest, total=min(bound.total, longest * request.num_prompts)
            )
        return bound

    async def _size(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        route: ModelRoute,
        requested_max_new: int | None,
    ) -> _Sized:
        if not request.generates:
            return await self._size_pooling(request, tenant, route)
        counts = await self._count(request, route.name, tenant.name)
        if counts is None:
            return self._size_at_context(request, route, requested_max_new)
        # The engine checks each prompt of a completions batch against the context on its
        # own; the reservation holds them all.
        longest, total = max(counts), sum(counts)
        plan = plan_new_tokens(
            longest, requested_max_new, route.default_max_new_tokens, route.max_context
        )
        if not plan.ok:
            raise Rejected(
                Rejection(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    "The prompt and the completion do not fit the model's context.",
                    param=request.prompt_param,
                    context=ContextOverflow(longest, plan.max_new_tokens, route.max_context),
                )
            )
        if request.min_tokens > plan.max_new_tokens:
            # The engine would generate past the reserved cap (or refuse the request).
            raise Rejected(
                Rejection(
                    Reason.MIN_TOKENS_OVER_CAP,
                    f"min_tokens ({request.min_tokens}) must not exceed the completion's "
                    f"token limit ({plan.max_new_tokens}).",
                    param="min_tokens",
                )
            )
        return _Sized(route, total, plan.max_new_tokens)

    async def _size_pooling(
        self, request: ParsedRequest, tenant: TenantPolicy, route: ModelRoute
    ) -> _Sized:
        """A request that generates nothing (embeddings, pooling, scores): its prompts, each
        truncated as the engine truncates it and checked against the whole context (no
        room is kept for output), reserved with no output tokens."""
        keep = request.truncate_prompt_tokens
        if keep is not None and keep > route.max_context:
            # vLLM refuses it before tokenizing (TokenizeParams).
            raise Rejected(
                Rejection(
                    Reason.UNRENDERABLE_PROMPT,
                    f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                    f"{route.max_context}. Please request a smaller truncation size.",
                    param="truncate_prompt_tokens",
                )
            )
        if keep is not None and keep < 0:
            keep = route.max_context
        counts = await self._count(request, route.name, tenant.name)
        if counts is None:
            # No count: each prompt may fill the context.
            return _Sized(route, route.max_context * max(1, request.num_prompts), 0)
        if keep is not None:
            counts = [min(count, keep) for count in counts]
        longest = max(counts, default=0)
        if longest > route.max_context:
            raise Rejected(
                Rejection(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    "The input does not fit the model's context.",
                    param=request.prompt_param,
                    context=ContextOverflow(longest, None, route.max_context),
                )
            )
        return _Sized(route, sum(counts), 0)

    def _size_at_context(
        self, request: ParsedRequest, route: ModelRoute, requested_max_new: int | None
    ) -> _Sized:
        """No count (the engine could not give one, and the model admits at its upper
        bound): each prompt with its completion takes at most the whole context."""
        if requested_max_new is not None and requested_max_new >= route.max_context:
            raise Rejected(
                Rejection(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    "The prompt and the completion do not fit the model's context.",
                    param=request.prompt_param,
                    context=ContextOverflow(1, requested_max_new, route.max_context, at_least=True),
                )
            )
        max_new = min(requested_max_new or route.default_max_new_tokens, route.max_context - 1)
        if request.min_tokens > max_new:
            raise Rejected(
                Rejection(
                    Reason.MIN_TOKENS_OVER_CAP,
                    f"min_tokens ({request.min_tokens}) must not exceed the completion's "
                    f"token limit ({max_new}).",
                    param="min_tokens",
                )
            )
        prompts = request.num_prompts if request.kind != "chat" else 1
        return _Sized(route, (route.max_context - max_new) * max(1, prompts), max_new)

    async def _count(self, request: ParsedRequest, model: str, tenant: str) -> list[int] | None:
        """Prompt tokens, one count per prompt the engine runs (several for a batch),
        counted under the tenant's fair share of the counting workers. None: the model's
        engine could not count and the model admits at its upper bound."""
        tokenizers = self._tokenizers
        try:
            if request.kind == "chat":
                return [
                    await tokenizers.count_chat(
                        model,
                        request.messages or [],
                        request.tools,
                        add_generation_prompt=request.add_generation_prompt,
                        continue_final_message=request.continue_final_message,
                        chat_template_kwargs=request.chat_template_kwargs,
                        tenant=tenant,
                        cost=request.body_bytes or None,
                        response_format=request.body.get("response_format"),
                        tool_choice=request.body.get("tool_choice"),
                    )
                ]
            if request.score_pairs is not None:
                return await self._count_score_pairs(request, model, tenant)
            prompts = request.prompts()
            return [
                await tokenizers.count_completion(
                    model, prompt, tenant=tenant, cost=_completion_cost(prompt, request)
                )
                for prompt in prompts
            ]
        except TokenizerBusy as busy:
            raise Rejected(
                Rejection(
                    Reason.COUNTING_BUSY,
                    "Too many of your requests are waiting to be counted; "
                    "retry when some have been answered.",
                    retry_after_s=busy.retry_after_s,
                )
            ) from None
        except PromptRenderError as exc:
            raise Rejected(
                Rejection(
                    Reason.UNRENDERABLE_PROMPT,
                    exc.client_message,
                    param=exc.param or request.prompt_param,
                )
            ) from None
        except EngineCountUnavailable as unavailable:
            if unavailable.reserve_upper_bound:
                return None
            raise Rejected(
                Rejection(
                    Reason.COUNTING_UNAVAILABLE,
                    "kvgate cannot count this prompt now: the model's engine, which counts "
                    "it, did not answer in time. Please retry.",
                    retry_after_s=unavailable.retry_after_s,
                )
            ) from None

    async def _count_score_pairs(
        self, request: ParsedRequest, model: str, tenant: str
    ) -> list[int]:
        """A rerank or score request's prompts: each (query, document) pair rendered as
        vLLM renders it for a model served with a score template (--chat-template): the
        messages {"role": "query"} and {"role": "document"} through the template, no
        generation prompt, tokenized with the tokenizer's special tokens. A model without
        one is scored by its pair encoding, which kvgate does not count: refused."""
        try:
            template = self._tokenizers.counter(model).engine_flags.chat_template
        except KeyError:
            template = None
        if template is None:
            raise Rejected(
                Rejection(
                    Reason.UNRENDERABLE_PROMPT,
                    f"This gateway meters rerank and score requests only for a model served "
                    f"with a score template (vLLM's --chat-template); '{model}' has none.",
                    param="model",
                )
            )
        counts = []
        for query, document in request.score_pairs or ():
            messages = [
                {"role": "query", "content": query},
                {"role": "document", "content": document},
            ]
            counts.append(
                await self._tokenizers.count_chat(
                    model,
                    messages,
                    add_generation_prompt=False,
                    chat_template_kwargs=request.chat_template_kwargs,
                    add_special_tokens=True,
                    tenant=tenant,
                    cost=len(query) + len(document),
                )
            )
        return counts

    async def _reserve(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        sized: _Sized,
        admission_id: str,
        request_slot_taken: bool,
    ) -> tuple[Decision, str | None]:
        """Reserve on the route's backend, or on one endpoint of its pool. Returns the
        decision and, for a pool, the endpoint's address."""
        admission = AdmissionRequest(
            request_id=admission_id,
            tenant=tenant.name,
            model=sized.route.name,
            backend=sized.route.backend,
            prompt_tokens=sized.prompt_tokens,
            max_new_tokens=sized.max_new_tokens,
            choices=request.num_sequences,
            # A rejected reserve gives no slot back: the request was made (and counted).
            request_slot_taken=request_slot_taken,
        ).priced(sized.route.pricing)
        scheduler = self._scheduler
        if scheduler is None or not scheduler.is_pool(sized.route.backend):
            limits = self._backend_limits(sized.route.backend)
            return await self._reserve_on(admission, limits, tenant), None

        async def reserve_on(request: AdmissionRequest, limits: BackendLimits) -> Decision:
            return await self._reserve_on(request, limits, tenant)

        try:
            placement = await scheduler.place(
                admission,
                request,
                tenant,
                priority=self._priority,
                reserve_on=reserve_on,
                on_queued=self._on_queued,
            )
        except PoolUnavailable as unavailable:
            raise Rejected(
                Rejection(
                    unavailable.reason,
                    unavailable.detail,
                    retry_after_s=unavailable.retry_after_s,
                )
            ) from None
        endpoint = placement.endpoint
        return placement.decision, endpoint.address if endpoint is not None else None

    async def _reserve_on(
        self, admission: AdmissionRequest, limits: BackendLimits, tenant: TenantPolicy
    ) -> Decision:
        """One atomic reserve in the store; a reserve whose answer is lost is abandoned."""
        store = self._store
        try:
            decision = await store.reserve(admission, limits, tenant)
        except asyncio.CancelledError:
            # The stream went away (or the decision deadline passed) with the reserve in
            # flight: it may have committed. Release whatever it took, in the background.
            self._track(store.abandon(admission))
            raise
        except StoreUnavailable as exc:
            # The reply was lost, not necessarily the reserve: release it once the store
            # answers again. Then 503 (fail_closed): retry later.
            self._track(store.abandon(admission))
            raise Rejected(
                Rejection(
                    Reason.STORE_UNAVAILABLE,
                    "kvgate cannot reach its shared state store to admit this request. "
                    "Please retry.",
                    retry_after_s=exc.retry_after_s,
                )
            ) from None
        self._record_violations(tenant.name, decision)
        return decision

    def _precheck_limits(self, backend: str) -> BackendLimits:
        scheduler = self._scheduler
        if scheduler is None or not scheduler.is_pool(backend):
            return self._backend_limits(backend)
        limits = scheduler.limits_for_precheck(backend)
        if limits is None:
            # Nothing pickable now: the placement answers why (none healthy, budget
            # unknown, all shedding), with the queue where there is one. The pre-check
            # only needs some ledger to time the tenant's own concurrency.
            return self._snapshot.backends[backend]
        return limits

    def _backend_limits(self, backend: str) -> BackendLimits:
        """The backend's limits now: a discovered budget, and no admission under pressure."""
        limits = self._capacity.effective_limits(
            self._snapshot.backends[backend], auto=backend in self._snapshot.auto_budget
        )
        if limits is None:
            raise Rejected(
                Rejection(
                    Reason.CAPACITY_UNKNOWN,
                    f"The capacity of backend '{backend}' is not known yet.",
                    retry_after_s=2,
                )
            )
        verdict = self._capacity.verdict(backend)
        if verdict is not None and verdict.shed:
            settings = next(b for b in self._snapshot.config.backends if b.name == backend)
            retry = settings.backpressure.retry_after_s if settings.backpressure else 2.0
            raise Rejected(
                Rejection(
                    Reason.BACKEND_OVERLOADED,
                    f"Backend '{backend}' is overloaded: {verdict.detail}",
                    retry_after_s=retry,
                )
            )
        return limits

    def _ticket(
        self,
        decision: Decision,
        sized: _Sized,
        request: ParsedRequest,
        request_id: str,
        *,
        fallback_from: str | None = None,
        clamped_from: int | None = None,
        endpoint: str | None = None,
    ) -> Ticket:
        assert decision.reservation is not None
        return Ticket(
            reservation=decision.reservation,
            route=sized.route,
            request=request,
            request_id=request_id,
            prompt_tokens=sized.prompt_tokens,
            max_new_tokens=sized.max_new_tokens,
            new_model=sized.route.name if fallback_from is not None else None,
            rate_limits=decision.rate_limits,
            fallback_from=fallback_from,
            clamped_from=clamped_from,
            endpoint=endpoint,
        )

    async def _clamp(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        sized: _Sized,
        decision: Decision,
        request_id: str,
        admission_id: str,
        request_slot_taken: bool,
    ) -> Ticket | None:
        """Lower max_tokens to what the remaining budget pays for; None if not even one
        token of answer fits."""
        if decision.budget_left_pico is None:
            return None
        affordable = sized.route.pricing.output_tokens_affordable(
            sized.prompt_tokens, decision.budget_left_pico
        ) // max(1, request.num_sequences)
        if affordable < 1 or affordable >= sized.max_new_tokens:
            return None
        smaller = _Sized(sized.route, sized.prompt_tokens, affordable)
        retry, endpoint = await self._reserve(
            request, tenant, smaller, admission_id, request_slot_taken
        )
        if not retry.admitted:
            return None
        return self._ticket(
            retry,
            smaller,
            request,
            request_id,
            clamped_from=sized.max_new_tokens,
            endpoint=endpoint,
        )

    async def _fall_back(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        fallback: str,
        request_id: str,
        admission_id: str,
        request_slot_taken: bool,
    ) -> Ticket | None:
        route = self._snapshot.models.get(fallback)
        if route is None or route.name == request.model or not tenant.allows_model(fallback):
            return None  # a fallback no level of the caller may use is no fallback
        # The fallback model has its own tokenizer, context and prices: count again. A slot
        # taken for the requested model counts this request (the fallback model's own RPM
        # scope, if any, is then not charged: the client asked for the first model).
        request_slot_taken = await self._reject_early(
            request, tenant, route, admission_id, request_slot_taken
        )
        sized = await self._size(request, tenant, route, request.max_new_tokens)
        decision, endpoint = await self._reserve(
            request, tenant, sized, admission_id, request_slot_taken
        )
        if not decision.admitted:
            return None
        return self._ticket(
            decision, sized, request, request_id, fallback_from=request.model, endpoint=endpoint
        )


def _completion_cost(prompt: object, request: ParsedRequest) -> int | None:
    """What counting one prompt costs: the body's size for a single prompt; a batch's
    prompts are estimated one by one (None)."""
    del prompt
    return (request.body_bytes or None) if request.num_prompts == 1 else None
