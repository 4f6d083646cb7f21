"""Images in chats to a Qwen2.5-VL model, counted by kvgate against independent references.

* The resize rule against transformers' own ``smart_resize`` (its Qwen2-VL Pillow image
  processor module, which imports without torch), on random sizes.
* Whole prompts against the simulator's path (``vllm_sim``: transformers' tokenizer and
  template, transformers' Qwen2-VL image processor run on the decoded image for its
  ``image_grid_thw``, vLLM's placeholder expansion), for both content formats, several
  images and the common formats.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kvgate.tokenize import PromptRenderError
from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.vision import VisionSpec, load_vision_spec, smart_resize
from testbed.demo_model import demo_model_dir
from testbed.hf_templates import llama_cpp_templates
from testbed.vision_model import PREPROCESSOR_CONFIG, vision_model_dir

sim_tokenization = pytest.importorskip("vllm_sim.tokenization")
hf_qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def image_bytes(width: int, height: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    colour: Any = (30, 160, 90) if mode == "RGB" else 128
    Image.new(mode, (width, height), colour).save(out, fmt)
    return out.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return vision_model_dir()


@pytest.fixture(scope="module")
def counter(model_dir: Path) -> PromptCounter:
    return PromptCounter.from_model_dir(model_dir, name="qwen2.5-vl-demo")


@pytest.fixture(scope="module")
def sim(model_dir: Path) -> Any:
    return sim_tokenization.SimTokenizer(model_dir)


def test_the_vision_config_is_read_from_the_directory(counter: PromptCounter) -> None:
    spec = counter.vision
    assert spec is not None
    assert (spec.min_pixels, spec.max_pixels) == (
        PREPROCESSOR_CONFIG["min_pixels"],
        PREPROCESSOR_CONFIG["max_pixels"],
    )
    assert (spec.patch_size, spec.merge_size) == (14, 2)


def test_a_text_model_has_no_vision_config() -> None:
    assert load_vision_spec(demo_model_dir()) is None


def test_smart_resize_equals_transformers_on_random_sizes() -> None:
    reference = hf_qwen2_vl.smart_resize
    rng = random.Random(7)
    sizes = [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(3000)]
    sizes += [(1, 1), (28, 28), (27, 29), (56, 56), (3584, 3584), (100, 19999), (4000, 20)]
    factor = 28
    for height, width in sizes:
        try:
            expected: Any = reference(height, width, factor, 3136, 12845056)
        except ValueError:
            expected = ValueError
        try:
            got: Any = smart_resize(height, width, factor, 3136, 12845056)
        except ValueError:
            got = ValueError
        assert got == expected, (height, width)


def test_no_image_takes_more_than_the_maximum_reserved_for_a_url(counter: PromptCounter) -> None:
    spec = counter.vision
    assert spec is not None
    rng = random.Random(11)
    most = 0
    for _ in range(5000):
        width, height = rng.randint(28, 20000), rng.randint(28, 20000)
        if max(width, height) / min(width, height) > 200:
            continue
        most = max(most, spec.tokens_for(width, height))
    assert most <= spec.max_tokens_per_image
    # The maximum is reached: a square image of max_pixels.
    side = int(spec.max_pixels**0.5)
    assert spec.tokens_for(side, side) == spec.max_tokens_per_image


CASES: list[tuple[str, list[tuple[int, int, str]]]] = [
    ("one png", [(640, 480, "PNG")]),
    ("tiny", [(1, 1, "PNG")]),
    ("jpeg", [(1280, 720, "JPEG")]),
    ("webp", [(333, 777, "WEBP")]),
    ("gif", [(90, 60, "GIF")]),
    ("large", [(3000, 2000, "PNG")]),
    ("elongated", [(100, 5000, "PNG")]),
    ("three", [(64, 64, "PNG"), (1024, 1024, "JPEG"), (500, 300, "WEBP")]),
]


def _messages(images: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these:"}]
    for width, height, fmt in images:
        parts.append(image_part(data_url(image_bytes(width, height, fmt), mime[fmt])))
    return [
        {"role": "system", "content": "You look closely."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [image_part(parts[1]["image_url"]["url"]), "And this?"]},
    ]


@pytest.mark.parametrize(("name", "images"), CASES, ids=[c[0] for c in CASES])
def test_chat_with_images_equals_the_engine(
    counter: PromptCounter, sim: Any, name: str, images: list[tuple[int, int, str]]
) -> None:
    messages = _messages(images)
    expected = len(sim.encode_chat(messages))
    assert counter.count_chat(messages) == expected
    text_only = [{"role": m["role"], "content": "x"} for m in messages]
    assert expected > len(sim.encode_chat(text_only))  # the images did count


def test_a_string_format_template_puts_placeholders_first_as_the_engine() -> None:
    """MiMo-VL's template concatenates ``message.content``: vLLM joins the placeholders and
    the text with newlines before the template sees them."""
    directory = vision_model_dir(llama_cpp_templates()["MiMo-VL"])
    counter = PromptCounter.from_model_dir(directory)
    sim = sim_tokenization.SimTokenizer(directory)
    url = data_url(image_bytes(400, 300))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "first"}, image_part(url)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [image_part(url), image_part(url)]},
    ]
    assert counter.render_chat(messages) == sim.render_chat(messages)
    assert counter.count_chat(messages) == len(sim.encode_chat(messages))


def test_add_vision_id_is_rendered_as_the_engine(counter: PromptCounter, sim: Any) -> None:
    messages = _messages([(64, 64, "PNG"), (128, 64, "PNG")])
    kwargs = {"add_vision_id": True}
    assert counter.count_chat(messages, chat_template_kwargs=kwargs) == len(
        sim.encode_chat(messages, chat_template_kwargs=kwargs)
    )


def test_the_spec_limits_do_not_change_the_count(counter: PromptCounter) -> None:
    spec = counter.vision
    assert isinstance(spec, VisionSpec)
    assert spec.with_limits(spec.limits).tokens_for(640, 480) == spec.tokens_for(640, 480)


def test_an_image_to_a_text_model_is_refused() -> None:
    counter = PromptCounter.from_model_dir(demo_model_dir())
    url = data_url(image_bytes(10, 10))
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(url)]}]
    with pytest.raises(PromptRenderError, match=r"messages\[0\]\.content\[1\].*no images"):
        counter.count_chat(messages)


def test_a_responses_input_image_is_counted_as_the_engine(counter: PromptCounter, sim: Any) -> None:
    """A Responses body with an ``input_image`` in a message: kvgate's conversion counted by
    kvgate equals the simulator's conversion (vLLM's request model, ``detail`` defaulted)
    rendered and expanded by the simulator."""
    import json

    from kvgate.responses_api.requests import parse_responses_request

    responses_protocol = pytest.importorskip("vllm_sim.responses_protocol")
    url = data_url(image_bytes(800, 600, "JPEG"), "image/jpeg")
    body = {
        "model": "qwen2.5-vl-demo",
        "instructions": "Describe images.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in it?"},
                    {"type": "input_image", "image_url": url},
                ],
            }
        ],
    }
    parsed = parse_responses_request(json.dumps(body).encode())
    request = responses_protocol.ResponsesRequest.model_validate(body)
    engine = sim.encode_chat(responses_protocol.construct_input_messages(request))
    assert counter.count_chat(parsed.messages or []) == len(engine)


def test_anthropic_image_blocks_are_counted_as_the_engine(counter: PromptCounter, sim: Any) -> None:
    """An Anthropic Messages body with images in a turn and in a tool result: kvgate's
    conversion counted by kvgate equals vLLM's own conversion (its wheel's code) rendered and
    expanded by the simulator."""
    import json

    from kvgate.anthropic.requests import parse_messages_request
    from tests.anthropic.vllm_oracle import ORACLE, vllm_chat_request

    if ORACLE is None:
        pytest.skip("the vLLM 0.34 wheel is not available")
    png_data = base64.b64encode(image_bytes(700, 500)).decode()
    jpeg_data = base64.b64encode(image_bytes(64, 640, "JPEG")).decode()
    body = {
        "model": "qwen2.5-vl-demo",
        "max_tokens": 16,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": png_data},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "snap", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "taken"},
                            {"type": "image", "source": {"type": "base64", "data": jpeg_data}},
                        ],
                    }
                ],
            },
        ],
    }
    ours = parse_messages_request(json.dumps(body).encode())
    theirs = vllm_chat_request(body)
    assert counter.count_chat(ours.messages or []) == len(sim.encode_chat(theirs["messages"]))


def test_qwen3_vl_images_are_counted_as_the_engine() -> None:
    """Qwen3-VL's directory values (patch 16, ``size`` 65536..16777216) under the same rule."""
    directory = vision_model_dir(family="qwen3_vl")
    counter = PromptCounter.from_model_dir(directory)
    spec = counter.vision
    assert spec is not None and (spec.patch_size, spec.min_pixels) == (16, 65536)
    engine = sim_tokenization.SimTokenizer(directory)
    for width, height in [(1, 1), (640, 480), (3000, 2000), (100, 5000)]:
        messages = _messages([(width, height, "PNG")])
        assert counter.count_chat(messages) == len(engine.encode_chat(messages)), (width, height)
