"""Small statistics helpers: percentiles of one run, medians and spread over rounds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return math.nan
    return float(np.percentile(arr, q))


def summarize(
    values: Sequence[float] | np.ndarray, prefix: str, scale: float = 1e3
) -> dict[str, float]:
    """p50/p90/p99/p99.9/mean/max of `values` (seconds) as `prefix_p50` ... in ms."""
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        keys = ("p50", "p90", "p99", "p999", "mean", "max")
        return {f"{prefix}_{k}": math.nan for k in keys}
    p50, p90, p99, p999 = np.percentile(arr, [50, 90, 99, 99.9])
    return {
        f"{prefix}_p50": float(p50) * scale,
        f"{prefix}_p90": float(p90) * scale,
        f"{prefix}_p99": float(p99) * scale,
        f"{prefix}_p999": float(p999) * scale,
        f"{prefix}_mean": float(arr.mean()) * scale,
        f"{prefix}_max": float(arr.max()) * scale,
    }


@dataclass(frozen=True)
class Spread:
    """Median over rounds, with the lowest and highest round."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
        if arr.size == 0:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(float(np.median(arr)), float(arr.min()), float(arr.max()), int(arr.size))

    def fmt(self, digits: int = 2) -> str:
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"
