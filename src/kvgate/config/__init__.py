"""Typed, validated configuration, compiled into an immutable runtime snapshot."""

from kvgate.config.model import (
    BackendConfig,
    ConfigError,
    KvgateConfig,
    ModelConfig,
    ServerConfig,
    TenantConfig,
    hash_api_key,
    load_config,
    parse_config,
)
from kvgate.config.snapshot import RuntimeSnapshot, SnapshotHolder, compile_snapshot

__all__ = [
    "BackendConfig",
    "ConfigError",
    "KvgateConfig",
    "ModelConfig",
    "RuntimeSnapshot",
    "ServerConfig",
    "SnapshotHolder",
    "TenantConfig",
    "compile_snapshot",
    "hash_api_key",
    "load_config",
    "parse_config",
]
