"""Shedding load when a vLLM server says it is full. Pure: no I/O, no clock.

The admission budget (tokens reserved by kvgate) is the primary guard; this is the
second, fed by what the server itself reports. It only ever says "shed" on fresh,
positive evidence: no data, stale data (the monitor hands us ``None``), or a metric
the server does not expose all mean "do not shed", so a broken scrape can never turn
into an outage.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.capacity.vllm_metrics import VllmCapacity

# Verdict reasons: few and fixed, so they can be metric labels.
REASON_OK = "ok"
REASON_NO_DATA = "no_data"
REASON_KV_CACHE_FULL = "kv_cache_full"
REASON_QUEUE_FULL = "queue_full"


@dataclass(frozen=True, slots=True)
class BackpressureVerdict:
    shed: bool
    # One of the REASON_* constants.
    reason: str
    # For logs and error bodies.
    detail: str = ""


@dataclass(frozen=True, slots=True)
class BackpressurePolicy:
    """Shed when KV usage or the waiting queue exceeds its maximum.

    Both checks are strict: ``max_requests_waiting=8`` tolerates 8 queued requests and
    sheds at 9; ``max_requests_waiting=0`` sheds as soon as anything queues; a usage
    of exactly ``max_kv_cache_usage`` is still admitted. ``None`` turns a check off.
    The figures lag by up to one scrape interval, so these are soft limits.
    """

    max_kv_cache_usage: float | None = 0.95
    max_requests_waiting: int | None = 8

    def __post_init__(self) -> None:
        if self.max_kv_cache_usage is not None and not 0 < self.max_kv_cache_usage <= 1:
            raise ValueError(f"max_kv_cache_usage must be in (0, 1], got {self.max_kv_cache_usage}")
        if self.max_requests_waiting is not None and self.max_requests_waiting < 0:
            raise ValueError(f"max_requests_waiting must be >= 0, got {self.max_requests_waiting}")

    def evaluate(self, capacity: VllmCapacity | None) -> BackpressureVerdict:
        if capacity is None:
            return BackpressureVerdict(False, REASON_NO_DATA, "no fresh metrics from the backend")
        usage = capacity.kv_cache_usage
        waiting = capacity.num_requests_waiting
        kv_full = (
            self.max_kv_cache_usage is not None
            and usage is not None
            and usage > self.max_kv_cache_usage
        )
        queue_full = (
            self.max_requests_waiting is not None
            and waiting is not None
            and waiting > self.max_requests_waiting
        )
        parts: list[str] = []
        if kv_full:
            parts.append(f"KV cache {usage:.1%} used (limit {self.max_kv_cache_usage:.1%})")
        if queue_full:
            parts.append(f"{waiting} requests waiting (limit {self.max_requests_waiting})")
        if kv_full:
            return BackpressureVerdict(True, REASON_KV_CACHE_FULL, "; ".join(parts))
        if queue_full:
            return BackpressureVerdict(True, REASON_QUEUE_FULL, "; ".join(parts))
        return BackpressureVerdict(False, REASON_OK, "")
