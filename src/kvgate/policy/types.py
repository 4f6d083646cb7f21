"""Value types shared by the admission policy, the stores and the ext_proc adapter."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.policy.pricing import Pricing
    from kvgate.policy.tenant import RateLimitView, TenantHold, Violation


class Reason(enum.StrEnum):
    """Why admission decided as it did, in domain terms. Low cardinality: a metric label.

    The human detail goes into the answer, never into the label. Protocol outcomes (a
    missing key, an unknown path, a pass-through) belong to the adapter, not here.
    """

    ADMITTED = "admitted"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    # min_tokens above the cap the engine may generate.
    MIN_TOKENS_OVER_CAP = "min_tokens_over_cap"
    # The chat template refused the messages (e.g. roles out of order).
    UNRENDERABLE_PROMPT = "unrenderable_prompt"
    REQUEST_EXCEEDS_KV_BUDGET = "request_exceeds_kv_budget"
    KV_BUDGET_EXHAUSTED = "kv_budget_exhausted"
    # The backend's own limit on requests in flight.
    BACKEND_CONCURRENCY_LIMIT = "concurrency_limit"
    RPM_EXCEEDED = "rpm_exceeded"
    TPM_EXCEEDED = "tpm_exceeded"
    REQUEST_EXCEEDS_TPM = "request_exceeds_tpm"
    # A pooling request (embeddings, rerank, score) with more inputs than server.max_pooling_inputs.
    TOO_MANY_INPUTS = "too_many_inputs"
    # The tenant's own limit on requests in flight.
    TENANT_CONCURRENCY_EXCEEDED = "concurrency_exceeded"
    BUDGET_EXCEEDED = "budget_exceeded"
    BACKEND_OVERLOADED = "backend_overloaded"
    CAPACITY_UNKNOWN = "capacity_unknown"
    STORE_UNAVAILABLE = "store_unavailable"
    # The tenant already has too much prompt counting queued.
    COUNTING_BUSY = "counting_busy"
    # The engine that counts the model's prompts (its /tokenize) cannot answer in time (503).
    COUNTING_UNAVAILABLE = "counting_unavailable"
    # No endpoint of the request's pool is healthy (503).
    NO_HEALTHY_ENDPOINT = "no_healthy_endpoint"
    # The pool's queue is full, or a queued request found no room within its wait bound.
    QUEUE_FULL = "queue_full"
    QUEUE_WAIT_EXPIRED = "queue_wait_expired"
    # A reserve for a request that was abandoned (its first answer was lost).
    ABANDONED = "abandoned"


class SettleCause(enum.StrEnum):
    """How a forwarded request ended; a metric label."""

    COMPLETED = "completed"
    UPSTREAM_ERROR = "upstream_error"
    DISCONNECTED = "disconnected"
    SHUTDOWN = "shutdown"
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True, slots=True)
class BackendLimits:
    """Capacity of one serving backend (one vLLM deployment)."""

    name: str
    kv_budget_tokens: int
    kv_block_size: int
    max_concurrent_requests: int

    def round_to_blocks(self, tokens: int) -> int:
        """KV is allocated in whole blocks, so a reservation is too."""
        blocks = math.ceil(tokens / self.kv_block_size)
        return blocks * self.kv_block_size


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What one request asks of its backend, in tokens."""

    request_id: str
    tenant: str
    model: str
    backend: str
    prompt_tokens: int
    max_new_tokens: int
    choices: int = 1
    # Worst-case cost (no cache discount, every output token used), reserved on budgets.
    cost_pico: int = 0
    # The tenant's RPM request slot was already taken by the pre-check (StateStore.precheck
    # with take_request_slot): the reserve does not take it again (nor refuse for RPM, unless
    # a bucket is in debt) and an abandon does not give it back. The one name of this fact,
    # from the admission down to the tenant's hold (the Redis record spells it "pre").
    request_slot_taken: bool = False

    @property
    def reserved_output_tokens(self) -> int:
        """The most output the request may generate: every choice's (sequence's) answer at
        its cap. What is reserved, and charged when the answer cannot be metered."""
        return self.max_new_tokens * self.choices

    @property
    def cost_tokens(self) -> int:
        """Worst-case KV the request can occupy: the prompt plus every choice's answer."""
        return self.prompt_tokens + self.reserved_output_tokens

    def priced(self, pricing: Pricing) -> AdmissionRequest:
        """This request with `cost_pico` its worst case under `pricing`: no cache discount,
        every reserved output token used."""
        return replace(
            self, cost_pico=pricing.worst_case(self.prompt_tokens, self.reserved_output_tokens)
        )


@dataclass(frozen=True, slots=True)
class Reservation:
    """A lease on backend capacity, held from admission to settlement."""

    reservation_id: str
    request: AdmissionRequest
    kv_tokens: int
    started_at: float
    expires_at: float
    hold: TenantHold | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: Reason
    reservation: Reservation | None = None
    # Seconds until retrying can succeed; None when waiting cannot help.
    retry_after_s: float | None = None
    detail: str = ""
    # Every limit the request broke, shadowed ones included (they are only reported).
    violations: tuple[Violation, ...] = ()
    rate_limits: RateLimitView | None = None
    # The tenant's smallest remaining enforced budget, for the clamp and fallback actions.
    budget_left_pico: int | None = None

    @property
    def level_budget_refused(self) -> bool:
        """An enforced budget of a level (team, user, key) is broken: the tenant's budget
        action (clamp, fallback) does not apply; the request is refused."""
        return any(
            v.level is not None and v.reason is Reason.BUDGET_EXCEEDED and not v.shadow
            for v in self.violations
        )


@dataclass(frozen=True, slots=True)
class ActualUsage:
    """What a request really consumed, known at settlement."""

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Settlement:
    reservation_id: str
    cause: SettleCause
    usage: ActualUsage
    reserved_kv_tokens: int
    # False when nothing was booked: settled (or abandoned) before, or unknown to the store.
    applied: bool = True
    duration_s: float = 0.0
    cost_pico: int = 0
    # The lease had expired (its capacity was freed) before this settlement; the usage was
    # booked anyway, from the reservation's billing record.
    lease_expired: bool = False


@dataclass(slots=True)
class BackendStatus:
    name: str
    kv_budget_tokens: int
    kv_tokens_in_flight: int
    requests_in_flight: int
    max_concurrent_requests: int


@dataclass(slots=True)
class UsageTotals:
    """Ledger totals for one tenant and model."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_pico: int = 0
    # Requests answered from a cache (exact or semantic) without reaching a backend, and the
    # prompt and output tokens the answers they replayed took. A charged hit also counts
    # among `requests` and the tokens above; a free one only here.
    cache_hits: int = 0
    cache_saved_tokens: int = 0

    def add(self, usage: ActualUsage, cost_pico: int) -> None:
        self.requests += 1
        self.prompt_tokens += usage.prompt_tokens
        self.output_tokens += usage.output_tokens
        self.cached_tokens += usage.cached_tokens
        self.cost_pico += cost_pico
