"""Secrets named by the configuration: read from an environment variable or a file.

The configuration holds only *where* a secret is (a variable's name, a file's path), never
the value, so the config file can live in a ConfigMap or a repository. Files follow the
Kubernetes Secret volume convention: the whole file is the value, a trailing newline (as
`echo` or an editor leaves it) is stripped. Errors name the field and the place, never the
value.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.config.model import ConfigError, KvgateConfig, url_has_password

__all__ = [
    "check_secrets",
    "read_secret_env",
    "read_secret_file",
    "redis_passwords",
    "resolve_secret",
    "url_has_password",
]


def read_secret_file(path: str | Path, field: str) -> str:
    """The file's contents without the trailing newline; ConfigError when unreadable or empty."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{field}: {path} is not UTF-8 text") from None
    value = raw.removesuffix("\n").removesuffix("\r")
    if not value:
        raise ConfigError(f"{field}: {path} is empty")
    return value


def read_secret_env(name: str, field: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{field}: environment variable {name} is not set or empty")
    return value


def resolve_secret(prefix: str, env: str | None, file: str | None) -> str | None:
    """`{prefix}_env` / `{prefix}_file` resolved (the config allows at most one), or None."""
    if env is not None:
        return read_secret_env(env, f"{prefix}_env")
    if file is not None:
        return read_secret_file(file, f"{prefix}_file")
    return None


def redis_passwords(config: KvgateConfig) -> tuple[str | None, str | None]:
    """(the Redis password, the sentinels' password) from env or file, as configured.

    None where the config gives none that way (the URL or `sentinel.password` may still
    carry one inline)."""
    redis_cfg = config.redis
    password = resolve_secret("redis.password", redis_cfg.password_env, redis_cfg.password_file)
    sentinel = redis_cfg.sentinel
    sentinel_password = None
    if sentinel is not None:
        sentinel_password = resolve_secret(
            "redis.sentinel.password", sentinel.password_env, sentinel.password_file
        )
    return password, sentinel_password


def check_secrets(config: KvgateConfig) -> list[str]:
    """Every secret the config names that cannot be read or used (for `kvgate check-config`):
    the operator token, the operator TLS certificate, key and client CA, Redis passwords."""
    from kvgate.admin.auth import load_operator_tokens  # the admin package imports config
    from kvgate.admin.tls import OperatorTls

    tls = config.server.operator_tls
    problems = []
    for check in (
        lambda: load_operator_tokens(config.server),
        lambda: OperatorTls(tls) if tls is not None else None,  # readable, key matches
        lambda: redis_passwords(config) if config.uses_redis else None,
    ):
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
