"""Lifecycle fixtures: the real memory store, counting service and config snapshot, no
server, no gRPC, no Envoy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import SnapshotHolder, compile_snapshot, hash_api_key, parse_config
from kvgate.lifecycle import Admission, LeaseKeeper, Settler
from kvgate.metrics import Metrics
from kvgate.policy import Decision
from kvgate.store import MemoryStore
from kvgate.tokenize import PromptCounter, TokenizerService
from testbed.demo_model import demo_model_dir
from tests.lifecycle.support import Pool, pool_config

MODEL = "qwen2.5-demo"


def config(**tenant_limits: Any) -> dict[str, Any]:
    return {
        "tenants": [{"name": "acme", "api_key_sha256": hash_api_key("k"), "limits": tenant_limits}],
        "models": [
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": 4096,
                "default_max_new_tokens": 100,
                "backend": "gpu",
                "pricing": {"input_per_million": "1", "output_per_million": "2"},
            }
        ],
        "backends": [{"name": "gpu", "kv_budget_tokens": 8192, "kv_block_size": 16}],
    }


@dataclass
class Lifecycle:
    snapshots: SnapshotHolder
    store: MemoryStore
    tokenizers: TokenizerService
    metrics: Metrics
    leases: LeaseKeeper
    settler: Settler
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    violations: list[Decision] = field(default_factory=list)

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        return task

    def admission(self) -> Admission:
        return Admission(
            snapshot=self.snapshots.current,
            store=self.store,
            tokenizers=self.tokenizers,
            capacity=CapacityRegistry(),
            record_violations=lambda _tenant, decision: self.violations.append(decision),
            track=self.track,
        )

    async def drain(self) -> None:
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)

    async def in_flight(self) -> tuple[int, int]:
        [status] = await self.store.backend_status() or [None]
        return (0, 0) if status is None else (status.kv_tokens_in_flight, status.requests_in_flight)


async def make_lifecycle(**tenant_limits: Any) -> AsyncIterator[Lifecycle]:
    snapshots = SnapshotHolder(compile_snapshot(parse_config(config(**tenant_limits))))
    store = MemoryStore(lease_ttl_s=60)
    tokenizers = TokenizerService(max_workers=2)
    tokenizers.register(MODEL, PromptCounter.from_model_dir(demo_model_dir(), name=MODEL))
    metrics = Metrics()
    leases = LeaseKeeper(store, metrics, lambda: 20.0)
    holder: list[Lifecycle] = []
    settler = Settler(
        store=store,
        snapshots=snapshots,
        metrics=metrics,
        leases=leases,
        track=lambda coro: holder[0].track(coro),
    )
    life = Lifecycle(snapshots, store, tokenizers, metrics, leases, settler)
    holder.append(life)
    try:
        yield life
    finally:
        leases.close()
        await life.drain()
        tokenizers.close()


@pytest.fixture
async def life() -> AsyncIterator[Lifecycle]:
    async for value in make_lifecycle():
        yield value


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    value = Pool(pool_config())
    await value.start()
    yield value
    await value.close()
