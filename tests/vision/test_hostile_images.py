"""Hostile images: each refused with a message naming the part, before any reservation.

The pixel cap is checked on the header alone: a PNG that declares 50 megapixels but holds
a few bytes of data is refused for its size, not for failing to decode (nothing was
decompressed).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kvgate.tokenize import PromptRenderError
from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.vision import (
    ImageRef,
    VisionLimits,
    check_remote_url,
    decode_data_url,
    image_tokens,
)
from testbed.vision_model import vision_model_dir

PART = "messages[0].content[1].image_url"


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, "PNG")
    return out.getvalue()


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, "JPEG")
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` and whose data is one tiny chunk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def url_of(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def chat(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(vision_model_dir())


def refusal(counter: PromptCounter, messages: list[dict[str, Any]]) -> str:
    with pytest.raises(PromptRenderError) as caught:
        counter.count_chat(messages)
    return caught.value.client_message


def test_fifty_megapixels_are_refused_from_the_header(counter: PromptCounter) -> None:
    message = refusal(counter, chat(url_of(png_header_only(8000, 6250))))
    assert message.startswith(PART)
    assert "50000000 pixels" in message


def test_a_truncated_png_is_refused(counter: PromptCounter) -> None:
    whole = png(300, 200)
    message = refusal(counter, chat(url_of(whole[: len(whole) // 2])))
    assert message.startswith(PART) and "does not decode" in message


def test_garbage_is_refused(counter: PromptCounter) -> None:
    message = refusal(counter, chat(url_of(b"not an image at all" * 10)))
    assert message.startswith(PART) and "not an image" in message


def test_a_declared_type_that_is_not_the_image_is_refused(counter: PromptCounter) -> None:
    message = refusal(counter, chat(url_of(jpeg(64, 64), "image/png")))
    assert message.startswith(PART) and "image/jpeg" in message


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png,abc",  # not base64
        "data:image/png;base64",  # no comma
        "data:image/png;base64,@@@@",  # not base64 characters
    ],
)
def test_malformed_data_urls_are_refused(counter: PromptCounter, url: str) -> None:
    assert refusal(counter, chat(url)).startswith(PART)


def test_bytes_over_the_limit_are_refused_before_decoding() -> None:
    limits = VisionLimits(max_image_bytes=1024)
    with pytest.raises(PromptRenderError, match="larger than 1024 bytes"):
        decode_data_url(url_of(b"\x00" * 4096), PART, limits)


def test_an_aspect_ratio_the_engine_refuses_is_refused(counter: PromptCounter) -> None:
    message = refusal(counter, chat(url_of(png(5000, 20))))
    assert message.startswith(PART) and "aspect ratio" in message


def test_too_many_images_are_refused(counter: PromptCounter) -> None:
    spec = counter.vision
    assert spec is not None
    url = url_of(png(8, 8))
    parts = [{"type": "image_url", "image_url": {"url": url}}] * (spec.limits.max_images + 1)
    message = refusal(counter, [{"role": "user", "content": parts}])
    assert message.startswith(f"messages[0].content[{spec.limits.max_images}].image_url")


def test_a_typed_image_token_is_refused(counter: PromptCounter) -> None:
    for token in ("<|image_pad|>", "<|video_pad|>"):
        message = refusal(counter, [{"role": "user", "content": f"look {token} here"}])
        assert token in message


INTERNAL = [
    "http://127.0.0.1/x.png",
    "http://127.1/x.png",
    "http://2130706433/x.png",
    "http://0x7f.0.0.1/x.png",
    "http://10.0.0.5/x.png",
    "http://192.168.1.1/x.png",
    "http://172.16.3.3/x.png",
    "http://169.254.169.254/latest/meta-data",
    "http://[::1]/x.png",
    "http://[::ffff:127.0.0.1]/x.png",
    "http://[fd00::1]/x.png",
    "http://0.0.0.0/x.png",
    "http://localhost/x.png",
    "http://LOCALHOST./x.png",
    "http://metadata.localhost/x.png",
    "https://100.64.0.1/x.png",
    "http://0177.0.0.1/x.png",  # octal, as resolvers read it
    "http://public.example@127.0.0.1/x.png",  # userinfo: the host is after the @
    "http://[fe80::1%25eth0]/x.png",  # link-local with a zone
    "HTTP://10.0.0.1/x.png",
]


@pytest.mark.parametrize("url", INTERNAL)
def test_urls_to_internal_addresses_are_refused(counter: PromptCounter, url: str) -> None:
    message = refusal(counter, chat(url))
    assert message.startswith(PART) and "private or local address" in message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "http://"])
def test_other_schemes_are_refused(counter: PromptCounter, url: str) -> None:
    assert refusal(counter, chat(url)).startswith(PART)


def test_the_allow_list_admits_a_named_internal_host() -> None:
    limits = VisionLimits(allowed_hosts=frozenset({"127.0.0.1"}))
    check_remote_url("http://127.0.0.1:8080/cat.png", PART, limits)
    with pytest.raises(PromptRenderError):
        check_remote_url("http://127.0.0.2:8080/cat.png", PART, limits)


def test_remote_images_can_be_turned_off() -> None:
    with pytest.raises(PromptRenderError, match="data: URL"):
        check_remote_url("https://example.com/cat.png", PART, VisionLimits(remote_images=False))


def test_a_public_url_is_reserved_at_the_most_one_image_takes(counter: PromptCounter) -> None:
    spec = counter.vision
    assert spec is not None
    ref = ImageRef("https://example.com/cat.png", PART)
    assert image_tokens(spec, ref) == spec.max_tokens_per_image
    text_only = counter.count_chat(chat(url_of(png(28, 28))))
    small = spec.tokens_for(28, 28)
    assert counter.count_chat(chat(ref.url)) == text_only - small + spec.max_tokens_per_image


def test_the_decode_runs_only_when_the_plan_is_finished(
    counter: PromptCounter, tmp_path: Path
) -> None:
    """Planning (on the event loop) renders and cuts; the image is decoded in ``finish``,
    which the service runs on a worker (the plan's cost is over any inline budget)."""
    plan = counter.plan_chat(chat(url_of(png(64, 64))))
    assert plan.deferred and plan.pending_chars > 10**9
    broken = counter.plan_chat(chat(url_of(b"garbage")))  # planning does not decode
    with pytest.raises(PromptRenderError):
        counter.finish(broken)


def test_a_model_counted_by_its_engine_does_not_send_images_to_it() -> None:
    """The engine's /tokenize would fetch an image URL with none of kvgate's checks (and
    the generation request after it too): such a model refuses image parts before any call."""
    from kvgate.tokenize.engine_counting import EngineCounter, EngineEndpoint

    counter = EngineCounter(
        EngineEndpoint("http://engine.invalid/tokenize"),
        name="engine-counted",
        timeout_s=0.5,
        max_concurrency=1,
        reserve_upper_bound=False,
    )
    for part in (
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}},
        {"type": "input_image", "image_url": "http://10.0.0.1/x.png"},
    ):
        with pytest.raises(PromptRenderError, match=r"messages\[0\]\.content\[1\]"):
            counter.chat_call(
                [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
                None,
                add_generation_prompt=True,
                continue_final_message=False,
                chat_template_kwargs=None,
                add_special_tokens=False,
            )
