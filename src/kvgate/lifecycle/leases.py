"""Keeping an open request's lease alive: renewed on a timer for exactly as long as the
request is open, whether or not its answer is producing chunks (a long non-streamed
generation sends nothing for minutes)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvgate.metrics import Metrics
from kvgate.policy import Reservation
from kvgate.store import StateStore

log = logging.getLogger("kvgate.lease")


def renew_interval_s(lease_ttl_s: float) -> float:
    """Renew well before expiry: a lease survives two missed renewals."""
    return lease_ttl_s / 3


class LeaseKeeper:
    def __init__(
        self, store: StateStore, metrics: Metrics, interval_s: Callable[[], float]
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._interval_s = interval_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def keep(self, reservation: Reservation) -> None:
        """Start renewing; idempotent per reservation."""
        key = reservation.reservation_id
        if key in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._renew_until_released(reservation))
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._forget(key, task))

    def release(self, reservation_id: str) -> None:
        """Stop renewing (the request is being settled)."""
        task = self._tasks.pop(reservation_id, None)
        if task is not None:
            task.cancel()

    def __len__(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    def _forget(self, key: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]

    async def _renew_until_released(self, reservation: Reservation) -> None:
        renewals = self._metrics.lease_renewals
        lost = False
        while True:
            await asyncio.sleep(self._interval_s())
            try:
                held = await self._store.renew(reservation)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Try again next interval: a lease outlives several missed renewals.
                renewals.labels("error").inc()
                log.warning(
                    "lease renewal failed",
                    extra={"reservation_id": reservation.reservation_id},
                    exc_info=True,
                )
                continue
            if held:
                renewals.labels("renewed").inc()
                continue
            if not lost:
                # The store let the lease go (it expired): its capacity is already free. The
                # request is still charged when it settles, from its billing record, which
                # every renewal keeps alive: so go on renewing while the request is open.
                lost = True
                renewals.labels("lost").inc()
                log.warning(
                    "lease lost while the request was open",
                    extra={
                        "reservation_id": reservation.reservation_id,
                        "backend": reservation.request.backend,
                    },
                )
