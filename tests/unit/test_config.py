"""Configuration validation: every error names the field and the reason."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.config import ConfigError, compile_snapshot, hash_api_key, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deploy/local/kvgate.yaml"


def base() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_demo_config_loads_and_compiles() -> None:
    snapshot = compile_snapshot(load_config(DEMO))
    assert snapshot.tenants_by_key_hash[hash_api_key("sk-kvgate-demo")] == "demo"
    assert snapshot.models["qwen2.5-demo"].backend == "vllm-local"
    assert snapshot.backends["vllm-local"].kv_budget_tokens == 48_000


def test_hash_key_matches_sha256() -> None:
    assert hash_api_key("sk-kvgate-demo") == (
        "3e0d2fcfa074e6300f7d4f6f15fcad9a4f12255fd20bc4f69a9036b348dc4c34"
    )


def _mutated(path: list, value) -> dict:
    data = copy.deepcopy(base())
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (["tenants", 0, "api_key_sha256"], "sk-kvgate-demo", "tenants.0.api_key_sha256"),
        (["models", 0, "backend"], "nowhere", "models.0.backend: 'nowhere'"),
        (["models", 0, "max_context"], 0, "models.0.max_context"),
        (
            ["models", 0, "tokenizer"],
            KeyError,
            "models.0: tokenizer: counting: local needs the model's tokenizer",
        ),
        (["backends", 0, "kv_budget_tokens"], -5, "backends.0.kv_budget_tokens"),
        (["backends", 0, "kv_block_size"], 100_000, "at least one KV block"),
        (["backends", 0, "name"], "bad name!", "backends.0.name"),
        (["server", "grpc_listen"], "50051", "server.grpc_listen"),
        (["server", "unknown_field"], 1, "server.unknown_field: Extra inputs"),
        (["store"], "postgres", "store"),
        # Pools: Envoy's ORIGINAL_DST cluster takes IP:PORT only, never a host name.
        (["backends", 0, "endpoints"], ["vllm-0:8000"], "is not an IP address"),
        (["backends", 0, "endpoints"], ["10.0.0.1"], "must be IP:PORT"),
        (["backends", 0, "endpoints"], ["fd00::1:8000"], "IPv6 address in brackets"),
        (["backends", 0, "endpoints"], ["10.0.0.1:8000", "10.0.0.1:8000"], "twice"),
        (["backends", 0, "endpoints"], [], "at least one"),
        (["backends", 0, "queue"], {"max_wait_s": 5}, "queue needs a pool"),
        (["tenants", 0, "allowed_priorities"], ["high"], "tenants.0.allowed_priorities"),
        (["tenants", 0, "priority"], 1000, "tenants.0.priority"),
    ],
)
def test_errors_name_the_field(path: list, value, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_mutated(path, value), "cfg.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("cfg.yaml: invalid configuration")


def test_duplicate_names_and_shared_keys_are_rejected() -> None:
    data = base()
    data["tenants"].append(dict(data["tenants"][0], name="other"))
    with pytest.raises(ConfigError, match="share an API key"):
        parse_config(data)
    data = base()
    data["models"].append(data["models"][0])
    with pytest.raises(ConfigError, match=r"'qwen2\.5-demo' appears twice"):
        parse_config(data)


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_cli_check_config_and_hash_key(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "check-config", str(DEMO)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "OK (1 tenants, 1 models, 1 backends)" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutated(["models", 0, "backend"], "nowhere")))
    failed = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert failed.returncode == 2
    assert "models.0.backend" in failed.stderr
    hashed = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "hash-key"],
        input="sk-kvgate-demo\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert hashed.stdout.strip() == hash_api_key("sk-kvgate-demo")


def test_a_pool_scrapes_each_endpoint_and_its_template_is_checked() -> None:
    pool = {
        "name": "vllm-local",
        "kv_budget_tokens": "auto",
        "endpoints": ["10.0.0.1:8000", "[fd00::2]:8000"],
        "discovery": {"metrics_url": "http://vllm:8000/metrics"},
    }
    data = base()
    data["backends"] = [pool]
    with pytest.raises(ConfigError, match=r"must contain \{endpoint\}"):
        parse_config(data)
    pool["discovery"] = {"metrics_url": "http://{endpoint}/metrics"}
    config = parse_config(data)
    assert config.backends[0].is_pool
    assert compile_snapshot(config).queued_pools == frozenset()
    pool["endpoint_discovery"] = {"dns_name": "vllm.ns.svc", "port": 8000}
    with pytest.raises(ConfigError, match="endpoints or endpoint_discovery, not both"):
        parse_config(data)


def test_every_wait_of_one_message_must_fit_one_envoy_extension() -> None:
    """Envoy extends a message's timeout once: an Idempotency-Key's wait, a pool's queue and
    the budget fallback model's pool's queue may all happen to one request body."""
    data = base()
    data["backends"][0]["endpoints"] = ["10.0.0.1:8000"]
    data["backends"][0]["queue"] = {"max_wait_s": 20}
    parse_config(data)  # 10 s (key) + 20 s (queue) + 1.5 s + 1 s fit 35 s
    data["idempotency"] = {"max_wait_s": 15}
    with pytest.raises(ConfigError, match=r"one request may wait 37\.5 s in all"):
        parse_config(data)
    data["idempotency"] = {"enabled": False}
    data["tenants"][0]["budget"] = {
        "daily_usd": "1",
        "action": "fallback",
        "fallback_model": data["models"][0]["name"],
    }
    # A fallback re-queues in its model's pool: 20 s twice.
    with pytest.raises(ConfigError, match="a budget fallback pool's queue 20 s"):
        parse_config(data)


def test_a_queue_bound_envoy_would_not_honour_is_refused() -> None:
    data = base()
    data["backends"][0]["endpoints"] = ["10.0.0.1:8000"]
    data["backends"][0]["queue"] = {"max_wait_s": 33}
    with pytest.raises(ConfigError, match="envoy_max_message_timeout_s") as info:
        parse_config(data)
    assert "backends.0.queue.max_wait_s: 33 s" in str(info.value)
    data["server"]["envoy_max_message_timeout_s"] = 60
    assert parse_config(data).backends[0].queue.max_wait_s == 33  # type: ignore[union-attr]


def test_a_tenant_without_a_key_needs_an_identity_source() -> None:
    data = base()
    data["tenants"].append({"name": "mesh-only"})
    # Keys made through the admin API can name it...
    assert parse_config(data).keys.store == "auto"
    # ...and without them nothing can.
    data["keys"] = {"store": "off"}
    with pytest.raises(ConfigError, match="'mesh-only' has no API key"):
        parse_config(data)
    data["identity"] = {"spiffe": {"tenants": {"spiffe://cluster.local/ns/a/sa/b": "mesh-only"}}}
    assert parse_config(data).identity.spiffe is not None
    data["identity"] = {"jwt": {"tenant_claim": "org.team"}}
    assert parse_config(data).identity.jwt is not None


@pytest.mark.parametrize(
    ("spiffe", "expected"),
    [
        ({"spiffe://cluster.local/ns/a/sa/b": "nobody"}, "names 'nobody', not a tenant"),
        ({"https://cluster.local/ns/a": "demo"}, "is not a SPIFFE ID"),
        ({}, "identity.spiffe.tenants"),
    ],
)
def test_spiffe_ids_name_tenants(spiffe: dict[str, str], expected: str) -> None:
    data = base()
    data["identity"] = {"spiffe": {"tenants": spiffe}}
    with pytest.raises(ConfigError, match=expected):
        parse_config(data)
