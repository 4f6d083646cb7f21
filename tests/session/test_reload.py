"""Hot reload: a good config applies without dropping streams; a bad one keeps the old."""

from __future__ import annotations

import copy
import functools
import json
import logging
import types
import typing
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from pydantic import BaseModel

from kvgate.app import KvgateServer
from kvgate.config import (
    KvgateConfig,
    SnapshotHolder,
    compile_snapshot,
    hash_api_key,
    load_config,
    parse_config,
)
from kvgate.metrics import Metrics
from kvgate.reload import FIELD_CLASSES, RELOAD, RESTART, ConfigReloader
from kvgate.tokenize import PromptCounter, TokenizerService
from testbed.demo_model import demo_model_dir
from tests.session.conftest import (
    SessionRig,
    body_msg,
    headers_msg,
    make_config,
    response_body_msg,
    response_headers_msg,
)

CHAT = {"model": "qwen2.5-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def metric(server: KvgateServer, result: str) -> float:
    return sum(
        s.value
        for m in server.metrics.config_reloads.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["result"] == result
    )


async def test_reload_applies_atomically_and_keeps_streams(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    config = make_config()
    path.write_text(yaml.safe_dump(config))
    server = KvgateServer(load_config(path), path)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    rig = SessionRig(server, channel)
    try:
        # A stream admitted under the old config...
        held = rig.stream()
        await held.exchange(headers_msg())
        admitted = await held.exchange(body_msg(CHAT))
        assert admitted.WhichOneof("response") == "request_body"

        # ...then a new tenant and a smaller KV budget arrive.
        config["tenants"].append({"name": "newco", "api_key_sha256": hash_api_key("sk-new")})
        config["backends"][0]["kv_budget_tokens"] = 32_000
        path.write_text(yaml.safe_dump(config))
        assert server.reloader is not None
        assert await server.reloader.reload("test")
        assert server.snapshots.current.backends["gpu-a"].kv_budget_tokens == 32_000
        assert metric(server, "success") == 1

        newcomer = rig.stream()
        reply = await newcomer.exchange(headers_msg(key="sk-new"))
        assert reply.WhichOneof("response") == "request_headers"

        # The old stream finishes and settles normally.
        await held.exchange(response_headers_msg(content_type="application/json"))
        payload = json.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 3}}).encode()
        await held.exchange(response_body_msg(payload, end_of_stream=True))
        assert await rig.in_flight() == (0, 0)
        assert await rig.usage() == (1, 9, 3)

        # A broken config is refused; the previous one keeps serving.
        path.write_text("tenants: [ {name: x, api_key_sha256: not-a-hash} ]\nmodels: []\n")
        assert not await server.reloader.reload("test")
        assert metric(server, "failure") == 1
        assert "api_key_sha256" in (server.reloader.last_error or "")
        still = rig.stream()
        reply = await still.exchange(headers_msg(key="sk-new"))
        assert reply.WhichOneof("response") == "request_headers"

        # Listen addresses are bound at start: changing them is refused, not half-applied.
        config["server"]["grpc_listen"] = "127.0.0.1:1"
        path.write_text(yaml.safe_dump(config))
        assert not await server.reloader.reload("test")
        assert "restart" in (server.reloader.last_error or "")
    finally:
        await channel.close()
        await server.stop()


# -- every field takes effect on reload, or the reload is refused naming it ---------------------


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in typing.get_args(annotation))


def _walk(annotation: Any, path: str, out: set[str]) -> None:
    """Leaf field paths of a config model; "*" for any list item or mapping key."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, info in annotation.model_fields.items():
            _walk(info.annotation, f"{path}.{name}" if path else name, out)
        return
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (list, dict) and _holds_model(args[-1]):
        _walk(args[-1], f"{path}.*", out)
    elif origin in (typing.Union, types.UnionType) and any(_holds_model(a) for a in args):
        (model,) = [a for a in args if _holds_model(a)]  # a model mixed with a scalar is new
        _walk(model, path, out)
    else:
        out.add(path)


def config_field_paths() -> set[str]:
    paths: set[str] = set()
    _walk(KvgateConfig, "", paths)
    return paths


def test_every_config_field_is_classified() -> None:
    """A field added to the config model fails here until its type says how it applies
    (Reload[T] or Restart[T])."""
    paths = config_field_paths()
    assert {"server.lease_ttl_s", "tenants.*.model_limits.*.tpm.capacity"} <= paths
    assert sorted(paths - FIELD_CLASSES.keys()) == [], "type these Reload[T] or Restart[T]"
    assert sorted(FIELD_CLASSES.keys() - paths) == [], "these name no config field"
    assert set(FIELD_CLASSES.values()) == {RELOAD, RESTART}
    # Restart-only fields are compared by path: none may sit under a list or mapping.
    assert not [p for p, kind in FIELD_CLASSES.items() if kind == RESTART and "*" in p]


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


# One change per restart-only field (plus what validation needs with it).
RESTART_EXAMPLES: dict[str, dict[str, Any]] = {
    "server.grpc_listen": {"server.grpc_listen": "127.0.0.1:1"},
    "idempotency.memory_max_bytes": {"idempotency.memory_max_bytes": 2 * 1024 * 1024},
    "response_cache.memory_max_bytes": {"response_cache.memory_max_bytes": 2 * 1024 * 1024},
    # The semantic cache's embedder and index are built at start.
    "semantic_cache.enabled": {"semantic_cache.enabled": True},
    "semantic_cache.embedder.kind": {
        "semantic_cache.embedder": {"kind": "openai", "base_url": "http://e/v1", "model": "m"},
        "semantic_cache.threshold": 0.9,
    },
    "semantic_cache.embedder.dimensions": {"semantic_cache.embedder.dimensions": 128},
    "semantic_cache.embedder.base_url": {
        "semantic_cache.embedder": {"kind": "openai", "base_url": "http://e/v1", "model": "m"},
        "semantic_cache.threshold": 0.9,
    },
    "semantic_cache.embedder.model": {
        "semantic_cache.embedder": {"kind": "openai", "base_url": "http://e/v1", "model": "m"},
        "semantic_cache.threshold": 0.9,
    },
    "semantic_cache.embedder.api_key_env": {"semantic_cache.embedder.api_key_env": "EMBED_KEY"},
    "semantic_cache.embedder.send_dimensions": {"semantic_cache.embedder.send_dimensions": True},
    "semantic_cache.embedder.timeout_s": {"semantic_cache.embedder.timeout_s": 1.0},
    "semantic_cache.embedder.max_queued_per_tenant": {
        "semantic_cache.embedder.max_queued_per_tenant": 2
    },
    "semantic_cache.max_entries_per_context": {"semantic_cache.max_entries_per_context": 8},
    "semantic_cache.mirror_max_bytes": {"semantic_cache.mirror_max_bytes": 2 * 1024 * 1024},
    "semantic_cache.memory_max_bytes": {"semantic_cache.memory_max_bytes": 2 * 1024 * 1024},
    "server.http_listen": {"server.http_listen": "127.0.0.1:2"},
    "server.admin_listen": {"server.admin_listen": "127.0.0.1:3"},
    "server.lease_ttl_s": {"server.lease_ttl_s": 60.0},
    "server.grpc_max_message_bytes": {"server.grpc_max_message_bytes": 8 * 1024 * 1024},
    "store": {"store": "redis://127.0.0.1:1/0"},
    "redis.key_prefix": {"redis.key_prefix": "other"},
    "redis.timeout_s": {"redis.timeout_s": 1.0},
    "redis.connect_timeout_s": {"redis.connect_timeout_s": 1.0},
    "redis.failure_policy": {"redis.failure_policy": "fail_open"},
    "redis.unavailable_retry_after_s": {"redis.unavailable_retry_after_s": 5.0},
    "redis.probe_interval_s": {"redis.probe_interval_s": 3.0},
    "redis.max_pending_settlements": {"redis.max_pending_settlements": 5},
    "redis.settled_id_retention_s": {"redis.settled_id_retention_s": 60.0},
    "redis.answer_store_max_memory_fraction": {"redis.answer_store_max_memory_fraction": 0.5},
    "redis.max_connections": {"redis.max_connections": 8},
    "redis.cluster": {"redis.cluster": True, "redis.sentinel": None},
    "redis.sentinel.master": {"redis.sentinel.master": "other"},
    "redis.sentinel.nodes": {"redis.sentinel.nodes": ["sentinel-b:26379"]},
    "redis.sentinel.password": {"redis.sentinel.password": "changed"},
    "redis.password_env": {"redis.password_env": "KVGATE_REDIS_PASSWORD"},
    "redis.password_file": {"redis.password_file": "/run/secrets/redis/password"},
    "redis.sentinel.password_env": {
        "redis.sentinel.password": None,
        "redis.sentinel.password_env": "KVGATE_SENTINEL_PASSWORD",
    },
    "redis.sentinel.password_file": {
        "redis.sentinel.password": None,
        "redis.sentinel.password_file": "/run/secrets/sentinel/password",
    },
    "tracing.enabled": {"tracing.enabled": True},
    "tracing.otlp_endpoint": {"tracing.otlp_endpoint": "http://127.0.0.1:4317"},
    "tracing.service_name": {"tracing.service_name": "gateway-b"},
    "tracing.sample_ratio": {"tracing.sample_ratio": 0.5},
    "tracing.trust_parent_sampling": {"tracing.trust_parent_sampling": True},
    "tracing.tenant_attribute": {"tracing.tenant_attribute": True},
    "keys.store": {"keys.store": "off"},
    "keys.path": {"keys.path": "/var/other-keys.sqlite3"},
    "keys.cache_entries": {"keys.cache_entries": 7},
    "keys.refresh_s": {"keys.refresh_s": 0.5},
    "usage_records.sink": {"usage_records.sink": "sqlite"},
    "usage_records.sqlite_path": {"usage_records.sqlite_path": "/var/other.sqlite3"},
    "usage_records.postgres_dsn_env": {"usage_records.postgres_dsn_env": "RECORDS_DSN"},
    "usage_records.postgres_dsn_file": {"usage_records.postgres_dsn_file": "/run/dsn"},
    "usage_records.spool_dir": {"usage_records.spool_dir": "/var/other-spool"},
    "usage_records.max_spool_bytes": {"usage_records.max_spool_bytes": 2 * 1024**3},
    "usage_records.max_buffered_records": {"usage_records.max_buffered_records": 5000},
    "usage_records.flush_interval_s": {"usage_records.flush_interval_s": 1.0},
    "usage_records.batch_size": {"usage_records.batch_size": 100},
    "usage_records.write_timeout_s": {"usage_records.write_timeout_s": 3.0},
    "usage_records.retry_interval_s": {"usage_records.retry_interval_s": 2.0},
    # Operator TLS (the files are not read: the refusal comes first).
    "server.operator_https_listen": {
        "server.operator_https_listen": "127.0.0.1:4",
        "server.operator_tls": {"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"},
    },
    "server.operator_tls.cert_file": {
        "server.operator_tls": {"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"}
    },
    "server.operator_tls.key_file": {
        "server.operator_tls": {"cert_file": "/tls/tls.crt", "key_file": "/tls/tls.key"}
    },
    "server.operator_tls.client_ca_file": {
        "server.operator_tls": {
            "cert_file": "/tls/tls.crt",
            "key_file": "/tls/tls.key",
            "client_ca_file": "/tls/ca.crt",
        }
    },
    "server.grpc_tls.cert_file": {
        "server.grpc_tls": {
            "cert_file": "/tls/tls.crt",
            "key_file": "/tls/tls.key",
            "client_ca_file": "/tls/ca.crt",
        }
    },
    "server.grpc_tls.key_file": {
        "server.grpc_tls": {
            "cert_file": "/tls/tls.crt",
            "key_file": "/tls/tls.key",
            "client_ca_file": "/tls/ca.crt",
        }
    },
    "server.grpc_tls.client_ca_file": {
        "server.grpc_tls": {
            "cert_file": "/tls/tls.crt",
            "key_file": "/tls/tls.key",
            "client_ca_file": "/tls/ca.crt",
        }
    },
}


def base_config() -> dict[str, Any]:
    config = make_config()
    # A sentinel section so its fields can change (unused: the store stays "memory").
    config["redis"] = {
        "sentinel": {"master": "main", "nodes": ["sentinel-a:26379"], "password": "pw"}
    }
    return config


@functools.cache
def demo_counter() -> PromptCounter:
    return PromptCounter.from_model_dir(demo_model_dir(), name="qwen2.5-demo")


class ReloadRig:
    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path = path
        self.config = config
        self.write(config)
        loaded = load_config(path)
        self.snapshots = SnapshotHolder(compile_snapshot(loaded))
        self.tokenizers = TokenizerService(
            max_workers=loaded.server.tokenizer_threads,
            cache_size=loaded.server.tokenizer_cache_entries,
        )
        self.tokenizers.register("qwen2.5-demo", demo_counter())
        self.reloader = ConfigReloader(
            path, snapshots=self.snapshots, tokenizers=self.tokenizers, metrics=Metrics()
        )

    def write(self, config: dict[str, Any]) -> None:
        self.path.write_text(yaml.safe_dump(config))

    async def reload_with(self, changes: dict[str, Any]) -> bool:
        config = copy.deepcopy(self.config)
        for path, value in changes.items():
            _set(config, path, value)
        self.write(config)
        applied = await self.reloader.reload("test")
        if applied:
            self.config = config
        return applied


@pytest.fixture
async def reload_rig(tmp_path: Path) -> AsyncIterator[ReloadRig]:
    rig = ReloadRig(tmp_path / "kvgate.yaml", base_config())
    yield rig
    rig.tokenizers.close()


def test_every_restart_only_field_has_an_example() -> None:
    assert RESTART_EXAMPLES.keys() == {p for p, k in FIELD_CLASSES.items() if k == RESTART}


@pytest.mark.parametrize("field", sorted(RESTART_EXAMPLES))
async def test_restart_only_field_refuses_the_reload(reload_rig: ReloadRig, field: str) -> None:
    before = reload_rig.snapshots.current
    changes = {**RESTART_EXAMPLES[field], "server.decision_timeout_s": 0.5}
    assert not await reload_rig.reload_with(changes)
    error = reload_rig.reloader.last_error or ""
    assert field in error and "restart" in error
    # Nothing of the file applied, not even the fields that could have been.
    assert reload_rig.snapshots.current is before
    assert reload_rig.reloader.generation == 1


async def test_refusal_names_every_changed_restart_field(reload_rig: ReloadRig) -> None:
    changes = {"server.lease_ttl_s": 30.0, "server.admin_listen": "127.0.0.1:9", "store": "memory"}
    assert not await reload_rig.reload_with(changes)
    error = reload_rig.reloader.last_error or ""
    assert "server.lease_ttl_s" in error and "server.admin_listen" in error
    assert "store" not in error.replace(str(reload_rig.path), "")  # unchanged: not named


# Reloadable fields held outside the snapshot: each is applied by the reloader.
LIVE_CHANGES: list[tuple[str, Any, Callable[[ReloadRig], bool]]] = [
    ("server.tokenizer_threads", 3, lambda rig: rig.tokenizers.max_workers == 3),
    (
        "server.tokenizer_cache_entries",
        16,
        lambda rig: rig.tokenizers.cache_stats().capacity == 16,
    ),
    ("server.log_level", "DEBUG", lambda rig: logging.getLogger().level == logging.DEBUG),
]


@pytest.mark.parametrize(
    ("field", "value", "applied"), LIVE_CHANGES, ids=[c[0] for c in LIVE_CHANGES]
)
async def test_server_field_applies_on_reload(
    reload_rig: ReloadRig, field: str, value: Any, applied: Callable[[ReloadRig], bool]
) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        assert not applied(reload_rig)
        assert await reload_rig.reload_with({field: value})
        assert applied(reload_rig)
    finally:
        root.setLevel(level)


async def test_new_tokenizer_cache_dir_reloads_every_tokenizer(
    reload_rig: ReloadRig, tmp_path: Path
) -> None:
    before = reload_rig.tokenizers.counter("qwen2.5-demo")
    assert await reload_rig.reload_with({"server.tokenizer_cache_dir": str(tmp_path / "tok")})
    after = reload_rig.tokenizers.counter("qwen2.5-demo")
    assert after is not before
    assert after.count_text("hello world") == before.count_text("hello world")


async def test_snapshot_fields_apply_on_reload(reload_rig: ReloadRig) -> None:
    """Fields read from the snapshot per request are accepted and visible at once."""
    changes = {
        "server.decision_timeout_s": 0.5,
        "server.cut_request_charge": "visible_text",
        "tenants": [
            {
                "name": "acme",
                "api_key_sha256": hash_api_key("sk-other"),
                "limits": {"rpm": 10, "tpm": {"capacity": 1000, "refill_per_s": 5}},
            }
        ],
    }
    assert await reload_rig.reload_with(changes)
    current = reload_rig.snapshots.current
    assert current.config.server.decision_timeout_s == 0.5
    assert current.tenants_by_key_hash == {hash_api_key("sk-other"): "acme"}
    assert reload_rig.reloader.generation == 2


async def test_shutdown_grace_is_read_from_the_reloaded_config(tmp_path: Path) -> None:
    config = make_config()
    server = KvgateServer(parse_dict(config))
    config["server"]["shutdown_grace_s"] = 3.0
    server.snapshots.swap(compile_snapshot(parse_dict(config)))  # what a reload does
    graces: list[float | None] = []

    class FakeGrpc:
        async def stop(self, grace: float | None) -> None:
            graces.append(grace)

    server._grpc = FakeGrpc()  # type: ignore[assignment]
    await server.stop()
    assert graces == [3.0]


def parse_dict(config: dict[str, Any]) -> KvgateConfig:
    return parse_config(copy.deepcopy(config))
