"""State stores: where reservations and the usage ledger live."""

from kvgate.store.base import StateStore, TenantUsage
from kvgate.store.errors import StoreUnavailable
from kvgate.store.fallback import FailurePolicy, FallbackStore, StoreEvents
from kvgate.store.memory import MemoryStore
from kvgate.store.redis_store import RedisSettings, RedisStore

__all__ = [
    "FailurePolicy",
    "FallbackStore",
    "MemoryStore",
    "RedisSettings",
    "RedisStore",
    "StateStore",
    "StoreEvents",
    "StoreUnavailable",
    "TenantUsage",
]
