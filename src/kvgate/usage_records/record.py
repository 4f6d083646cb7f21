"""One usage record: what one request used and cost, without its prompt, answer or key."""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from decimal import Decimal
from operator import attrgetter
from typing import Any

from kvgate.policy import Pricing, pico_to_usd

# A request id or a name longer than this is clipped: they come from clients (x-request-id)
# or the config, and a record is a bounded thing.
MAX_TEXT = 256


class AnswerSource(enum.StrEnum):
    """Who answered the request."""

    BACKEND = "backend"
    EXACT_CACHE = "exact_cache"
    SEMANTIC_CACHE = "semantic_cache"
    IDEMPOTENT_REPLAY = "idempotent_replay"


def pricing_version(pricing: Pricing) -> str:
    """The model's prices at the time, as a short stable hash (the prices in pico-dollars per
    token): two records with the same version were priced alike."""
    text = f"{pricing.input}/{pricing.cached_input}/{pricing.output}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _clip(value: str | None) -> str | None:
    # PostgreSQL's text refuses NUL: one such record would hold its whole batch back.
    return None if value is None else value[:MAX_TEXT].replace("\x00", "")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request, as the ledger booked it. ``record_id`` is kvgate's own id of the request
    (its reservation, or its stream's admission id for an answer served without one): unique
    per request, unlike the client's ``request_id``, so it is the key every write is
    idempotent by."""

    record_id: str
    request_id: str
    # Wall time of the settlement (or of the stored answer being served), UTC seconds.
    occurred_at: float
    # The ledger's day and month this usage was booked in (YYYY-MM-DD, YYYY-MM).
    ledger_day: str
    ledger_month: str
    tenant: str
    api: str
    path: str
    requested_model: str
    served_model: str
    backend: str | None
    endpoint: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int | None
    cost_pico: int
    pricing_version: str | None
    answer_source: AnswerSource
    # The HTTP status of the answer (0: none arrived).
    status: int
    # How the request ended (completed, upstream_error, disconnected, ...).
    settle_cause: str
    # Counted in the ledger's requests and tokens (a settled request, a fully charged hit).
    booked_request: bool
    # Counted in the ledger's cache hits (with the tokens it saved).
    cache_hit: bool = False
    saved_tokens: int = 0
    # The route's backend override (Envoy's per-route settings), when one applied.
    route: str | None = None
    decision_ms: float | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    # Who the caller is inside its tenant, where a key or a token names it.
    team_id: str | None = None
    user_id: str | None = None
    key_id: str | None = None

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if value is not None and (len(value) > MAX_TEXT or "\x00" in value):
                object.__setattr__(self, name, _clip(value))

    @property
    def cost_usd(self) -> Decimal:
        return pico_to_usd(self.cost_pico)

    @property
    def occurred_at_utc(self) -> datetime:
        return datetime.fromtimestamp(self.occurred_at, UTC)

    def to_json(self) -> str:
        """One line of the spool."""
        return json.dumps(self.as_dict(), separators=(",", ":"), allow_nan=False)

    def as_dict(self) -> dict[str, Any]:
        # Flat fields only: a comprehension, not dataclasses.asdict (a deep copy, 5x slower).
        return dict(zip(_FIELD_NAMES, _fields_of(self), strict=True))

    @classmethod
    def from_json(cls, line: str | bytes) -> UsageRecord:
        """A record back from a spool line; ``ValueError`` for anything that is not one
        (a spool file is local, but a torn or edited line must not stop the others)."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a record is a JSON object")
        values: dict[str, Any] = {}
        for spec in fields(cls):
            if spec.name not in data:
                raise ValueError(f"missing field {spec.name}")
            values[spec.name] = _checked(spec.name, data[spec.name])
        values["answer_source"] = AnswerSource(values["answer_source"])
        return cls(**values)


_FIELD_NAMES: tuple[str, ...] = tuple(UsageRecord.__dataclass_fields__)
# Text that may come from a client or a config: clipped, without NUL.
_TEXT_FIELDS = (
    "record_id",
    "request_id",
    "tenant",
    "api",
    "path",
    "requested_model",
    "served_model",
    "backend",
    "endpoint",
    "route",
)
# Every field's value at once, in _FIELD_NAMES' order (one C call).
_fields_of = attrgetter(*_FIELD_NAMES)

_INTS = {"prompt_tokens", "cached_tokens", "output_tokens", "cost_pico", "status", "saved_tokens"}
_OPTIONAL_INTS = {"reasoning_tokens"}
_FLOATS = {"occurred_at"}
_OPTIONAL_FLOATS = {"decision_ms", "ttft_ms", "duration_ms"}
_BOOLS = {"booked_request", "cache_hit"}
_OPTIONAL_TEXT = {"backend", "endpoint", "route", "team_id", "user_id", "key_id", "pricing_version"}


def _checked(name: str, value: Any) -> Any:
    """A spool field, of the type the record says, or ``ValueError``."""
    if value is None and (
        name in _OPTIONAL_INTS or name in _OPTIONAL_FLOATS or name in _OPTIONAL_TEXT
    ):
        return None
    if name in _INTS or name in _OPTIONAL_INTS:
        if type(value) is not int or value < 0 or value >= 2**63:
            raise ValueError(f"{name} must be a non-negative 64-bit integer")
        return value
    if name in _FLOATS or name in _OPTIONAL_FLOATS:
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a non-negative number")
        return float(value)
    if name in _BOOLS:
        if type(value) is not bool:
            raise ValueError(f"{name} must be a boolean")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value
