"""Images in chats and Responses requests to a Qwen2.5-VL model, through the real Envoy with
the official ``openai`` SDK.

The simulator serves the vision directory as vLLM 0.34 does (transformers' Qwen2-VL image
processor on the decoded image, each ``<|image_pad|>`` expanded to the image's grid) and
fetches ``http`` images itself from this module's image server on 127.0.0.1 (allowed in the
model's ``vision.allowed_url_hosts``; every other internal address is refused).

* a ``data:`` image is counted exactly: kvgate's count = the engine's ``usage.prompt_tokens``
  and the ledger books what was served;
* an ``http`` image is reserved at the most one image can take and billed from the answer's
  usage (below the reservation, equal to what was served);
* hostile images are refused 400 naming the part, with nothing reserved or forwarded;
* a burst of large images on a small KV cache: exactly the requests that fit are admitted and
  the engine never preempts (counted as one token per image, all would be admitted).
"""

from __future__ import annotations

import base64
import io
import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from kvgate.tokenize import PromptCounter
from kvgate.tokenize.vision import VisionLimits
from testbed.harness import (
    DEFAULT_BACKEND,
    SimOptions,
    Stack,
    kvgate_metrics,
    sim_reset,
    sim_stats,
    tenant_totals,
    wait_until,
)
from testbed.vision_model import VISION_MODEL_NAME, vision_model_dir
from tests.e2e.image_support import data_url, image_chat, png, serving_image

MODEL = VISION_MODEL_NAME
BACKEND = DEFAULT_BACKEND
KV_BLOCK = 16
KV_BUDGET = 24_576
MAX_CONTEXT = 32_768
TIMEOUT_S = 15.0
HTTP_IMAGE_SIZE = (900, 700)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    with serving_image(png(*HTTP_IMAGE_SIZE)) as url:
        yield url


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(
        models=[
            {
                "name": MODEL,
                "tokenizer": str(vision_model_dir()),
                "max_context": MAX_CONTEXT,
                "default_max_new_tokens": 256,
                "backend": BACKEND,
                "vision": {"allowed_url_hosts": ["127.0.0.1"], "max_images_per_request": 4},
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
        # The exact-match cache serves greedy requests: never one whose image is fetched.
        kvgate_overrides={"response_cache": {"enabled": True}},
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
    return PromptCounter.from_model_dir(vision_model_dir(), name=MODEL)


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


# --------------------------------------------------------------------------- exact counts


def test_a_data_image_is_counted_exactly_and_billed_as_served(
    stack: Stack, client: OpenAI, counter: PromptCounter
) -> None:
    messages = image_chat(data_url(png(1280, 960)))
    counted = counter.count_chat(messages)
    before = tenant_totals(stack)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    answer = raw.parse()
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == counted
    # The image is most of the prompt: 1280x960 -> a 46x34 grid of merged patches (1564).
    assert counted > 1500
    entry = stack.wait_access_log(lambda e: e["request_id"] == raw.headers["x-request-id"])
    assert entry["prompt_tokens"] == counted
    expected = {
        "requests": 1,
        "prompt_tokens": counted,
        "output_tokens": answer.usage.completion_tokens,
    }
    assert charged_since(stack, before, expected) == expected
    wait_kv_idle(stack)


def test_a_streamed_chat_with_two_images_is_counted_exactly(
    stack: Stack, client: OpenAI, counter: PromptCounter
) -> None:
    messages = image_chat(data_url(png(300, 500)))
    messages[0]["content"].append(
        {"type": "image_url", "image_url": {"url": data_url(png(640, 64, (1, 2, 3)))}}
    )
    counted = counter.count_chat(messages)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens for u in usage] == [counted]


def test_a_responses_input_image_is_counted_exactly(
    stack: Stack, client: OpenAI, counter: PromptCounter
) -> None:
    url = data_url(png(512, 384))
    response = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe it."},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=8,
    )
    assert response.usage is not None
    expected = counter.count_chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe it."},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ]
    )
    assert response.usage.input_tokens == expected


def test_an_anthropic_image_block_is_counted_exactly(stack: Stack, counter: PromptCounter) -> None:
    from anthropic import Anthropic

    raw = png(640, 360)
    with Anthropic(
        base_url=stack.base_url, api_key=stack.api_key(), max_retries=0, timeout=60.0
    ) as sdk:
        message = sdk.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": base64.b64encode(raw).decode(),
                            },
                        },
                    ],
                }
            ],
        )
    assert message.usage.input_tokens == counter.count_chat(image_chat(data_url(raw)))


# --------------------------------------------------------------------------- http images


def test_an_http_image_is_reserved_at_the_maximum_and_billed_as_served(
    stack: Stack, client: OpenAI, counter: PromptCounter, image_server: str
) -> None:
    spec = counter.vision
    assert spec is not None
    url = f"{image_server}/cat.png"
    served_exactly = counter.count_chat(image_chat(data_url(png(*HTTP_IMAGE_SIZE))))
    # Counted as the module's kvgate counts it: the image server's host is allowed there.
    allowed = PromptCounter.from_model_dir(vision_model_dir(), name=MODEL)
    allowed.vision = spec.with_limits(VisionLimits(allowed_hosts=frozenset({"127.0.0.1"})))
    reserved = allowed.count_chat(image_chat(url))
    assert reserved == served_exactly - spec.tokens_for(*HTTP_IMAGE_SIZE) + (
        spec.max_tokens_per_image
    )
    before = tenant_totals(stack)
    mismatches = kvgate_metrics(stack).total("kvgate_prompt_count_mismatches_total")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=image_chat(url), max_tokens=8
    )
    answer = raw.parse()
    assert answer.usage is not None
    # The engine fetched the image and counted it: the exact count, far below the bound.
    assert answer.usage.prompt_tokens == served_exactly < reserved
    entry = stack.wait_access_log(lambda e: e["request_id"] == raw.headers["x-request-id"])
    assert entry["prompt_tokens"] == reserved
    # A bound by design is no count error: the mismatch alert stays quiet.
    assert kvgate_metrics(stack).total("kvgate_prompt_count_mismatches_total") == mismatches
    expected = {
        "requests": 1,
        "prompt_tokens": served_exactly,
        "output_tokens": answer.usage.completion_tokens,
    }
    assert charged_since(stack, before, expected) == expected
    wait_kv_idle(stack)


def test_the_answer_to_a_fetched_image_is_never_served_from_the_cache(
    stack: Stack, client: OpenAI, image_server: str
) -> None:
    """The same greedy request twice: with a data: image the second is the cache's answer;
    with an http image both reach the engine (the image behind the URL can change)."""
    cases = {
        "data": (image_chat(data_url(png(96, 96)), text="cache me"), 1),
        "http": (image_chat(f"{image_server}/dog.png", text="cache me"), 2),
    }
    for name, (messages, reaching_the_engine) in cases.items():
        wait_kv_idle(stack)
        sim_reset(stack)
        for _ in range(2):
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
        served = wait_until(
            lambda: len(sim_stats(stack)["served"]),
            lambda n, want=reaching_the_engine: n == want,
            timeout=TIMEOUT_S,
        )
        assert served == reaching_the_engine, name


# --------------------------------------------------------------------------- refusals

TRUNCATED = png(400, 300)[:300]


def _header_only_png(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + (chunk(b"IEND", b""))
    )


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32)).save(out, "JPEG")
    return out.getvalue()


HOSTILE: dict[str, tuple[list[Any], str]] = {
    "50 megapixels": (
        image_chat(data_url(_header_only_png(10_000, 5_000))),
        "messages[0].content[1].image_url: the image is 10000x5000",
    ),
    "truncated png": (
        image_chat(data_url(TRUNCATED)),
        "messages[0].content[1].image_url: the image does not decode",
    ),
    "declared type mismatch": (
        image_chat(data_url(_jpeg(), "image/png")),
        "messages[0].content[1].image_url: the data URL declares 'image/png'",
    ),
    "private address": (
        image_chat("http://10.1.2.3/secret.png"),
        "messages[0].content[1].image_url: the image URL names a private or local address",
    ),
    "cloud metadata": (
        image_chat("http://169.254.169.254/latest/meta-data/"),
        "messages[0].content[1].image_url: the image URL names a private or local address",
    ),
    "too many images": (
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png(8, 8))}}
                    for _ in range(5)
                ],
            }
        ],
        "messages[0].content[4].image_url: more than 4 images",
    ),
    "typed image token": (
        [{"role": "user", "content": "count <|image_pad|> as one token"}],
        "message text may not contain <|image_pad|>",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_images_are_refused_naming_the_part(
    stack: Stack, client: OpenAI, case: str
) -> None:
    messages, expected = HOSTILE[case]
    sim_reset(stack)
    before = tenant_totals(stack)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    error = caught.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    assert error.param == "messages"
    assert expected in error.message, error.message
    assert sim_stats(stack)["served"] == []  # nothing reached the engine
    assert kv_in_flight(stack) == 0
    after = tenant_totals(stack)
    assert (after["prompt_tokens"], after["output_tokens"]) == (
        before["prompt_tokens"],
        before["output_tokens"],
    )


def test_an_audio_part_is_refused_naming_it(stack: Stack, client: OpenAI) -> None:
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "listen"},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert caught.value.param == "messages[0].content[1].type"
    assert "audio" in caught.value.message
    assert kv_in_flight(stack) == 0


# --------------------------------------------------------------------------- KV burst

BURST = 5
BURST_OUTPUT = 1500
BURST_IMAGE = data_url(png(2048, 2048, (200, 40, 40)))
BURST_HEADERS = {
    "x-sim-output-tokens": str(BURST_OUTPUT),
    "x-sim-itl-ms": "1",
    # A long prefill, so that every admitted prompt is in the cache before any grows.
    "x-sim-ttft-ms": "500",
}


def _stream(stack: Stack, body: dict[str, Any], start: threading.Barrier) -> int:
    with httpx.Client(timeout=120.0) as http:
        start.wait(timeout=30)
        with http.stream(
            "POST",
            stack.base_url + "/v1/chat/completions",
            json=body,
            headers={**stack.auth_headers(), **BURST_HEADERS},
        ) as resp:
            resp.read()
            return resp.status_code


def test_a_burst_of_images_never_makes_the_engine_preempt(stack: Stack) -> None:
    """Five chats with a 2048x2048 image (over 5k tokens each, from a few hundred bytes of
    text) and 1.5k tokens of output on a 24k cache: kvgate admits exactly the three that fit
    and refuses the rest 429; the engine never preempts. Counted as one token per image,
    all five would be admitted and the engine would preempt."""
    messages = image_chat(BURST_IMAGE)
    # The engine's own count (the simulator's tokenizer and image processor), not kvgate's.
    sim_tokenization = pytest.importorskip("vllm_sim.tokenization")
    prompt = len(sim_tokenization.SimTokenizer(vision_model_dir()).encode_chat(messages))
    reserve = math.ceil((prompt + BURST_OUTPUT) / KV_BLOCK) * KV_BLOCK
    fit = KV_BUDGET // reserve
    assert 0 < fit < BURST and prompt > 5000
    wait_kv_idle(stack)
    sim_reset(stack)
    body = {"model": MODEL, "messages": messages, "max_tokens": BURST_OUTPUT, "stream": True}
    start = threading.Barrier(BURST)
    with ThreadPoolExecutor(max_workers=BURST) as pool:
        statuses = list(pool.map(lambda _: _stream(stack, body, start), range(BURST)))
    assert sorted(statuses) == [200] * fit + [429] * (BURST - fit), statuses
    stats = sim_stats(stack)
    assert stats["preemptions"] == 0, stats
    assert stats["peak_kv_tokens_used"] <= KV_BUDGET, stats
    assert stats["peak_running"] == fit, stats
    assert all(s["prompt_tokens"] == prompt for s in stats["served"]), stats["served"]
    wait_kv_idle(stack)
