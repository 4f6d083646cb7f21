"""Pool membership and endpoint health (capacity/pools.py), without Envoy."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp import web

from kvgate.capacity.pools import PoolRegistry
from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import ConfigError, hash_api_key, parse_config
from kvgate.config.model import DEFAULT_MAX_AUTO_KV_BUDGET_TOKENS
from kvgate.metrics import Metrics
from kvgate.policy import BackendLimits

_METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
"""


def _config(backend: dict) -> object:
    return parse_config(
        {
            "tenants": [{"name": "t", "api_key_sha256": hash_api_key("k")}],
            "models": [
                {
                    "name": "m",
                    "tokenizer": "unused",
                    "max_context": 4096,
                    "default_max_new_tokens": 16,
                    "backend": "pool",
                }
            ],
            "backends": [{"name": "pool", "kv_block_size": 16, **backend}],
        }
    )


async def test_dns_members_are_every_address_the_name_resolves_to() -> None:
    registry = PoolRegistry()
    config = _config(
        {
            "kv_budget_tokens": 1024,
            "endpoint_discovery": {
                "dns_name": "localhost",
                "port": 8123,
                "refresh_s": 60,
                # Loopback joins a pool only when a range inside it is allowed explicitly.
                "allowed_cidrs": ["127.0.0.0/8", "::1/128"],
            },
        }
    )
    try:
        await registry.sync(config)  # type: ignore[arg-type]
        members = set(registry.members("pool"))
        expected = {
            f"[{info[4][0]}]:8123" if info[0] == socket.AF_INET6 else f"{info[4][0]}:8123"
            for info in socket.getaddrinfo("localhost", 8123, type=socket.SOCK_STREAM)
        }
        assert members == expected and "127.0.0.1:8123" in members
        view = registry.view("pool")
        # No discovery: a static budget and nothing to check, so every member is pickable.
        assert len(view.pickable) == len(members)
        assert {e.key for e in view.pickable} == {f"pool/{m}" for m in members}
    finally:
        await registry.close()


async def test_an_endpoint_whose_scrape_fails_is_not_picked_and_auto_budget_is_per_endpoint() -> (
    None
):
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=_METRICS)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    registry = PoolRegistry()
    config = _config(
        {
            "kv_budget_tokens": "auto",
            "endpoints": [f"127.0.0.1:{port}", f"127.0.0.1:{dead}"],
            "discovery": {
                "metrics_url": "http://{endpoint}/metrics",
                "interval_s": 60,
                "timeout_s": 1,
            },
        }
    )
    try:
        await registry.sync(config)  # type: ignore[arg-type]
        view = registry.view("pool")
        assert [e.address for e in view.pickable] == [f"127.0.0.1:{port}"]
        assert view.unhealthy == 1
        [live] = view.pickable
        assert live.limits.kv_budget_tokens == 1600 and live.limits.kv_block_size == 16
        assert live.waiting == 3
    finally:
        await registry.close()
        await runner.cleanup()


async def test_membership_is_bounded_whatever_dns_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name answering with 1,000 A records (a hostile or broken DNS) makes a pool of
    max_endpoints members, not 1,000 scrapers. (The resolver's answer is made up here: the
    machine's own DNS has no such name.)"""

    async def many(host: str, port: int, **_kwargs: object) -> list[tuple]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.{i // 250}.{i % 250}", port))
            for i in range(1000)
        ]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", many)
    registry = PoolRegistry()
    config = _config(
        {
            "kv_budget_tokens": 1024,
            "endpoint_discovery": {"dns_name": "vllm.example", "port": 8123, "max_endpoints": 8},
        }
    )
    try:
        await registry.sync(config)  # type: ignore[arg-type]
        assert len(registry.members("pool")) == 8
    finally:
        await registry.close()


async def test_a_pool_whose_checks_all_fail_degrades_instead_of_halting() -> None:
    """Every endpoint's scrape fails (stale metrics, not necessarily dead pods): none is
    pickable, but those whose budget is known are offered as degraded, so the scheduler
    still admits against its own reservations."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    registry = PoolRegistry()
    config = _config(
        {
            "kv_budget_tokens": 1024,
            "endpoints": [f"127.0.0.1:{dead}", "127.0.0.2:9"],
            "discovery": {"metrics_url": "http://{endpoint}/metrics", "timeout_s": 0.5},
        }
    )
    try:
        await registry.sync(config)  # type: ignore[arg-type]
        view = registry.view("pool")
        assert view.pickable == () and view.unhealthy == 2
        assert sorted(e.address for e in view.degraded) == sorted(
            [f"127.0.0.1:{dead}", "127.0.0.2:9"]
        )
    finally:
        await registry.close()


# --- an endpoint's own claim of its KV cache ----------------------------------------------

# 10^9 blocks of 16 tokens: 16 G tokens of "KV cache", what a rogue pod can simply print.
_HUGE_METRICS = _METRICS.replace('num_gpu_blocks="100"', 'num_gpu_blocks="1000000000"')


async def _metrics_server(text: str) -> tuple[web.AppRunner, int]:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _capped(metrics: Metrics, key: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvgate_kv_budget_capped_reports_total", {"backend": key}
    )
    return value or 0.0


async def test_a_huge_reported_kv_cache_is_capped_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    honest, honest_port = await _metrics_server(_METRICS)
    rogue, rogue_port = await _metrics_server(_HUGE_METRICS)
    metrics = Metrics()
    registry = PoolRegistry(metrics=metrics)
    rogue_key = f"pool/127.0.0.1:{rogue_port}"
    backend = {
        "kv_budget_tokens": "auto",
        "max_auto_kv_budget_tokens": 8000,
        "endpoints": [f"127.0.0.1:{honest_port}", f"127.0.0.1:{rogue_port}"],
        "discovery": {"metrics_url": "http://{endpoint}/metrics", "interval_s": 60},
    }
    caplog.set_level(logging.WARNING, logger="kvgate.pools")
    try:
        await registry.sync(_config(backend))  # type: ignore[arg-type]
        for _ in range(3):  # views are per request: they neither count nor log
            budgets = {e.key: e.limits.kv_budget_tokens for e in registry.view("pool").pickable}
        assert budgets == {f"pool/127.0.0.1:{honest_port}": 1600, rogue_key: 8000}
        assert _capped(metrics, rogue_key) == 1
        assert _capped(metrics, f"pool/127.0.0.1:{honest_port}") == 0
        monitor = registry._pools["pool"].monitors[f"127.0.0.1:{rogue_port}"]
        assert await monitor.poll_once()  # every scrape of a capped claim counts ...
        assert _capped(metrics, rogue_key) == 2
        warnings = [r for r in caplog.records if "max_auto_kv_budget_tokens" in r.getMessage()]
        assert len(warnings) == 1  # ... and is logged once
        assert "16000000000" in warnings[0].getMessage()

        # A lower cap applies on reload, to the budget already read, without a restart.
        await registry.sync(_config({**backend, "max_auto_kv_budget_tokens": 4000}))  # type: ignore[arg-type]
        budgets = {e.key: e.limits.kv_budget_tokens for e in registry.view("pool").pickable}
        assert budgets[rogue_key] == 4000
        assert registry._pools["pool"].monitors[f"127.0.0.1:{rogue_port}"] is monitor
    finally:
        await registry.close()
        await honest.cleanup()
        await rogue.cleanup()


async def test_a_single_backends_auto_budget_is_capped_too() -> None:
    rogue, port = await _metrics_server(_HUGE_METRICS)
    metrics = Metrics()
    registry = CapacityRegistry(metrics=metrics)
    config = parse_config(
        {
            "tenants": [{"name": "t", "api_key_sha256": hash_api_key("k")}],
            "models": [
                {
                    "name": "m",
                    "tokenizer": "unused",
                    "max_context": 4096,
                    "default_max_new_tokens": 16,
                    "backend": "vllm",
                }
            ],
            "backends": [
                {
                    "name": "vllm",
                    "kv_budget_tokens": "auto",
                    "discovery": {"metrics_url": f"http://127.0.0.1:{port}/metrics"},
                }
            ],
        }
    )
    try:
        await registry.sync(config)
        limits = BackendLimits(
            name="vllm", kv_budget_tokens=1, kv_block_size=16, max_concurrent_requests=8
        )
        effective = registry.effective_limits(limits, auto=True)
        # The default cap: 4 Mi tokens, not the 16 G tokens the endpoint claims.
        assert effective is not None
        assert effective.kv_budget_tokens == DEFAULT_MAX_AUTO_KV_BUDGET_TOKENS
        assert _capped(metrics, "vllm") == 1
    finally:
        await registry.close()
        await rogue.cleanup()


def test_the_cap_is_for_automatic_budgets_and_holds_a_block() -> None:
    pool = {"endpoints": ["10.0.0.5:8000"]}
    with pytest.raises(ConfigError, match="caps kv_budget_tokens: auto"):
        _config({**pool, "kv_budget_tokens": 1024, "max_auto_kv_budget_tokens": 4096})
    auto = {
        **pool,
        "kv_budget_tokens": "auto",
        "discovery": {"metrics_url": "http://{endpoint}/metrics"},
    }
    with pytest.raises(ConfigError, match="at least one KV block"):
        _config({**auto, "max_auto_kv_budget_tokens": 8})
    with pytest.raises(ConfigError, match="greater than 0"):
        _config({**auto, "max_auto_kv_budget_tokens": 0})
    with pytest.raises(ConfigError, match="max_body_bytes"):
        _config({**auto, "discovery": {"metrics_url": "http://{endpoint}/m", "max_body_bytes": 1}})
    assert _config(auto).backends[0].max_auto_kv_budget_tokens == 4 * 1024 * 1024  # type: ignore[attr-defined]
