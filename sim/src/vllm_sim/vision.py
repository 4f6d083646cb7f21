"""Images in chat requests, as vLLM 0.34 serves a Qwen2-VL / Qwen2.5-VL or a LLaVA-1.5 model.

* The parts: ``image_url`` (``image_url.url``) and Responses' ``input_image`` (``image_url``)
  become ``{"type": "image", ...}`` for an "openai"-format template, or the model's
  placeholder ``<|vision_start|><|image_pad|><|vision_end|>`` before the text of a
  "string"-format one (``chat_message.py``).
* The images: a ``data:`` URL is split as ``MediaConnector._load_data_url`` does and decoded
  as ``ImageMediaIO.load_bytes`` does (Pillow with vLLM's format allow-list, the
  ``VLLM_MAX_IMAGE_PIXELS`` cap, EXIF orientation, a full ``load()``, RGB); an ``http(s)``
  URL is fetched (``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s).
* The prompt: after tokenizing, each ``<|image_pad|>`` becomes as many as the image's grid
  holds: transformers' own Qwen2-VL image processor (its Pillow backend, no torch) gives
  ``image_grid_thw``, and vLLM's ``_get_prompt_updates`` takes ``prod // merge_size**2``.
  On LLaVA (``llava.py``) each ``<image>`` becomes a fixed count read from ``config.json``.

Nothing here is shared with kvgate: the simulator is the reference kvgate is tested against.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import urllib.request
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps

# vLLM's Qwen2-VL, Qwen2.5-VL and Qwen3-VL share the image side (Qwen2VLImageProcessor).
VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
# vllm/multimodal/image.py: ALLOWED_IMAGE_FORMATS.
ALLOWED_IMAGE_FORMATS = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF",
    "ICNS", "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX",
    "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM",
    "XPM", "XVTHUMB",
)  # fmt: skip
MAX_IMAGE_PIXELS = 178_956_970  # VLLM_MAX_IMAGE_PIXELS
FETCH_TIMEOUT_S = 5.0  # VLLM_IMAGE_FETCH_TIMEOUT
MAX_FETCH_BYTES = 64 * 1024 * 1024


class VisionError(ValueError):
    """An image the engine cannot take (the request gets a 400)."""


class SimVision:
    """The image side of a vision model directory (Qwen2-VL's rule; ``LlavaVision`` below
    for LLaVA's)."""

    def __init__(self, model_dir: Path, image_token_id: int) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.processor = Qwen2VLImageProcessorPil.from_pretrained(
            str(model_dir), local_files_only=True
        )
        self.merge_size = int(self.processor.merge_size)
        self.image_token_id = image_token_id
        self.placeholder = IMAGE_PLACEHOLDER

    @staticmethod
    def for_model_dir(model_dir: Path, tokenizer: Any) -> SimVision | None:
        """The model's vision side, or None for a text-only model."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        if config.get("model_type") == "llava":
            return LlavaVision.for_model_dir(Path(model_dir))
        if config.get("model_type") not in VISION_MODEL_TYPES:
            return None
        token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if not isinstance(token_id, int):
            return None
        return SimVision(Path(model_dir), token_id)

    # -- one image ------------------------------------------------------------------------

    def load_image(self, url: str) -> Image.Image:
        if url.startswith("data:"):
            return _load_bytes(_data_url_bytes(url))
        if url.split(":", 1)[0].lower() in ("http", "https"):
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as answer:
                    data = answer.read(MAX_FETCH_BYTES + 1)
            except OSError as exc:
                raise VisionError(f"Failed to fetch image from {url}: {exc}") from exc
            if len(data) > MAX_FETCH_BYTES:
                raise VisionError("the image is too large")
            return _load_bytes(data)
        raise VisionError("The URL must be either a HTTP, data or file URL.")

    def image_tokens(self, url: str) -> int:
        image = self.load_image(url)
        try:
            grid = self.processor(images=[image], return_tensors="np")["image_grid_thw"][0]
        except ValueError as exc:  # smart_resize's aspect-ratio refusal
            raise VisionError(str(exc)) from exc
        return int(grid.prod()) // (self.merge_size**2)

    # -- the prompt -----------------------------------------------------------------------

    def expand(self, ids: Sequence[int], urls: Sequence[str]) -> list[int]:
        """The prompt with each image's one placeholder token expanded to its grid."""
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(positions) != len(urls):
            raise VisionError(
                f"Expected there to be {len(urls)} prompt updates corresponding to "
                f"{len(urls)} image items, but instead found {len(positions)} prompt updates!"
            )
        counts = [self.image_tokens(url) for url in urls]
        out: list[int] = []
        start = 0
        for position, count in zip(positions, counts, strict=True):
            out.extend(ids[start:position])
            out.extend([self.image_token_id] * count)
            start = position + 1
        out.extend(ids[start:])
        return out


class LlavaVision(SimVision):
    """LLaVA-1.5 (``llava.py``): the config transformers' ``LlavaConfig`` reads (as vLLM's
    ``ctx.get_hf_config(LlavaConfig)``), the CLIP tower's ``CLIPEncoderInfo`` count
    (grid^2 + the CLS token) through ``get_num_selected_vision_tokens``; the placeholder is
    the processor's ``image_token`` and its id ``image_token_index``."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import CLIPVisionConfig, LlavaConfig

        config = LlavaConfig.from_pretrained(str(model_dir), local_files_only=True)
        tower = config.vision_config
        if not isinstance(tower, CLIPVisionConfig):
            raise VisionError(f"Unsupported vision config: {type(tower)}")
        assert tower.image_size % tower.patch_size == 0
        tower_tokens = (tower.image_size // tower.patch_size) ** 2 + 1
        strategy = config.vision_feature_select_strategy
        if strategy == "class":
            self.tokens_per_image = 1
        elif strategy == "default":
            self.tokens_per_image = tower_tokens - 1
        elif strategy == "full":
            self.tokens_per_image = tower_tokens
        else:
            raise ValueError(f"Unexpected feature select strategy: {strategy!r}")
        self.image_token_id = int(config.image_token_index)
        try:
            processor = json.loads((model_dir / "processor_config.json").read_text("utf-8"))
        except (OSError, ValueError):
            processor = {}
        self.placeholder = str(processor.get("image_token", "<image>"))

    @staticmethod
    def for_model_dir(model_dir: Path, tokenizer: Any = None) -> LlavaVision:
        return LlavaVision(model_dir)

    def image_tokens(self, url: str) -> int:
        self.load_image(url)  # fetched and decoded as the engine does (and refused alike)
        return self.tokens_per_image


def _data_url_bytes(url: str) -> bytes:
    """MediaConnector._load_data_url + ImageMediaIO.load_base64."""
    spec, comma, data = url[5:].partition(",")
    if not comma:
        raise VisionError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    _media_type, semicolon, encoding = spec.rpartition(";")
    if not semicolon or encoding != "base64":
        raise VisionError("Only base64 data URLs are supported for now.")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise VisionError(f"Failed to load image: {exc}") from exc


def _load_bytes(data: bytes) -> Image.Image:
    """ImageMediaIO.load_bytes with image_mode RGB."""
    try:
        image = Image.open(BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise VisionError(
                f"Image dimensions {width}x{height} ({width * height} pixels) exceed the "
                f"maximum of {MAX_IMAGE_PIXELS} pixels."
            )
        with contextlib.suppress(Exception):
            image = ImageOps.exif_transpose(image)
        image.load()
        return image.convert("RGB") if image.mode != "RGB" else image
    except VisionError:
        raise
    except (OSError, SyntaxError, RuntimeError, Image.DecompressionBombError) as exc:
        raise VisionError(f"Failed to load image: {exc}") from exc


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "input_image")


def image_part_url(part: dict[str, Any]) -> str | None:
    """vLLM's parsers: ``image_url.url`` for chat, ``image_url`` for Responses' items."""
    value = part.get("image_url")
    if part.get("type") == "image_url":
        if not isinstance(value, dict):
            raise VisionError("image_url must be an object with a 'url'")
        value = value.get("url")
    return value if isinstance(value, str) else None
