"""Token buckets for RPM and TPM limits.

A bucket holds up to `capacity` units and refills continuously at `refill_per_s`. Admission
takes the worst case up front; settlement gives back what was not used, or takes the overshoot
(the level may then go below zero: the debt delays the tenant's next requests, which is how an
answer longer than its max_tokens is still paid for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BucketSpec:
    capacity: float
    refill_per_s: float

    def seconds_to_refill(self, missing: float) -> float:
        if missing <= 0:
            return 0.0
        return missing / self.refill_per_s


@dataclass(slots=True)
class TokenBucket:
    spec: BucketSpec
    level: float
    updated_at: float

    @classmethod
    def full(cls, spec: BucketSpec, now: float) -> TokenBucket:
        return cls(spec=spec, level=spec.capacity, updated_at=now)

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(self.spec.capacity, self.level + elapsed * self.spec.refill_per_s)
        self.updated_at = max(self.updated_at, now)

    def available(self, now: float) -> float:
        self.refill(now)
        return self.level

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0 if it can be now; inf if never)."""
        if amount > self.spec.capacity:
            return math.inf
        return self.spec.seconds_to_refill(amount - self.available(now))

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        """Refund (amount > 0) or charge an overshoot (amount < 0)."""
        self.refill(now)
        self.level = min(self.spec.capacity, self.level + amount)

    def seconds_until_full(self, now: float) -> float:
        return self.spec.seconds_to_refill(self.spec.capacity - self.available(now))

    def resize(self, spec: BucketSpec, now: float) -> None:
        """Apply a reloaded limit without forgiving debt or granting a fresh burst."""
        self.refill(now)
        self.spec = spec
        self.level = min(self.level, spec.capacity)
