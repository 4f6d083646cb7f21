"""UTC budget periods: a day and a calendar month."""

from __future__ import annotations

import enum
import functools
import math
from datetime import UTC, datetime, timedelta

# POSIX time has no leap seconds: every UTC day is exactly this long, and a month starts on
# a day boundary, so the day's number decides both keys.
_SECONDS_PER_DAY = 86400


class Period(enum.StrEnum):
    DAY = "day"
    MONTH = "month"


def period_key(period: Period, wall: float) -> str:
    # Called several times per request: strftime once per day, not per call.
    return _period_key_of_day(period, math.floor(wall / _SECONDS_PER_DAY))


@functools.lru_cache(maxsize=64)
def _period_key_of_day(period: Period, day: int) -> str:
    moment = datetime.fromtimestamp(day * _SECONDS_PER_DAY, UTC)
    return moment.strftime("%Y-%m-%d" if period is Period.DAY else "%Y-%m")


def period_start_and_end(period: Period, wall: float) -> tuple[float, float]:
    moment = datetime.fromtimestamp(wall, UTC)
    if period is Period.DAY:
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + timedelta(days=1)
    else:
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (
            start.replace(year=start.year + 1, month=1)
            if start.month == 12
            else start.replace(month=start.month + 1)
        )
    return start.timestamp(), end.timestamp()


def seconds_until_reset(period: Period, wall: float) -> float:
    return period_start_and_end(period, wall)[1] - wall
