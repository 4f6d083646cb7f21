"""Images in chats to a LLaVA-1.5 model (a fixed count per image), through the real Envoy with
the official ``openai`` SDK.

The simulator serves the LLaVA directory as vLLM 0.34 does (``llava.py``: each ``<image>``
becomes ``get_num_image_tokens`` of them, 576 for CLIP ViT-L/14-336) and fetches the
``http`` image itself from this module's image server on 127.0.0.1 (allowed in the model's
``vision.allowed_url_hosts``).

* a ``data:`` image and an ``http`` image are both counted exactly: kvgate's count (the
  access log's) = the engine's ``usage.prompt_tokens``, the ledger books what was served and
  nothing stays in flight;
* a corrupt image and a private URL are refused 400 naming the part, nothing reserved.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from kvgate.tokenize import PromptCounter
from kvgate.tokenize.vision import VisionLimits
from testbed.harness import (
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_reset,
    sim_stats,
    tenant_totals,
    wait_until,
)
from testbed.vision_model import vision_model_dir
from tests.e2e.image_support import data_url, image_chat, png, serving_image

MODEL = "llava-demo"
BACKEND = "llava-pool"
KV_BLOCK = 16
KV_BUDGET = 16_384
MAX_CONTEXT = 4096
TIMEOUT_S = 15.0
TOKENS_PER_IMAGE = 576  # (336 / 14)^2: CLIP ViT-L/14-336's patches, its CLS token dropped


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    with serving_image(png(900, 700)) as url:
        yield url


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": MODEL,
                "tokenizer": str(vision_model_dir(family="llava")),
                "max_context": MAX_CONTEXT,
                "default_max_new_tokens": 64,
                "backend": BACKEND,
                "vision": {"allowed_url_hosts": ["127.0.0.1"], "max_images_per_request": 4},
            }
        ],
        backends=[
            {
                "name": BACKEND,
                "kv_budget_tokens": KV_BUDGET,
                "kv_block_size": KV_BLOCK,
                "max_concurrent_requests": 16,
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
        base_url=stack.base_url + "/v1", api_key=stack.api_key(), max_retries=0, timeout=60.0
    ) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    counting = PromptCounter.from_model_dir(vision_model_dir(family="llava"), name=MODEL)
    assert counting.vision is not None
    # As the module's kvgate counts: the image server's host is allowed there.
    counting.vision = counting.vision.with_limits(
        VisionLimits(allowed_hosts=frozenset({"127.0.0.1"}))
    )
    return counting


def kv_in_flight(stack: Stack) -> float:
    return kvgate_metrics(stack).value("kvgate_kv_tokens_in_flight", backend=BACKEND)


def wait_kv_idle(stack: Stack) -> None:
    left = wait_until(lambda: kv_in_flight(stack), lambda v: v == 0, timeout=TIMEOUT_S)
    assert left == 0, f"kvgate still holds {left} KV tokens"


def charged_since(stack: Stack, before: dict[str, int], expected: dict[str, int]) -> dict[str, int]:
    def delta() -> dict[str, int]:
        now = tenant_totals(stack)
        return {key: now[key] - before[key] for key in before}

    return wait_until(delta, lambda d: d == expected, timeout=TIMEOUT_S)


def served_exactly(stack: Stack, client: OpenAI, messages: list[Any], counted: int) -> None:
    before = tenant_totals(stack)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    answer = raw.parse()
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == counted
    entry = stack.wait_access_log(lambda e: e["request_id"] == raw.headers["x-request-id"])
    assert entry["prompt_tokens"] == counted
    expected = {
        "requests": 1,
        "prompt_tokens": counted,
        "output_tokens": answer.usage.completion_tokens,
    }
    assert charged_since(stack, before, expected) == expected
    wait_kv_idle(stack)


def test_a_data_image_is_counted_exactly_and_billed_as_served(
    stack: Stack, client: OpenAI, counter: PromptCounter
) -> None:
    messages = image_chat(data_url(png(1280, 960)))
    counted = counter.count_chat(messages)
    text_only = counter.count_chat([{"role": "user", "content": "What is in this picture?"}])
    # The template's "<image>\n" line: the one placeholder became 576, the newline is text.
    assert counted > text_only + TOKENS_PER_IMAGE - 1
    served_exactly(stack, client, messages, counted)


def test_an_http_image_is_counted_exactly_not_at_a_bound(
    stack: Stack, client: OpenAI, counter: PromptCounter, image_server: str
) -> None:
    messages = image_chat(f"{image_server}/cat.png")
    counted = counter.count_chat(messages)
    # The same count as the image sent inline: the size does not change a fixed count.
    assert counted == counter.count_chat(image_chat(data_url(png(900, 700))))
    served_exactly(stack, client, messages, counted)


def test_two_images_of_different_sizes_are_counted_exactly(
    stack: Stack, client: OpenAI, counter: PromptCounter, image_server: str
) -> None:
    messages = image_chat(data_url(png(40, 3000, (1, 2, 3))), f"{image_server}/dog.png")
    served_exactly(stack, client, messages, counter.count_chat(messages))


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("data:image/png;base64," + base64.b64encode(png(64, 64)[:60]).decode(), "does not"),
        ("http://10.0.0.7/cat.png", "private or local"),
    ],
)
def test_a_bad_image_is_refused_naming_the_part(
    stack: Stack, client: OpenAI, url: str, named: str
) -> None:
    wait_kv_idle(stack)
    sim_reset(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=image_chat(url), max_tokens=8)
    assert "messages[0].content[1]" in str(refused.value)
    assert named in str(refused.value)
    assert sim_stats(stack)["served"] == []
    assert kv_in_flight(stack) == 0
