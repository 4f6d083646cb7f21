"""The official `openai` Python SDK against the real Envoy -> kvgate -> simulator stack.

kvgate's answers must be what the SDK expects from OpenAI: each error status maps to the
SDK's exception class with `code`/`param` read from the body, and successful answers
(non-streamed, streamed, legacy completions) parse into the SDK's types.

The module's stack has a small backend (4,096 KV tokens) so that one held stream can fill
it and provoke a real 429.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_BACKEND,
    DEFAULT_MODEL_NAME,
    DEMO_TENANT,
    SimOptions,
    Stack,
    kvgate_metrics,
    tenant_totals,
    wait_until,
)

MODEL = DEFAULT_MODEL_NAME
BACKEND = DEFAULT_BACKEND
KV_BUDGET = 4096
KV_BLOCK = 16
MAX_CONTEXT = 4096
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": MODEL,
                "tokenizer": str(demo_model_dir()),
                "max_context": MAX_CONTEXT,
                "default_max_new_tokens": 256,
                "backend": BACKEND,
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": KV_BLOCK,
                "max_concurrent_requests": 64,
            }
        ],
        sim=SimOptions(
            num_gpu_blocks=KV_BUDGET // KV_BLOCK, block_size=KV_BLOCK, max_model_len=MAX_CONTEXT
        ),
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=stack.base_url + "/v1",
        api_key=stack.api_key(),
        max_retries=0,
        timeout=30.0,
    ) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(demo_model_dir())


def user(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def kv_in_flight(stack: Stack) -> float:
    return kvgate_metrics(stack).value("kvgate_kv_tokens_in_flight", backend=BACKEND)


def wait_kv_idle(stack: Stack) -> None:
    left = wait_until(lambda: kv_in_flight(stack), lambda v: v == 0, timeout=TIMEOUT_S)
    assert left == 0, f"kvgate still holds {left} KV tokens"


# --------------------------------------------------------------------------- errors


def test_bad_key_raises_authentication_error(stack: Stack) -> None:
    with OpenAI(base_url=stack.base_url + "/v1", api_key="sk-not-a-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=8)
        assert caught.value.status_code == 401
        assert caught.value.code == "invalid_api_key"
        assert caught.value.type == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_unknown_model_raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=user("hi"), max_tokens=8)
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert "no-such-model" in caught.value.message


def test_context_overflow_raises_bad_request(client: OpenAI, counter: PromptCounter) -> None:
    messages = user("Write a long story about a river.")
    prompt = counter.count_chat(messages)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_CONTEXT)
    error = caught.value
    assert error.status_code == 400
    assert error.code == "context_length_exceeded"
    assert error.param == "messages"
    assert f"maximum context length is {MAX_CONTEXT} tokens" in error.message
    assert f"requested {prompt + MAX_CONTEXT} tokens" in error.message


def test_kv_budget_exhausted_raises_rate_limit_error(
    stack: Stack, client: OpenAI, counter: PromptCounter
) -> None:
    """A stream stalled after 2 tokens holds most of the 4,096-token budget; the next request
    gets 429 kv_budget_exhausted, and succeeds once the held stream is gone."""
    hold_messages = user("Tell me everything.")
    hold_max = 3500
    held = math.ceil((counter.count_chat(hold_messages) + hold_max) / KV_BLOCK) * KV_BLOCK
    wait_kv_idle(stack)
    with (
        httpx.Client(timeout=30.0) as raw,
        raw.stream(
            "POST",
            stack.base_url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": hold_messages,
                "max_tokens": hold_max,
                "stream": True,
            },
            headers={**stack.auth_headers(), "x-sim-stall-after": "2"},
        ) as holder,
    ):
        assert holder.status_code == 200
        lines = holder.iter_lines()
        while not next(lines).startswith("data: {"):  # the stream has really started
            pass
        assert kv_in_flight(stack) == held

        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1000)
        error = caught.value
        assert error.status_code == 429
        assert error.code == "kv_budget_exhausted"
        assert f"has {KV_BUDGET - held} of {KV_BUDGET} KV tokens free" in error.message
        retry_after = error.response.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert int(error.response.headers["retry-after-ms"]) >= 1
    # The holder hung up: its reservation is settled and the same request now fits.
    wait_kv_idle(stack)
    done = client.chat.completions.create(
        model=MODEL,
        messages=user("hi"),
        max_tokens=1000,
        extra_headers={"x-sim-output-tokens": "3"},
    )
    assert done.usage is not None and done.usage.completion_tokens == 3


# --------------------------------------------------------------------------- success


def test_chat_completion(stack: Stack, client: OpenAI, counter: PromptCounter) -> None:
    messages = user("Name a river.")
    prompt = counter.count_chat(messages)
    before = tenant_totals(stack)
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, extra_headers={"x-sim-output-tokens": "9"}
    )
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content and len(choice.message.content.split()) == 8  # + hidden EOS
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt, 9)
    expected = {"requests": 1, "prompt_tokens": prompt, "output_tokens": 9}
    got = wait_until(
        lambda: {k: v - before[k] for k, v in tenant_totals(stack).items()},
        lambda d: d == expected,
        timeout=TIMEOUT_S,
    )
    assert got == expected


def test_chat_completion_stream(stack: Stack, client: OpenAI, counter: PromptCounter) -> None:
    messages = user("Name two rivers.")
    prompt = counter.count_chat(messages)
    steer = {"x-sim-output-tokens": "12"}
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, extra_headers=steer
    )
    before = tenant_totals(stack)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, stream=True, extra_headers=steer
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # same 12 tokens ("length" finish)
    assert all(c.choices for c in chunks), "the usage-only chunk kvgate asked for leaked"
    assert all(c.usage is None for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    expected = {"requests": 1, "prompt_tokens": prompt, "output_tokens": 12}
    got = wait_until(
        lambda: {k: v - before[k] for k, v in tenant_totals(stack).items()},
        lambda d: d == expected,
        timeout=TIMEOUT_S,
    )
    assert got == expected

    with_usage = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=steer,
        )
    )
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage is not None
    assert with_usage[-1].usage.prompt_tokens == prompt
    assert with_usage[-1].usage.completion_tokens == 12


def test_legacy_completions(stack: Stack, client: OpenAI, counter: PromptCounter) -> None:
    prompt_text = "Once upon a time, by the river,"
    prompt = counter.count_completion(prompt_text)
    done = client.completions.create(
        model=MODEL, prompt=prompt_text, max_tokens=6, extra_headers={"x-sim-output-tokens": "6"}
    )
    assert done.object == "text_completion"
    assert done.choices[0].text and len(done.choices[0].text.split()) == 6
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt, 6)

    before = kvgate_metrics(stack)
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt_text,
            max_tokens=6,
            stream=True,
            extra_headers={"x-sim-output-tokens": "6"},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert all(c.choices for c in streamed), "the usage-only chunk kvgate asked for leaked"
    labels = {"tenant": DEMO_TENANT, "model": MODEL}
    after = wait_until(
        lambda: kvgate_metrics(stack),
        lambda m: (
            m.value("kvgate_output_tokens_total", **labels)
            > before.value("kvgate_output_tokens_total", **labels)
        ),
        timeout=TIMEOUT_S,
    )
    assert (
        after.value("kvgate_output_tokens_total", **labels)
        - before.value("kvgate_output_tokens_total", **labels)
        == 6
    )
    assert (
        after.value("kvgate_prompt_tokens_total", **labels)
        - before.value("kvgate_prompt_tokens_total", **labels)
        == prompt
    )


def test_models_list(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
