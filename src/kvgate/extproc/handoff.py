"""Split response path: the request-path stream hands its reservation to the observability
stream that sees the response (envoy/envoy-observability.yaml).

With the response body observed by a second ext_proc filter in `observability_mode`, Envoy
never waits for kvgate on the response path (no added time to first token or inter-token
latency), but the response arrives on a different gRPC stream. The request-path session
registers what it admitted under the reservation id, which it also sets in the `kvgate`
dynamic metadata; Envoy forwards that metadata to the observability stream, whose session
claims the hand-off and settles. A hand-off nobody claims (no observability filter, or the
stream never opened) is settled as a disconnect after `claim_timeout_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.config.snapshot import ModelRoute
from kvgate.openai import ParsedRequest
from kvgate.policy import Reservation

METADATA_KEY = "reservation_id"


@dataclass(frozen=True, slots=True)
class HandedOff:
    reservation: Reservation
    route: ModelRoute
    request: ParsedRequest
    prompt_tokens: int
    tenant: str
    request_id: str


class HandoffRegistry:
    def __init__(self, claim_timeout_s: float = 30.0) -> None:
        self._claim_timeout_s = claim_timeout_s
        self._waiting: dict[str, tuple[HandedOff, asyncio.TimerHandle]] = {}

    def register(self, state: HandedOff, on_unclaimed: Callable[[HandedOff], Any]) -> None:
        key = state.reservation.reservation_id
        timer = asyncio.get_running_loop().call_later(
            self._claim_timeout_s, self._expire, key, on_unclaimed
        )
        self._waiting[key] = (state, timer)

    def claim(self, reservation_id: str) -> HandedOff | None:
        entry = self._waiting.pop(reservation_id, None)
        if entry is None:
            return None
        state, timer = entry
        timer.cancel()
        return state

    def _expire(self, key: str, on_unclaimed: Callable[[HandedOff], Any]) -> None:
        entry = self._waiting.pop(key, None)
        if entry is not None:
            on_unclaimed(entry[0])

    def __len__(self) -> int:
        return len(self._waiting)
