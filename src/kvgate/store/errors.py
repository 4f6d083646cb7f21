"""Errors a state store raises."""

from __future__ import annotations


class StoreUnavailable(Exception):
    """The shared store could not answer in time (down, unreachable, failing over, loading).

    Raised instead of hanging: the caller applies the configured failure policy. A timed-out
    call may still have taken effect on the server (the reply was lost); every operation is
    designed so that this is harmless (an orphan reservation expires with its lease, and a
    retried settlement is applied at most once).
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
