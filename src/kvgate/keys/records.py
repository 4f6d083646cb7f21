"""API keys as data: what a key record holds and what the directory of keys offers.

The key itself is shown once, when it is made; the stores keep only its SHA-256 (the same
digest as the config's ``api_key_sha256``), so a leaked store leaks no usable key.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from kvgate.config.model import LevelConfig


class KeyRefusal(enum.StrEnum):
    """Why a known key is refused (the client's 401 says this, never which keys exist)."""

    REVOKED = "revoked"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    # Public and stable ("key_" + 16 hex): what operators list, revoke and rotate by, and
    # what the usage records and the ledger name; never enough to authenticate.
    key_id: str
    key_hash: str  # SHA-256 hex of the key
    tenant: str
    team: str | None = None
    user: str | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    created_at: float = 0.0  # Unix seconds
    expires_at: float | None = None
    revoked_at: float | None = None
    # The key's own limits, budgets and model allow-list (None: only its tenant's, team's
    # and user's apply).
    limits: LevelConfig | None = None

    def refusal(self, now: float) -> KeyRefusal | None:
        if self.revoked_at is not None and self.revoked_at <= now:
            return KeyRefusal.REVOKED
        if self.expires_at is not None and self.expires_at <= now:
            return KeyRefusal.EXPIRED
        return None


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key just made: the secret (shown once) and its record."""

    secret: str
    record: KeyRecord


class KeyDirectory(Protocol):
    """Where kvgate looks keys up per request and operators manage them."""

    async def lookup(self, key_hash: str) -> KeyRecord | None:
        """The record of a key by its hash (revoked and expired ones too), from a bounded
        local cache that any change anywhere empties within the refresh interval; None for
        a key the directory does not hold."""
        ...

    async def create(
        self,
        tenant: str,
        *,
        team: str | None = None,
        user: str | None = None,
        labels: Mapping[str, str] | None = None,
        expires_at: float | None = None,
        limits: LevelConfig | None = None,
    ) -> NewKey: ...

    async def get(self, key_id: str) -> KeyRecord | None: ...

    async def list(
        self, *, tenant: str | None = None, after_key_id: str = "", limit: int = 100
    ) -> Sequence[KeyRecord]:
        """Records ordered by key id, after ``after_key_id`` (paging)."""
        ...

    async def revoke(self, key_id: str, *, at: float | None = None) -> KeyRecord | None:
        """Revoked now (or at ``at``: a rotation's grace); None when no such key."""
        ...

    async def rotate(self, key_id: str, *, grace_s: float = 0.0) -> NewKey | None:
        """A new key with the old one's tenant, team, user, labels, expiry and limits; the
        old one revoked after ``grace_s``. None when no such key (or it is revoked)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
