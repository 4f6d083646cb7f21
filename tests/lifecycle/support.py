"""What several lifecycle test modules share: a chat body, and a static pool of three endpoints
behind the real admission path (the memory store, the demo tokenizer; nothing listens on the
endpoints: no discovery, so they are all pickable)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.capacity.pools import PoolRegistry
from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import compile_snapshot, hash_api_key, parse_config
from kvgate.lifecycle import Admission
from kvgate.lifecycle.scheduler import PoolScheduler
from kvgate.metrics import Metrics
from kvgate.openai import parse_request
from kvgate.store import MemoryStore
from kvgate.tokenize import PromptCounter, TokenizerService
from testbed.demo_model import demo_model_dir

MODEL = "qwen2.5-demo"
CHAT = "/v1/chat/completions"


def chat(content: str = "hello there", **fields: object) -> bytes:
    import json

    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    ).encode()


ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def pool_config(*, queue: dict[str, Any] | None = None, tpm: int | None = None) -> dict[str, Any]:
    limits = {"tpm": {"capacity": tpm}} if tpm else {}
    return {
        "tenants": [
            {"name": "heavy", "api_key_sha256": hash_api_key("h"), "limits": limits},
            {"name": "light", "api_key_sha256": hash_api_key("l")},
        ],
        "models": [
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": 4096,
                "default_max_new_tokens": 100,
                "backend": "pool",
            }
        ],
        "backends": [
            {
                "name": "pool",
                "kv_budget_tokens": 1024,
                "kv_block_size": 16,
                "endpoints": ENDPOINTS,
                **({"queue": queue} if queue else {}),
            }
        ],
    }


class Pool:
    def __init__(self, config: dict[str, Any]) -> None:
        self.parsed = parse_config(config)
        self.snapshot = compile_snapshot(self.parsed)
        self.store = MemoryStore(lease_ttl_s=60)
        self.tokenizers = TokenizerService(max_workers=1)
        self.tokenizers.register(MODEL, PromptCounter.from_model_dir(demo_model_dir(), name=MODEL))
        self.registry = PoolRegistry()
        self.metrics = Metrics()
        self.scheduler = PoolScheduler(
            self.registry, self.store.backend_status, shared_store=False, metrics=self.metrics
        )
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.registry.sync(self.parsed)
        self.scheduler.sync(self.parsed)

    def admission(self) -> Admission:
        def track(coro: Any) -> asyncio.Task[None]:
            task = asyncio.get_running_loop().create_task(coro)
            self.tasks.add(task)
            return task

        return Admission(
            snapshot=self.snapshot,
            store=self.store,
            tokenizers=self.tokenizers,
            capacity=CapacityRegistry(),
            record_violations=lambda _t, _d: None,
            track=track,
            scheduler=self.scheduler,
        )

    async def admit(self, tenant: str, text: str, max_tokens: int, **kwargs: Any) -> Any:
        body = b'{"model":"%s","max_tokens":%d,"messages":[{"role":"user","content":"%s"}]}' % (
            MODEL.encode(),
            max_tokens,
            text.encode(),
        )
        request = parse_request("/v1/chat/completions", body)
        policy = self.snapshot.tenants[tenant]
        return await self.admission().admit(request, policy, text, f"{tenant}-{text}", **kwargs)

    async def close(self) -> None:
        await self.registry.close()
        self.tokenizers.close()
