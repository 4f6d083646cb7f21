"""The compiled, immutable view of a configuration that request handling reads.

A reload builds a whole new snapshot and swaps one reference, so a request never sees half
of an old config and half of a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvgate.config.model import KvgateConfig, ModelConfig
from kvgate.policy import BackendLimits


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str
    backend: str
    max_context: int
    default_max_new_tokens: int


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    tenants_by_key_hash: Mapping[str, str]
    tenants: frozenset[str]
    models: Mapping[str, ModelRoute]
    backends: Mapping[str, BackendLimits]
    config: KvgateConfig


def _route(model: ModelConfig) -> ModelRoute:
    return ModelRoute(
        name=model.name,
        backend=model.backend,
        max_context=model.max_context,
        default_max_new_tokens=model.default_max_new_tokens,
    )


def compile_snapshot(config: KvgateConfig) -> RuntimeSnapshot:
    by_hash = {digest: t.name for t in config.tenants for digest in t.key_hashes}
    return RuntimeSnapshot(
        tenants_by_key_hash=MappingProxyType(by_hash),
        tenants=frozenset(t.name for t in config.tenants),
        models=MappingProxyType({m.name: _route(m) for m in config.models}),
        backends=MappingProxyType(
            {
                b.name: BackendLimits(
                    name=b.name,
                    kv_budget_tokens=b.kv_budget_tokens,
                    kv_block_size=b.kv_block_size,
                    max_concurrent_requests=b.max_concurrent_requests,
                )
                for b in config.backends
            }
        ),
        config=config,
    )


class SnapshotHolder:
    """Holds the current snapshot; readers take `.current` once per request."""

    def __init__(self, snapshot: RuntimeSnapshot) -> None:
        self._current = snapshot

    @property
    def current(self) -> RuntimeSnapshot:
        return self._current

    def swap(self, snapshot: RuntimeSnapshot) -> RuntimeSnapshot:
        previous, self._current = self._current, snapshot
        return previous
