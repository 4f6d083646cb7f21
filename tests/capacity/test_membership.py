"""Which addresses a pool's DNS name may bring in (endpoint_discovery.allowed_cidrs).

The resolver's answers are made up (the machine's DNS has no hostile name): loop.getaddrinfo
returns what a poisoned record or a hijacked Service would, next to one ordinary pod.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from kvgate.capacity.membership import AddressPolicy
from kvgate.capacity.pools import PoolRegistry
from kvgate.config import ConfigError, KvgateConfig, hash_api_key, parse_config
from kvgate.config.model import DEFAULT_ALLOWED_ENDPOINT_CIDRS
from kvgate.metrics import Metrics

POD = "10.0.0.5"
PORT = 8123


def _config(**endpoint_discovery: Any) -> KvgateConfig:
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
            "backends": [
                {
                    "name": "pool",
                    "kv_budget_tokens": 1024,
                    "endpoint_discovery": {
                        "dns_name": "vllm.example",
                        "port": PORT,
                        **endpoint_discovery,
                    },
                }
            ],
        }
    )


class FakeResolver:
    """Answers every lookup with `answer` (changeable between refreshes)."""

    def __init__(self, answer: list[str]) -> None:
        self.answer = answer

    async def __call__(self, host: str, port: int, **_kwargs: object) -> list[tuple]:
        return [
            (
                socket.AF_INET6 if ":" in ip else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (ip, port, 0, 0) if ":" in ip else (ip, port),
            )
            for ip in self.answer
        ]


def _refused(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvgate_pool_refused_addresses_total", {"pool": "pool", "reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize(
    "hostile, member, reason",
    [
        ("169.254.169.254", "169.254.169.254:8123", "link_local"),  # the cloud metadata service
        ("127.0.0.1", "127.0.0.1:8123", "loopback"),
        ("::1", "[::1]:8123", "loopback"),
        ("fe80::1", "[fe80::1]:8123", "link_local"),
        ("0.0.0.0", "0.0.0.0:8123", "unspecified"),
        ("::", "[::]:8123", "unspecified"),
        ("224.0.0.251", "224.0.0.251:8123", "multicast"),
        ("8.8.8.8", "8.8.8.8:8123", "public"),  # only private ranges are allowed by default
        ("::ffff:169.254.169.254", "[::ffff:169.254.169.254]:8123", "link_local"),
    ],
)
async def test_a_discovered_address_outside_the_allowed_ranges_never_joins(
    monkeypatch: pytest.MonkeyPatch, hostile: str, member: str, reason: str
) -> None:
    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", FakeResolver([hostile, POD]))
    metrics = Metrics()
    registry = PoolRegistry(metrics=metrics)
    try:
        await registry.sync(_config())
        assert list(registry.members("pool")) == [f"{POD}:{PORT}"]
        assert member not in {e.address for e in registry.view("pool").pickable}
        assert _refused(metrics, reason) == 1
    finally:
        await registry.close()


async def test_a_refused_address_is_logged_and_counted_once_while_it_lasts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    resolver = FakeResolver(["169.254.169.254", POD])
    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", resolver)
    metrics = Metrics()
    registry = PoolRegistry(metrics=metrics)
    caplog.set_level(logging.WARNING, logger="kvgate.pools")
    try:
        await registry.sync(_config(refresh_s=0.02))
        await asyncio.sleep(0.2)  # about ten refreshes with the same answer
        refusals = [r for r in caplog.records if "169.254.169.254" in r.getMessage()]
        assert len(refusals) == 1 and "link_local" in refusals[0].getMessage()
        assert _refused(metrics, "link_local") == 1
        # It leaves the answer and comes back: a new refusal, logged and counted again.
        resolver.answer = [POD]
        await asyncio.sleep(0.1)
        resolver.answer = ["169.254.169.254", POD]
        await asyncio.sleep(0.1)
        assert _refused(metrics, "link_local") == 2
    finally:
        await registry.close()


async def test_an_answer_of_only_refused_addresses_keeps_the_last_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record swapped for the metadata address must not empty the pool, nor join it."""
    resolver = FakeResolver([POD])
    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", resolver)
    registry = PoolRegistry(metrics=Metrics())
    try:
        await registry.sync(_config(refresh_s=0.02))
        resolver.answer = ["169.254.169.254"]
        await asyncio.sleep(0.15)
        assert list(registry.members("pool")) == [f"{POD}:{PORT}"]
    finally:
        await registry.close()


async def test_loopback_joins_when_a_range_inside_it_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        asyncio.get_running_loop(), "getaddrinfo", FakeResolver(["127.0.0.1", "::1", POD])
    )
    registry = PoolRegistry(metrics=Metrics())
    try:
        await registry.sync(_config(allowed_cidrs=["127.0.0.0/8", "::1/128", "10.0.0.0/8"]))
        assert sorted(registry.members("pool")) == sorted(
            [f"127.0.0.1:{PORT}", f"[::1]:{PORT}", f"{POD}:{PORT}"]
        )
    finally:
        await registry.close()


def test_a_wide_range_never_admits_loopback_or_link_local() -> None:
    """0.0.0.0/0 says "any pod address", not "this host" or "the metadata service"."""
    anywhere = AddressPolicy.from_cidrs(["0.0.0.0/0", "::/0"])
    assert anywhere.refusal("8.8.8.8") is None
    assert anywhere.refusal("2606:4700::1") is None
    assert anywhere.refusal("127.0.0.1") == "loopback"
    assert anywhere.refusal("::1") == "loopback"
    assert anywhere.refusal("169.254.169.254") == "link_local"
    assert anywhere.refusal("fe80::1%eth0") == "link_local"
    assert anywhere.refusal("0.0.0.0") == "unspecified"
    assert anywhere.refusal("255.255.255.255") == "multicast"
    metadata_only = AddressPolicy.from_cidrs(["169.254.169.254/32"])
    assert metadata_only.refusal("169.254.169.254") is None  # written out: the operator's call
    assert metadata_only.refusal("169.254.0.1") == "link_local"


def test_the_default_ranges_are_the_private_ones() -> None:
    default = AddressPolicy.from_cidrs(DEFAULT_ALLOWED_ENDPOINT_CIDRS)
    for pod in ("10.1.2.3", "172.16.0.9", "192.168.1.1", "100.64.0.7", "fd00::5"):
        assert default.refusal(pod) is None, pod
    assert default.refusal("172.32.0.1") == "public"
    assert default.refusal("198.18.0.1") == "not_allowed"  # benchmarking range: not a pod's
    assert default.refusal("::ffff:10.0.0.1") is None  # IPv4-mapped: judged as 10.0.0.1
    assert _config().backends[0].endpoint_discovery.allowed_cidrs == list(  # type: ignore[union-attr]
        DEFAULT_ALLOWED_ENDPOINT_CIDRS
    )


@pytest.mark.parametrize(
    "cidrs, message",
    [
        ([], "at least 1 item"),
        (["10.0.0.5/8"], "not a CIDR range"),  # host bits set: a typo for 10.0.0.0/8?
        (["vllm.example/32"], "not a CIDR range"),
        (["10.0.0.0/33"], "not a CIDR range"),
    ],
)
def test_allowed_cidrs_must_be_ranges(cidrs: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(allowed_cidrs=cidrs)
