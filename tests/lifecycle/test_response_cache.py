"""Which requests the exact-match cache may serve: the operator's choice for sampled ones,
per tenant or per model (the tenant's word first)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.config.model import ModelConfig, ResponseCacheConfig, TenantConfig
from kvgate.lifecycle.digest import body_digest
from kvgate.lifecycle.response_cache import (
    SHARED_SCOPE,
    cache_key,
    cache_scope,
    cacheable,
    deterministic,
)
from kvgate.openai import CHAT_PATH, ParsedRequest, parse_request

ON = ResponseCacheConfig(enabled=True)


def chat(**extra: Any) -> ParsedRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_request(CHAT_PATH, json.dumps(body).encode())


def tenant(**fields: Any) -> TenantConfig:
    return TenantConfig(name="t", api_key_sha256="0" * 64, **fields)


def model(**fields: Any) -> ModelConfig:
    return ModelConfig(
        name="m", tokenizer="x", max_context=8, default_max_new_tokens=4, backend="b", **fields
    )


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [(0, True), (0.0, True), (0.7, False), (False, False), (None, False), ("0", False)],
)
def test_only_greedy_decoding_is_deterministic(temperature: Any, expected: bool) -> None:
    body = {} if temperature is None else {"temperature": temperature}
    assert deterministic(body) is expected


def test_sampled_requests_follow_the_tenant_then_the_model_then_the_cache() -> None:
    sampled = chat(temperature=0.7)
    assert not cacheable(sampled.body, ON, tenant(), model())
    assert cacheable(sampled.body, ON, tenant(), model(response_cache_sampled=True))
    assert cacheable(sampled.body, ON.model_copy(update={"sampled": True}), tenant(), model())
    # The tenant's explicit word beats the model's and the cache's.
    assert not cacheable(
        sampled.body,
        ON.model_copy(update={"sampled": True}),
        tenant(response_cache_sampled=False),
        model(response_cache_sampled=True),
    )
    assert cacheable(sampled.body, ON, tenant(response_cache_sampled=True), model())
    # Greedy requests are cacheable whatever the sampled settings say.
    assert cacheable(chat(temperature=0).body, ON, tenant(), model(response_cache_sampled=False))


def test_a_tenant_may_opt_in_or_out_of_the_cache() -> None:
    greedy = chat(temperature=0)
    assert not cacheable(greedy.body, ON, tenant(response_cache=False), model())
    off = ResponseCacheConfig(enabled=False)
    assert cacheable(greedy.body, off, tenant(response_cache=True), model())


def _key(request: ParsedRequest, **parts: str) -> str:
    fields = {"scope": "tenant\x00t", "served_by": "vllm", "generation": "", **parts}
    return cache_key(request, digest=body_digest(request.body), **fields)


def test_a_new_cache_generation_is_a_new_key() -> None:
    request = chat(temperature=0)
    assert _key(request) == _key(request, generation="")
    assert _key(request, generation="weights-1") != _key(request, generation="weights-2")


def test_the_key_names_what_serves_the_request() -> None:
    request = chat(temperature=0)
    assert _key(request, served_by="vllm") != _key(request, served_by="canary-pool")
    assert _key(request, scope="tenant\x00a") != _key(request, scope="tenant\x00b")


def test_entries_are_shared_only_between_tenants_that_both_opt_in() -> None:
    greedy, sampled = chat(temperature=0).body, chat(temperature=0.7).body
    sharing = tenant(cache_sharing=True)
    assert cache_scope(True, "a", sharing, greedy) == SHARED_SCOPE
    assert cache_scope(True, "a", tenant(), greedy) == "tenant\x00a"
    assert cache_scope(False, "a", sharing, greedy) == "tenant\x00a"
    # A sampled answer is never another tenant's, whatever both opted in to.
    assert cache_scope(True, "a", sharing, sampled) == "tenant\x00a"
