"""Images in chats to a LLaVA-1.5 model (a fixed count per image), counted by kvgate against
independent references.

* The count per image against vLLM 0.34's own code, read from its wheel:
  ``BaseLlavaProcessingInfo.get_num_image_tokens`` / ``get_max_image_tokens``
  (``llava.py``), ``CLIPEncoderInfo`` (``clip.py``) and ``get_num_selected_vision_tokens``
  (``vision.py``), run over the config transformers' ``LlavaConfig`` reads from the
  directory (as vLLM's ``ctx.get_hf_config(LlavaConfig)``), for llava-1.5's config and
  variants of it (each feature-select strategy, other tower sizes, omitted fields).
* Whole prompts against the simulator's path (transformers' tokenizer and llava-1.5's chat
  template, the image decoded, each ``<image>`` expanded), several images and formats.
* Every image check of the dynamic family applies unchanged: a corrupt image, a private URL,
  too many images and ``<image>`` typed in a message are refused naming the part.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import zipfile
from abc import ABC, abstractmethod
from collections import namedtuple
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest
from PIL import Image

from kvgate.tokenize import PromptRenderError
from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.errors import TokenizerLoadError
from kvgate.tokenize.vision import ImageRef, image_tokens, load_vision_spec
from testbed.engine_models import vllm_wheel
from testbed.vision_model import (
    LLAVA_IMAGE_TOKEN_ID,
    LLAVA_MODEL_CONFIG,
    LLAVA_PROCESSOR_CONFIG,
    vision_model_dir,
)

sim_tokenization = pytest.importorskip("vllm_sim.tokenization")
transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------ vLLM's count, from its wheel


def _functions(source: str, names: set[str], within: str | None = None) -> str:
    """The source of the named top-level functions or classes (or methods of ``within``)."""
    tree = ast.parse(source)
    body = tree.body
    if within is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == within).body
    found = [
        node
        for node in body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names
    ]
    assert {node.name for node in found} == names
    return "\n\n".join(ast.unparse(node) for node in found)


@pytest.fixture(scope="module")
def vllm_llava_info() -> Any:
    """A class whose methods are vLLM's ``BaseLlavaProcessingInfo`` count, over the CLIP
    tower's ``CLIPEncoderInfo``; built with a model directory."""
    wheel = vllm_wheel()
    if wheel is None:
        pytest.skip("vLLM's wheel is not available")
    with zipfile.ZipFile(wheel) as archive:
        read = {name: archive.read(f"vllm/model_executor/models/{name}").decode() for name in (
            "vision.py", "clip.py", "llava.py")}  # fmt: skip
    namespace: dict[str, Any] = {
        "ABC": ABC,
        "abstractmethod": abstractmethod,
        "Generic": Generic,
        "_C": TypeVar("_C"),
        "torch": None,  # only a callable strategy would need it
        "CLIPVisionConfig": transformers.CLIPVisionConfig,
        "ImageSize": namedtuple("ImageSize", "width height"),
    }
    source = "\n\n".join(
        [
            "from __future__ import annotations",
            _functions(read["vision.py"], {"VisionEncoderInfo", "get_num_selected_vision_tokens"}),
            _functions(read["clip.py"], {"CLIPEncoderInfo"}),
        ]
    )
    exec(compile(source, "vllm-llava-count", "exec"), namespace)
    methods = _functions(
        read["llava.py"],
        {"get_num_image_tokens", "get_image_size_with_most_features", "get_max_image_tokens"},
        within="BaseLlavaProcessingInfo",
    )
    info_source = (
        "class LlavaInfo:\n"
        "    def __init__(self, model_dir):\n"
        "        self.config = LlavaConfig.from_pretrained(str(model_dir))\n"
        "    def get_hf_config(self):\n"
        "        return self.config\n"
        "    def get_vision_encoder_info(self):\n"
        "        return CLIPEncoderInfo(self.config)\n"
        + "\n".join("    " + line for line in methods.splitlines())
    )
    namespace["LlavaConfig"] = transformers.LlavaConfig
    exec(compile(info_source, "vllm-llava-info", "exec"), namespace)
    return namespace["LlavaInfo"]


def _config_dir(root: Path, name: str, config: dict[str, Any]) -> Path:
    out = root / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "processor_config.json").write_text(json.dumps(LLAVA_PROCESSOR_CONFIG))
    return out


TOWER = LLAVA_MODEL_CONFIG["vision_config"]
CONFIG_VARIANTS: dict[str, dict[str, Any]] = {
    "llava-1.5": LLAVA_MODEL_CONFIG,
    "full": {**LLAVA_MODEL_CONFIG, "vision_feature_select_strategy": "full"},
    "no strategy": {
        k: v for k, v in LLAVA_MODEL_CONFIG.items() if k != "vision_feature_select_strategy"
    },
    "ViT-L/14-224": {**LLAVA_MODEL_CONFIG, "vision_config": {**TOWER, "image_size": 224}},
    "no tower": {k: v for k, v in LLAVA_MODEL_CONFIG.items() if k != "vision_config"},
    "tower sizes omitted": {
        **LLAVA_MODEL_CONFIG,
        "vision_config": {
            k: v
            for k, v in TOWER.items()
            if k not in ("image_size", "patch_size", "hidden_size", "num_attention_heads")
        },
    },
}
SIZES = [(1, 1), (336, 336), (640, 480), (40, 3000), (4000, 3000)]


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_the_count_per_image_is_vllms(variant: str, vllm_llava_info: Any, tmp_path: Path) -> None:
    model_dir = _config_dir(tmp_path, "model", CONFIG_VARIANTS[variant])
    reference = vllm_llava_info(model_dir)
    spec = load_vision_spec(model_dir)
    assert spec is not None
    for width, height in SIZES:
        expected = reference.get_num_image_tokens(image_width=width, image_height=height)
        assert spec.tokens_for(width, height) == expected, (variant, width, height)
    assert spec.max_tokens_per_image == reference.get_max_image_tokens()


def test_llava_1_5_takes_576_tokens_per_image(vllm_llava_info: Any) -> None:
    model_dir = vision_model_dir(family="llava")
    assert vllm_llava_info(model_dir).get_max_image_tokens() == 576
    spec = load_vision_spec(model_dir)
    assert spec is not None and spec.max_tokens_per_image == 576
    assert load_vision_spec(vision_model_dir(family="llava_full")).max_tokens_per_image == 577  # type: ignore[union-attr]


def test_a_tower_kvgate_does_not_count_leaves_images_refused(tmp_path: Path) -> None:
    siglip = {**LLAVA_MODEL_CONFIG, "vision_config": {**TOWER, "model_type": "siglip_vision_model"}}
    assert load_vision_spec(_config_dir(tmp_path, "siglip", siglip)) is None


@pytest.mark.parametrize(
    "config",
    [
        # transformers' LlavaConfig refuses "class" (vLLM's helper has a branch for it).
        {**LLAVA_MODEL_CONFIG, "vision_feature_select_strategy": "class"},
        {**LLAVA_MODEL_CONFIG, "vision_feature_select_strategy": "cls_patch"},
        {**LLAVA_MODEL_CONFIG, "vision_config": {**TOWER, "image_size": 330}},
        {**LLAVA_MODEL_CONFIG, "vision_config": {**TOWER, "patch_size": 0}},
    ],
)
def test_a_config_vllm_refuses_is_refused_at_load(config: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError):
        load_vision_spec(_config_dir(tmp_path, "bad", config))


# ------------------------------------------------------------------ whole prompts vs the engine


def image_bytes(width: int, height: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (30, 160, 90)).save(out, fmt)
    return out.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return PromptCounter.from_model_dir(vision_model_dir(family="llava"), name="llava-demo")


@pytest.fixture(scope="module")
def sim() -> Any:
    return sim_tokenization.SimTokenizer(vision_model_dir(family="llava"))


FORMATS = [
    ("PNG", "image/png"),
    ("JPEG", "image/jpeg"),
    ("WEBP", "image/webp"),
    ("GIF", "image/gif"),
]


@pytest.mark.parametrize("images", [0, 1, 2, 3])
def test_chats_with_images_equal_the_engine(images: int, counter: PromptCounter, sim: Any) -> None:
    sizes = [(1, 1), (3000, 2000), (336, 336), (33, 777)]
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these, briefly."}]
    for i in range(images):
        fmt, media_type = FORMATS[i % len(FORMATS)]
        parts.append(image_part(data_url(image_bytes(*sizes[i], fmt), media_type)))
    messages = [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "Sure."},
        {
            "role": "user",
            "content": [
                image_part(data_url(image_bytes(64, 48))),
                {"type": "text", "text": "And this?"},
            ],
        },
    ]
    assert counter.render_chat(messages) == sim.render_chat(messages)
    expected = len(sim.encode_chat(messages))
    assert counter.count_chat(messages) == expected
    ids = sim.encode_chat(messages)
    assert ids.count(LLAVA_IMAGE_TOKEN_ID) == 576 * (images + 1)


def test_the_full_strategy_equals_the_engine() -> None:
    model_dir = vision_model_dir(family="llava_full")
    counter = PromptCounter.from_model_dir(model_dir)
    engine = sim_tokenization.SimTokenizer(model_dir)
    messages = [{"role": "user", "content": [image_part(data_url(image_bytes(500, 400)))]}]
    assert counter.count_chat(messages) == len(engine.encode_chat(messages))


def test_an_http_image_is_counted_exactly(counter: PromptCounter, sim: Any) -> None:
    inline = [{"role": "user", "content": [image_part(data_url(image_bytes(900, 700)))]}]
    fetched = [{"role": "user", "content": [image_part("https://images.example.com/cat.png")]}]
    assert counter.count_chat(fetched) == counter.count_chat(inline) == len(sim.encode_chat(inline))
    vision = counter.vision
    assert vision is not None
    where = "messages[0].content[0]"
    assert image_tokens(vision, ImageRef("https://images.example.com/a.png", where)) == 576


# ------------------------------------------------------------------ the same checks as before


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("data:image/png;base64," + base64.b64encode(image_bytes(64, 64)[:60]).decode(), "decode"),
        ("data:image/png;base64,!!!", "base64"),
        (data_url(image_bytes(64, 64, "JPEG"), "image/png"), "declares"),
        ("http://192.168.1.4/cat.png", "private or local"),
        ("http://localhost/cat.png", "private or local"),
        ("file:///etc/passwd", "data: or an http(s) URL"),
    ],
)
def test_a_bad_image_is_refused_naming_the_part(
    url: str, named: str, counter: PromptCounter
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(url)]}]
    with pytest.raises(PromptRenderError) as refused:
        counter.count_chat(messages)
    assert "messages[0].content[1]" in str(refused.value)
    assert named in str(refused.value)


def test_too_many_images_and_a_typed_placeholder_are_refused(counter: PromptCounter) -> None:
    url = data_url(image_bytes(8, 8))
    with pytest.raises(PromptRenderError, match=r"messages\[0\]\.content\[8\]"):
        counter.count_chat([{"role": "user", "content": [image_part(url)] * 9}])
    typed = [{"role": "user", "content": [{"type": "text", "text": "see <image> here"}]}]
    with pytest.raises(PromptRenderError, match="<image>"):
        counter.count_chat(typed)


def test_a_placeholder_that_is_not_one_token_leaves_images_refused(tmp_path: Path) -> None:
    """Counted as one token before its expansion, ``<image>`` must be an added token: a
    tokenizer without it would split it and kvgate would count low, so images are refused."""
    source = vision_model_dir(family="llava")
    model_dir = tmp_path / "llava-no-image-token"
    model_dir.mkdir()
    for name in ("tokenizer_config.json", "config.json", "processor_config.json"):
        (model_dir / name).write_bytes((source / name).read_bytes())
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<image>"]
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert PromptCounter.from_model_dir(source).vision is not None
    counter = PromptCounter.from_model_dir(model_dir)
    assert counter.vision is None
    with pytest.raises(PromptRenderError, match=r"messages\[0\]\.content\[0\]"):
        counter.count_chat([{"role": "user", "content": [image_part(data_url(image_bytes(8, 8)))]}])
