"""Budget period keys: the cached per-day form equals formatting each instant."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from kvgate.policy.periods import Period, period_key

# Instants around day, month and year boundaries, a leap day, and before 1970.
EDGES = [
    datetime(2025, 12, 31, 23, 59, 59, 999000, tzinfo=UTC).timestamp(),
    datetime(2026, 1, 1, tzinfo=UTC).timestamp(),
    datetime(2028, 2, 29, 12, tzinfo=UTC).timestamp(),
    datetime(2028, 3, 1, tzinfo=UTC).timestamp() - 0.001,
    -1.5,
    0.0,
]


@pytest.mark.parametrize("period", list(Period))
def test_period_key_equals_formatting_the_instant(period: Period) -> None:
    rng = random.Random(7)
    walls = EDGES + [rng.uniform(-1e9, 5e9) for _ in range(5000)]
    fmt = "%Y-%m-%d" if period is Period.DAY else "%Y-%m"
    for wall in walls:
        assert period_key(period, wall) == datetime.fromtimestamp(wall, UTC).strftime(fmt), wall
