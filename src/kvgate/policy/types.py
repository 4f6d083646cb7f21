"""Value types shared by the admission policy, the stores and the ext_proc adapter."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Reason(enum.StrEnum):
    """Why a request was answered the way it was. Low cardinality: used as a metric label.

    The human detail goes into the error body, never into the label.
    """

    ADMITTED = "admitted"
    PASSTHROUGH = "passthrough"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED_PATH = "unsupported_path"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    REQUEST_EXCEEDS_KV_BUDGET = "request_exceeds_kv_budget"
    KV_BUDGET_EXHAUSTED = "kv_budget_exhausted"
    CONCURRENCY_LIMIT = "concurrency_limit"
    INTERNAL_ERROR = "internal_error"


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

    @property
    def cost_tokens(self) -> int:
        """Worst-case KV the request can occupy: the prompt plus every choice's answer."""
        return self.prompt_tokens + self.max_new_tokens * self.choices


@dataclass(frozen=True, slots=True)
class Reservation:
    """A lease on backend capacity, held from admission to settlement."""

    reservation_id: str
    request: AdmissionRequest
    kv_tokens: int
    started_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: Reason
    reservation: Reservation | None = None
    # Seconds until retrying can succeed; None when waiting cannot help.
    retry_after_s: float | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ActualUsage:
    """What a request really consumed, known at settlement."""

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Settlement:
    reservation_id: str
    cause: SettleCause
    usage: ActualUsage
    reserved_kv_tokens: int
    # False when the reservation was already settled (or expired): nothing was charged twice.
    applied: bool = True
    duration_s: float = 0.0


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


@dataclass(slots=True)
class LedgerView:
    by_tenant_model: dict[tuple[str, str], UsageTotals] = field(default_factory=dict)
