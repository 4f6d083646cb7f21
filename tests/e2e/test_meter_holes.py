"""Ways around the meter, tried as a hostile tenant would, against the real stack.

client -> real Envoy -> kvgate -> the vLLM simulator (which requires its own API key, as a
vLLM started with --api-key does). Each test closes one hole: nothing reaches the backend
without a reservation covering all it may generate, and everything served is charged.
The simulator's own records (`/sim/requests`: what reached it; `/sim/stats`: what its
engine did) are the independent side of every check.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_API_KEY,
    DEMO_TENANT,
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_reset,
    sim_stats,
    tenant_totals,
    wait_until,
)
from tests.e2e.support import assert_openai_error, document_messages

MODEL = DEFAULT_MODEL_NAME
BACKEND = DEFAULT_BACKEND
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BACKEND_KEY = "sk-backend-only-7f3a"
KV_BUDGET = 16_384  # the test backend: 1,024 blocks of 16
CONTEXT = 4_096
DEFAULT_MAX_NEW = 256
LEASE_TTL_S = 2.0
TPM_TENANT, TPM_KEY = "metered", "sk-metered-tenant"
TPM_CAPACITY, TPM_REFILL = 1_000, 100.0
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
SETTLE_S = 10.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        tenants=[
            {"name": DEMO_TENANT, "api_key": DEMO_API_KEY},
            {
                "name": TPM_TENANT,
                "api_key": TPM_KEY,
                "limits": {"tpm": {"capacity": TPM_CAPACITY, "refill_per_s": TPM_REFILL}},
            },
        ],
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": CONTEXT,
                "default_max_new_tokens": DEFAULT_MAX_NEW,
                "backend": BACKEND,
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": 16,
                "max_concurrent_requests": 64,
                "api_key": BACKEND_KEY,
            }
        ],
        sim=SimOptions(
            num_gpu_blocks=KV_BUDGET // 16,
            block_size=16,
            max_model_len=CONTEXT,
            ttft_ms=5,
            itl_ms=1,
            extra_args=["--api-key", BACKEND_KEY],
        ),
        kvgate_overrides={"server": {"lease_ttl_s": LEASE_TTL_S}},
    ) as running:
        yield running


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(demo_model_dir())


# --------------------------------------------------------------------------- helpers


def post(
    stack: Stack,
    path: str,
    body: dict[str, Any],
    *,
    key: str = DEMO_API_KEY,
    headers: dict[str, str] | None = None,
    timeout: httpx.Timeout | float = HTTP_TIMEOUT,
) -> httpx.Response:
    all_headers = {"authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(stack.base_url + path, json=body, headers=all_headers, timeout=timeout)


def sim_requests(stack: Stack) -> list[dict[str, Any]]:
    with urllib_open(f"{stack.sim_url}/sim/requests?limit=1000") as data:
        return list(data["requests"])


def urllib_open(url: str) -> Any:
    import contextlib
    import urllib.request

    @contextlib.contextmanager
    def opened() -> Iterator[Any]:
        with urllib.request.urlopen(url, timeout=5) as resp:
            yield json.loads(resp.read().decode())

    return opened()


def reached_backend(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    return [r for r in sim_requests(stack) if r["request_id"] == request_id]


def ledger(stack: Stack, tenant: str = DEMO_TENANT) -> dict[str, int]:
    return tenant_totals(stack, tenant)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


def wait_ledger(
    stack: Stack, before: dict[str, int], expected: dict[str, int], tenant: str = DEMO_TENANT
) -> dict[str, int]:
    return wait_until(
        lambda: delta(before, ledger(stack, tenant)), lambda d: d == expected, timeout=SETTLE_S
    )


def kv_in_flight(stack: Stack) -> float:
    return kvgate_metrics(stack).value("kvgate_kv_tokens_in_flight", backend=BACKEND)


def wait_idle(stack: Stack) -> None:
    left = wait_until(lambda: kv_in_flight(stack), lambda v: v == 0, timeout=SETTLE_S)
    assert left == 0, f"kvgate still holds {left} KV tokens"


# --------------------------------------------------------------------------- hole 2


@pytest.mark.parametrize("cap_field", ["absent", "null"])
def test_no_max_tokens_cannot_generate_past_the_reservation(
    stack: Stack, counter: PromptCounter, cap_field: str
) -> None:
    """Six requests without max_tokens (or null), ignore_eos: the engine may only generate
    what kvgate reserved, so the backend is never overcommitted (before: each ran to the
    end of the 4,096-token context, 24k tokens on a 16k cache, with preemptions)."""
    wait_idle(stack)
    sim_reset(stack)
    before = ledger(stack)
    messages = document_messages(counter, 200, f"no-cap-{cap_field}")
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "ignore_eos": True}
    if cap_field == "null":
        body["max_tokens"] = None
    ids = [f"no-cap-{cap_field}-{i}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        replies = list(
            pool.map(lambda rid: post(stack, CHAT, body, headers={"x-request-id": rid}), ids)
        )
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    outputs = [r.json()["usage"]["completion_tokens"] for r in replies]
    assert outputs == [DEFAULT_MAX_NEW] * 6
    for rid in ids:
        [record] = reached_backend(stack, rid)
        assert record["body"]["max_tokens"] == DEFAULT_MAX_NEW, record
    stats = sim_stats(stack)
    assert stats["preemptions"] == 0
    assert stats["peak_kv_tokens_used"] <= KV_BUDGET
    got = wait_ledger(stack, before, {"requests": 6, "prompt_tokens": 1200, "output_tokens": 1536})
    assert got == {"requests": 6, "prompt_tokens": 1200, "output_tokens": 6 * DEFAULT_MAX_NEW}


def test_min_tokens_past_the_cap_is_refused(stack: Stack) -> None:
    generations = sim_stats(stack)["generation_requests_total"]
    resp = post(
        stack,
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 3000},
    )
    error = assert_openai_error(resp, 400, code="invalid_value")
    assert error["param"] == "min_tokens"
    assert sim_stats(stack)["generation_requests_total"] == generations


def test_both_cap_names_are_capped(stack: Stack) -> None:
    """max_completion_tokens decides what kvgate reserves; a differing max_tokens beside it
    is rewritten too, so no engine reads a larger cap than was reserved."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 8,
        "max_tokens": 3000,
    }
    resp = post(stack, CHAT, body, headers={"x-request-id": "both-caps"})
    assert resp.status_code == 200, resp.text
    [record] = reached_backend(stack, "both-caps")
    assert record["body"]["max_tokens"] == 8
    assert record["body"]["max_completion_tokens"] == 8


# --------------------------------------------------------------------------- hole 4


def test_long_non_streamed_request_keeps_its_lease_and_is_charged(
    stack: Stack, counter: PromptCounter
) -> None:
    """A non-streamed generation sends nothing for longer than the lease (2 s here): the
    reservation must stay held (renewed on a timer, not on chunks) and be charged."""
    wait_idle(stack)
    before = ledger(stack)
    messages = document_messages(counter, 100, "long-non-stream")
    body = {"model": MODEL, "messages": messages, "max_tokens": 20, "ignore_eos": True}
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "r", post(stack, CHAT, body, headers={"x-sim-ttft-ms": str(3 * LEASE_TTL_S * 1000)})
        )
    )
    thread.start()
    time.sleep(2.5 * LEASE_TTL_S)  # well past the lease, still generating
    held = kv_in_flight(stack)
    thread.join(timeout=30)
    assert result["r"].status_code == 200, result["r"].text
    assert held == 128, "the reservation (100 + 20, two blocks) was lost while generating"
    got = wait_ledger(stack, before, {"requests": 1, "prompt_tokens": 100, "output_tokens": 20})
    assert got == {"requests": 1, "prompt_tokens": 100, "output_tokens": 20}
    assert kvgate_metrics(stack).value("kvgate_lease_renewals_total", result="renewed") > 0


# --------------------------------------------------------------------------- hole 8


def test_retry_after_from_a_precheck_is_long_enough(stack: Stack, counter: PromptCounter) -> None:
    """A client that waits as told is not refused again by the same limit. Before, the
    pre-check answered for a 1-token prompt: told to wait ~2 s, refused again at retry."""
    key = TPM_KEY
    first = document_messages(counter, 400, "tpm-first")
    resp = post(
        stack,
        CHAT,
        {"model": MODEL, "messages": first, "max_tokens": 400, "ignore_eos": True},
        key=key,
    )
    assert resp.status_code == 200, resp.text
    second = {
        "model": MODEL,
        "messages": document_messages(counter, 500, "tpm-second"),
        "max_tokens": 300,
    }
    refused = post(stack, CHAT, second, key=key)
    error = assert_openai_error(refused, 429, code="tpm_exceeded", type_="rate_limit_exceeded")
    assert "requested 800" in error["message"], error  # the request's real size
    time.sleep(int(refused.headers["retry-after-ms"]) / 1000)
    retried = post(stack, CHAT, second, key=key)
    assert retried.status_code == 200, retried.text


# --------------------------------------------------------------------------- hole 9


def test_tenant_credentials_never_reach_the_backend(stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    via_bearer = post(stack, CHAT, body, headers={"x-request-id": "cred-bearer"})
    via_api_key = httpx.post(
        stack.base_url + CHAT,
        json=body,
        headers={"x-api-key": DEMO_API_KEY, "x-request-id": "cred-x-api-key"},
        timeout=HTTP_TIMEOUT,
    )
    assert via_bearer.status_code == 200, via_bearer.text
    assert via_api_key.status_code == 200, via_api_key.text
    for rid in ("cred-bearer", "cred-x-api-key"):
        [record] = reached_backend(stack, rid)
        assert record["headers"].get("authorization") == f"Bearer {BACKEND_KEY}"
        assert "x-api-key" not in record["headers"]
        assert DEMO_API_KEY not in json.dumps(record["headers"])


# --------------------------------------------------------------------------- hole 10


@pytest.mark.parametrize("suffix", ["\u00a0", "\u3000", "\u2028", "\u0085"])
def test_key_with_unicode_whitespace_does_not_authenticate(stack: Stack, suffix: str) -> None:
    value = f"Bearer {DEMO_API_KEY}{suffix}".encode()
    resp = httpx.post(
        stack.base_url + CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers=[(b"authorization", value)],
        timeout=HTTP_TIMEOUT,
    )
    assert_openai_error(resp, 401, code="invalid_api_key")


# --------------------------------------------------------------------------- hole 11


def test_stream_cut_before_any_text_pays_its_prompt(stack: Stack, counter: PromptCounter) -> None:
    """The backend accepted the stream (200 and its headers) and did the prefill; the client
    left before any text. Before, that was free."""
    wait_idle(stack)
    before = ledger(stack)
    messages = document_messages(counter, 300, "cut-early")
    body = {"model": MODEL, "messages": messages, "max_tokens": 50, "stream": True}
    headers = {"authorization": f"Bearer {DEMO_API_KEY}", "x-sim-stall-after": "0"}
    with (
        httpx.Client(timeout=HTTP_TIMEOUT) as client,
        client.stream("POST", stack.base_url + CHAT, json=body, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        # leave without reading a single event
    got = wait_ledger(stack, before, {"requests": 1, "prompt_tokens": 300, "output_tokens": 0})
    assert got == {"requests": 1, "prompt_tokens": 300, "output_tokens": 0}
    wait_idle(stack)


def test_non_streamed_request_cut_while_generating_pays_its_prompt(
    stack: Stack, counter: PromptCounter
) -> None:
    wait_idle(stack)
    before = ledger(stack)
    messages = document_messages(counter, 250, "cut-non-stream")
    body = {"model": MODEL, "messages": messages, "max_tokens": 50}
    with pytest.raises(httpx.ReadTimeout):
        post(stack, CHAT, body, headers={"x-sim-ttft-ms": "3000"}, timeout=1.0)
    got = wait_ledger(stack, before, {"requests": 1, "prompt_tokens": 250, "output_tokens": 0})
    assert got == {"requests": 1, "prompt_tokens": 250, "output_tokens": 0}
    wait_idle(stack)


# --------------------------------------------------------------------------- hole 12


def test_prompt_embeds_are_refused(stack: Stack) -> None:
    generations = sim_stats(stack)["generation_requests_total"]
    resp = post(stack, COMPLETIONS, {"model": MODEL, "prompt_embeds": "AAAA", "max_tokens": 5})
    error = assert_openai_error(resp, 400, code="unsupported_parameter")
    assert error["param"] == "prompt_embeds"
    assert sim_stats(stack)["generation_requests_total"] == generations


def test_completions_batch_is_checked_per_prompt(stack: Stack) -> None:
    """Two 2,500-token prompts with 100 new tokens each fit a 4,096 context one by one, as
    the engine checks them; both are reserved and charged."""
    wait_idle(stack)
    before = ledger(stack)
    prompts = [[11] * 2500, [12] * 2500]
    resp = post(
        stack,
        COMPLETIONS,
        {"model": MODEL, "prompt": prompts, "max_tokens": 100, "ignore_eos": True},
    )
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5000, 200)
    got = wait_ledger(stack, before, {"requests": 1, "prompt_tokens": 5000, "output_tokens": 200})
    assert got == {"requests": 1, "prompt_tokens": 5000, "output_tokens": 200}
    too_long = post(
        stack, COMPLETIONS, {"model": MODEL, "prompt": [[11] * 4000, [12] * 10], "max_tokens": 100}
    )
    assert_openai_error(too_long, 400, code="context_length_exceeded")


# --------------------------------------------------------------------------- hole 6


def test_huge_prompts_are_refused_before_counting(stack: Stack) -> None:
    """A prompt whose text cannot fit the context whatever its exact count is refused from
    its length alone, at once (no tokenizing)."""
    text = "the river runs past the old mill " * 200_000  # 6.6 MB
    generations = sim_stats(stack)["generation_requests_total"]
    resp = post(stack, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    error = assert_openai_error(resp, 400, code="context_length_exceeded")
    assert "at least" in error["message"]
    assert sim_stats(stack)["generation_requests_total"] == generations


def test_beam_search_is_refused(stack: Stack) -> None:
    """Beam search keeps more candidate sequences than `n` says: the reservation could not
    cover it, so it never reaches the backend."""
    generations = sim_stats(stack)["generation_requests_total"]
    resp = post(
        stack,
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "use_beam_search": True,
            "n": 2,
        },
    )
    error = assert_openai_error(resp, 400, code="unsupported_parameter")
    assert error["param"] == "use_beam_search"
    assert sim_stats(stack)["generation_requests_total"] == generations


def test_a_reused_request_id_shares_nothing(stack: Stack) -> None:
    """x-request-id is the client's: two concurrent requests sending the same one are two
    admissions, each reserved, served and charged on its own."""
    wait_idle(stack)
    before = ledger(stack)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "ignore_eos": True,
    }
    headers = {"x-request-id": "same-id-twice", "x-sim-ttft-ms": "300"}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: post(stack, CHAT, body, headers=headers), range(2)))
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    prompt = sum(r.json()["usage"]["prompt_tokens"] for r in replies)
    expected = {"requests": 2, "prompt_tokens": prompt, "output_tokens": 12}
    assert wait_ledger(stack, before, expected) == expected
    wait_idle(stack)
