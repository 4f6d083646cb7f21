"""UTC budget periods: a day and a calendar month."""

from __future__ import annotations

import enum
from datetime import UTC, datetime, timedelta


class Period(enum.StrEnum):
    DAY = "day"
    MONTH = "month"


def period_key(period: Period, wall: float) -> str:
    moment = datetime.fromtimestamp(wall, UTC)
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
