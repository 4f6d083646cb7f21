"""State stores: where reservations and the usage ledger live."""

from kvgate.store.base import StateStore, TenantUsage
from kvgate.store.memory import MemoryStore

__all__ = ["MemoryStore", "StateStore", "TenantUsage"]
