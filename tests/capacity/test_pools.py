"""Pool membership and endpoint health (capacity/pools.py), without Envoy."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from kvgate.capacity.pools import PoolRegistry
from kvgate.config import hash_api_key, parse_config

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
