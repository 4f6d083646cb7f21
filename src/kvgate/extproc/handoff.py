"""Split response path: the request-path stream hands its reservation to the observability
stream that sees the response (envoy/envoy-observability.yaml).

With the response body observed by a second ext_proc filter in `observability_mode`, Envoy
never waits for kvgate on the response path (no added time to first token or inter-token
latency), but the response arrives on a different gRPC stream. The request-path session
registers its ticket under the reservation id, which it also sets in the `kvgate`
dynamic metadata; Envoy forwards that metadata to the observability stream, whose session
claims the hand-off and settles. A hand-off nobody claims (no observability filter, or the
stream never opened) is settled as a disconnect after `claim_timeout_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvgate.lifecycle.ticket import Ticket

METADATA_KEY = "reservation_id"


class HandoffRegistry:
    def __init__(self, claim_timeout_s: float = 30.0) -> None:
        self._claim_timeout_s = claim_timeout_s
        self._waiting: dict[str, tuple[Ticket, asyncio.TimerHandle]] = {}

    def register(self, state: Ticket, on_unclaimed: Callable[[Ticket], Any]) -> None:
        key = state.reservation.reservation_id
        timer = asyncio.get_running_loop().call_later(
            self._claim_timeout_s, self._expire, key, on_unclaimed
        )
        self._waiting[key] = (state, timer)

    def claim(self, reservation_id: str) -> Ticket | None:
        entry = self._waiting.pop(reservation_id, None)
        if entry is None:
            return None
        state, timer = entry
        timer.cancel()
        return state

    def _expire(self, key: str, on_unclaimed: Callable[[Ticket], Any]) -> None:
        entry = self._waiting.pop(key, None)
        if entry is not None:
            on_unclaimed(entry[0])

    def __len__(self) -> int:
        return len(self._waiting)
