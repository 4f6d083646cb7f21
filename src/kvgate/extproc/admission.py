"""From a parsed request to a reservation: count, size, price, reserve, and apply the tenant's
budget action (block, fall back to a cheaper model, or clamp max_tokens) when money runs out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvgate.config.snapshot import ModelRoute, RuntimeSnapshot
from kvgate.extproc.ratelimit_headers import rate_limit_headers
from kvgate.extproc.services import GatewayServices
from kvgate.openai import ApiError, ParsedRequest
from kvgate.openai import errors as api_errors
from kvgate.openai.requests import PromptBound, prompt_lower_bound
from kvgate.policy import (
    AdmissionRequest,
    BackendLimits,
    BudgetAction,
    Decision,
    Reason,
    Reservation,
    TenantPolicy,
    plan_new_tokens,
)
from kvgate.store import StoreUnavailable
from kvgate.tokenize import PromptRenderError, TokenizerBusy

# Rejections a lower bound on the prompt answers exactly: they do not depend on its size
# (or, for a request larger than the whole bucket, no wait can help).
_SIZE_INDEPENDENT_REJECTIONS = frozenset(
    {
        Reason.RPM_EXCEEDED,
        Reason.CONCURRENCY_LIMIT,
        Reason.CONCURRENCY_EXCEEDED,
        Reason.REQUEST_EXCEEDS_TPM,
    }
)

# A prompt at least this long (by its lower bound) that cannot fit is refused without
# counting it; a shorter one is counted for an exact answer (counting it costs < 10 ms).
_EARLY_REFUSAL_MIN_TOKENS = 8192

FALLBACK_HEADER = "x-kvgate-fallback"
CLAMP_HEADER = "x-kvgate-max-tokens-clamped"


class AdmissionRejected(Exception):
    def __init__(self, error: ApiError, reason: Reason, decision: Decision | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason
        self.decision = decision


@dataclass(slots=True)
class Admitted:
    reservation: Reservation
    route: ModelRoute
    prompt_tokens: int
    max_new_tokens: int
    decision: Decision
    # Body rewrites the engine must see (model after a fallback, max_tokens after a clamp).
    new_model: str | None = None
    new_max_tokens: int | None = None
    # Headers for the client's response (fallback and clamp notices, x-ratelimit-*).
    client_headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Sized:
    route: ModelRoute
    prompt_tokens: int
    max_new_tokens: int


class AdmissionPlanner:
    def __init__(self, services: GatewayServices, snapshot: RuntimeSnapshot) -> None:
        self._svc = services
        self._snapshot = snapshot

    async def admit(
        self, request: ParsedRequest, tenant: TenantPolicy, request_id: str
    ) -> Admitted:
        route = self._snapshot.models.get(request.model)
        if route is None:
            raise AdmissionRejected(
                api_errors.model_not_found(request.model), Reason.MODEL_NOT_FOUND
            )
        # Once the pre-check took the tenant's RPM request, no later step takes it again (the
        # clamp's retry, the fallback's pre-check and reserve): one request, one slot.
        slot_taken = await self._reject_early(request, tenant, route, request_id, False)
        sized = await self._size(request, tenant, route, request.max_new_tokens)
        decision = await self._reserve(request, tenant, sized, request_id, slot_taken)
        if decision.admitted:
            return self._admitted(decision, sized)
        if decision.reason is Reason.BUDGET_EXCEEDED:
            if tenant.budget_action is BudgetAction.CLAMP:
                clamped = await self._clamp(
                    request, tenant, sized, decision, request_id, slot_taken
                )
                if clamped is not None:
                    return clamped
            elif tenant.budget_action is BudgetAction.FALLBACK and tenant.fallback_model:
                fallen = await self._fall_back(
                    request, tenant, tenant.fallback_model, request_id, slot_taken
                )
                if fallen is not None:
                    return fallen
        raise AdmissionRejected(_rejection_error(decision), decision.reason, decision)

    # ------------------------------------------------------------------ steps

    async def _reject_early(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        route: ModelRoute,
        request_id: str,
        slot_taken: bool,
    ) -> bool:
        """Turn away a tenant that is over a limit before paying for tokenization: a 429
        should cost far less than an admit. A pre-check that passes takes the tenant's RPM
        request (unless `slot_taken`: an earlier pre-check of this request took it), so a
        flood of large bodies is cut at RPM before any of it is tokenized.

        Returns whether the request's RPM slot is taken now (its reserve must not take it)."""
        limits = self._backend_limits(route.backend)
        sequences = request.num_sequences
        max_new = request.max_new_tokens or 1
        bound = self._prompt_lower_bound(request, route.name)
        if bound.longest >= _EARLY_REFUSAL_MIN_TOKENS and (
            bound.longest + (request.max_new_tokens or 0) > route.max_context
            or bound.longest >= route.max_context
        ):
            # Cannot fit whatever its exact count: refuse before paying for tokenizing. (A
            # small prompt is counted instead: that is cheap, and the answer is exact.)
            raise AdmissionRejected(
                api_errors.context_length_exceeded(
                    bound.longest,
                    request.max_new_tokens,
                    route.max_context,
                    param="messages" if request.kind == "chat" else "prompt",
                    at_least=not bound.exact,
                ),
                Reason.CONTEXT_LENGTH_EXCEEDED,
            )
        lower_bound = AdmissionRequest(
            request_id=request_id,
            tenant=tenant.name,
            model=route.name,
            backend=route.backend,
            prompt_tokens=bound.total,
            max_new_tokens=max_new,
            choices=sequences,
            cost_pico=route.pricing.worst_case(bound.total, max_new * sequences),
            request_slot_taken=slot_taken,
        )
        try:
            early = await self._svc.store.precheck(
                lower_bound, limits, tenant, take_request_slot=not slot_taken
            )
        except StoreUnavailable:
            # The full decision below answers with the store's failure policy, and takes
            # the slot if none was taken (unknown here: counting it twice beats never).
            return slot_taken
        if early is None:
            return True  # taken now, or before
        if early.reason not in _SIZE_INDEPENDENT_REJECTIONS:
            # A token or money shortfall depends on the exact size: the full decision
            # answers it, so its Retry-After and message are those of the real request
            # (a wait computed for a lower bound would be refused again). Nothing was
            # taken: the reserve takes the slot.
            return slot_taken
        self._svc.record_violations(tenant.name, early)
        raise AdmissionRejected(_rejection_error(early), early.reason, early)

    def _prompt_lower_bound(self, request: ParsedRequest, model: str) -> PromptBound:
        """Prompt tokens the request needs at least, from its text length alone."""
        try:
            per_token = self._svc.tokenizers.counter(model).max_token_chars
        except KeyError:
            return PromptBound(total=1, longest=1, exact=False)
        return prompt_lower_bound(request, per_token)

    async def _size(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        route: ModelRoute,
        requested_max_new: int | None,
    ) -> _Sized:
        counts = await self._count(request, route.name, tenant.name)
        # The engine checks each prompt of a completions batch against the context on its
        # own; the reservation holds them all.
        longest, total = max(counts), sum(counts)
        plan = plan_new_tokens(
            longest, requested_max_new, route.default_max_new_tokens, route.max_context
        )
        if not plan.ok:
            raise AdmissionRejected(
                api_errors.context_length_exceeded(
                    longest,
                    plan.max_new_tokens,
                    route.max_context,
                    param="messages" if request.kind == "chat" else "prompt",
                ),
                Reason.CONTEXT_LENGTH_EXCEEDED,
            )
        if request.min_tokens > plan.max_new_tokens:
            # The engine would generate past the reserved cap (or refuse the request).
            raise AdmissionRejected(
                api_errors.invalid_request(
                    f"min_tokens ({request.min_tokens}) must not exceed the completion's "
                    f"token limit ({plan.max_new_tokens}).",
                    param="min_tokens",
                    code="invalid_value",
                ),
                Reason.INVALID_REQUEST,
            )
        return _Sized(route, total, plan.max_new_tokens)

    async def _count(self, request: ParsedRequest, model: str, tenant: str) -> list[int]:
        """Prompt tokens, one count per prompt the engine runs (several for a batch),
        counted under the tenant's fair share of the counting workers."""
        tokenizers = self._svc.tokenizers
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
                    )
                ]
            prompts = request.prompts()
            return [
                await tokenizers.count_completion(model, prompt, tenant=tenant)
                for prompt in prompts
            ]
        except TokenizerBusy as busy:
            raise AdmissionRejected(
                api_errors.rate_limited(
                    "Too many of your requests are waiting to be counted; "
                    "retry when some have been answered.",
                    Reason.COUNTING_BUSY.value,
                    busy.retry_after_s,
                ),
                Reason.COUNTING_BUSY,
            ) from None
        except PromptRenderError as exc:
            raise AdmissionRejected(
                api_errors.invalid_request(
                    exc.client_message, param="messages" if request.kind == "chat" else "prompt"
                ),
                Reason.INVALID_REQUEST,
            ) from None

    async def _reserve(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        sized: _Sized,
        request_id: str,
        slot_taken: bool,
    ) -> Decision:
        sequences = request.num_sequences
        admission = AdmissionRequest(
            request_id=request_id,
            tenant=tenant.name,
            model=sized.route.name,
            backend=sized.route.backend,
            prompt_tokens=sized.prompt_tokens,
            max_new_tokens=sized.max_new_tokens,
            choices=sequences,
            cost_pico=sized.route.pricing.worst_case(
                sized.prompt_tokens, sized.max_new_tokens * sequences
            ),
            # A rejected reserve gives no slot back: the request was made (and counted).
            request_slot_taken=slot_taken,
        )
        limits = self._backend_limits(sized.route.backend)
        store = self._svc.store
        try:
            decision = await store.reserve(admission, limits, tenant)
        except asyncio.CancelledError:
            # The stream went away (or the decision deadline passed) with the reserve in
            # flight: it may have committed. Release whatever it took, in the background.
            self._svc.track(store.abandon(admission))
            raise
        except StoreUnavailable as exc:
            # The reply was lost, not necessarily the reserve: release it once the store
            # answers again. Then 503 (fail_closed): retry later.
            self._svc.track(store.abandon(admission))
            raise AdmissionRejected(
                api_errors.service_unavailable(
                    "kvgate cannot reach its shared state store to admit this request. "
                    "Please retry.",
                    retry_after_s=exc.retry_after_s,
                ),
                Reason.STORE_UNAVAILABLE,
            ) from None
        self._svc.record_violations(tenant.name, decision)
        return decision

    def _backend_limits(self, backend: str) -> BackendLimits:
        """The backend's limits now: a discovered budget, and no admission under pressure."""
        limits = self._svc.capacity.effective_limits(
            self._snapshot.backends[backend], auto=backend in self._snapshot.auto_budget
        )
        if limits is None:
            raise AdmissionRejected(
                api_errors.service_unavailable(
                    f"The capacity of backend '{backend}' is not known yet.", retry_after_s=2
                ),
                Reason.CAPACITY_UNKNOWN,
            )
        verdict = self._svc.capacity.verdict(backend)
        if verdict is not None and verdict.shed:
            settings = next(b for b in self._snapshot.config.backends if b.name == backend)
            retry = settings.backpressure.retry_after_s if settings.backpressure else 2.0
            raise AdmissionRejected(
                api_errors.rate_limited(
                    f"Backend '{backend}' is overloaded: {verdict.detail}",
                    Reason.BACKEND_OVERLOADED.value,
                    retry,
                ),
                Reason.BACKEND_OVERLOADED,
            )
        return limits

    def _admitted(self, decision: Decision, sized: _Sized) -> Admitted:
        assert decision.reservation is not None
        return Admitted(
            reservation=decision.reservation,
            route=sized.route,
            prompt_tokens=sized.prompt_tokens,
            max_new_tokens=sized.max_new_tokens,
            decision=decision,
            client_headers=rate_limit_headers(decision.rate_limits),
        )

    async def _clamp(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        sized: _Sized,
        decision: Decision,
        request_id: str,
        slot_taken: bool,
    ) -> Admitted | None:
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
        retry = await self._reserve(request, tenant, smaller, request_id, slot_taken)
        if not retry.admitted:
            return None
        admitted = self._admitted(retry, smaller)
        admitted.new_max_tokens = affordable
        admitted.client_headers[CLAMP_HEADER] = f"{sized.max_new_tokens} -> {affordable}"
        return admitted

    async def _fall_back(
        self,
        request: ParsedRequest,
        tenant: TenantPolicy,
        fallback: str,
        request_id: str,
        slot_taken: bool,
    ) -> Admitted | None:
        route = self._snapshot.models.get(fallback)
        if route is None or route.name == request.model:
            return None
        # The fallback model has its own tokenizer, context and prices: count again. A slot
        # taken for the requested model counts this request (the fallback model's own RPM
        # scope, if any, is then not charged: the client asked for the first model).
        slot_taken = await self._reject_early(request, tenant, route, request_id, slot_taken)
        sized = await self._size(request, tenant, route, request.max_new_tokens)
        decision = await self._reserve(request, tenant, sized, request_id, slot_taken)
        if not decision.admitted:
            return None
        admitted = self._admitted(decision, sized)
        admitted.new_model = route.name
        admitted.client_headers[FALLBACK_HEADER] = f"{request.model} -> {route.name}"
        return admitted


def _rejection_error(decision: Decision) -> ApiError:
    reason = decision.reason
    headers = rate_limit_headers(decision.rate_limits)
    if reason in (Reason.REQUEST_EXCEEDS_KV_BUDGET, Reason.REQUEST_EXCEEDS_TPM):
        # Waiting cannot help: a 400, with no Retry-After.
        return api_errors.invalid_request(decision.detail, param="max_tokens", code=reason.value)
    if reason is Reason.BUDGET_EXCEEDED:
        return api_errors.rate_limited(
            decision.detail,
            reason.value,
            decision.retry_after_s,
            headers,
            error_type="insufficient_quota",
        )
    return api_errors.rate_limited(decision.detail, reason.value, decision.retry_after_s, headers)
