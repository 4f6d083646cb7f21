"""Images in chat prompts: how many tokens each one costs on a vision-language model.

vLLM 0.34 renders an image part as the model's placeholder (Qwen2-VL / Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``), tokenizes the prompt, then expands the one
``<|image_pad|>`` into as many as the image's grid holds (``qwen2_vl.py``:
``_get_prompt_updates``, ``grid_thw.prod() // merge_size**2``). The grid comes from the image
processor's ``smart_resize`` (transformers' ``image_processing_qwen2_vl.py``): each side
rounded to a multiple of ``patch_size * merge_size`` and the area kept within
``[min_pixels, max_pixels]``; one image is one temporal patch.

LLaVA-1.5 (``llava.py``) is a fixed-count family: its ``<image>`` token becomes
``get_num_image_tokens`` of them whatever the image's size, read from ``config.json``'s
vision tower (CLIP ViT-L/14-336: 24 x 24 patches = 576). Families are looked up by
``config.json``'s ``model_type`` in ``VISION_FAMILIES``.

* ``data:`` URLs are decoded here (Pillow), far enough to know the format and the size,
  then decoded whole so an image the engine cannot read is refused as it would refuse it.
  The size is checked against the model's pixel cap before anything is decompressed.
* ``http(s)`` URLs are fetched by the engine, not here: such an image is reserved at the
  most tokens one image can take (``max_tokens_per_image``; exact for a fixed-count
  family) and the bill follows the answer's ``usage.prompt_tokens``. URLs naming a
  private, loopback or link-local address are refused (the engine would fetch them from
  inside the cluster).

Everything here is pure and synchronous: decoding runs where counting runs, on the
tokenizer workers.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ipaddress
import json
import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from PIL import Image, UnidentifiedImageError

from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError

# The model types whose image rule is Qwen2-VL's: vLLM's Qwen2_5_VLProcessingInfo and
# Qwen3VLProcessingInfo inherit Qwen2VLProcessingInfo's image side (Qwen2VLImageProcessor,
# smart_resize by patch_size x merge_size, the same placeholder and expansion); only the
# directory's values differ (Qwen3-VL: patch 16, 65536 to 16777216 pixels).
QWEN2_VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
QWEN2_VL_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN2_VL_IMAGE_TOKEN = "<|image_pad|>"
QWEN2_VL_VIDEO_TOKEN = "<|video_pad|>"
# LLaVA's placeholder (LlavaProcessor's image_token; config.json names its id).
LLAVA_IMAGE_TOKEN = "<image>"
# transformers' Qwen2VLImageProcessor defaults, used when the directory's config omits them.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# smart_resize refuses images more elongated than this (vLLM answers 400).
MAX_ASPECT_RATIO = 200
# The formats kvgate decodes: the common web formats, all in vLLM's allow-list.
DECODED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# MIME types clients declare for those formats (Pillow's own, plus the usual alias).
_MIME_ALIASES = {"image/jpg": "image/jpeg", "image/x-ms-bmp": "image/bmp"}


@dataclass(frozen=True, slots=True)
class VisionLimits:
    """Per-request bounds on images (the model's ``vision`` settings)."""

    max_images: int = 8
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 16 * 1024 * 1024
    # http(s) image URLs are allowed (reserved at the most one image can take).
    remote_images: bool = True
    # Hosts an image URL may name even when they are private or loopback addresses.
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)


DEFAULT_VISION_LIMITS = VisionLimits()


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part of a request: its URL and where it is (for refusals)."""

    url: str
    where: str


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen2-VL ``smart_resize``, the same arithmetic (floats and all)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VisionSpec:
    """A vision model's image rule, read from its directory at load."""

    model_type: str
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    placeholder: str = QWEN2_VL_IMAGE_PLACEHOLDER
    image_token: str = QWEN2_VL_IMAGE_TOKEN
    # Tokens a message's text may not contain: the engine would take them for media.
    reserved_tokens: tuple[str, ...] = (QWEN2_VL_IMAGE_TOKEN, QWEN2_VL_VIDEO_TOKEN)
    limits: VisionLimits = DEFAULT_VISION_LIMITS

    def tokens_for(self, width: int, height: int) -> int:
        """Tokens one image of this size becomes in the prompt."""
        factor = self.patch_size * self.merge_size
        resized_h, resized_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        patches = (resized_h // self.patch_size) * (resized_w // self.patch_size)
        return patches // (self.merge_size**2)

    @functools.cached_property
    def max_tokens_per_image(self) -> int:
        """The most tokens one image can take: vLLM's ``get_max_image_tokens`` (the largest
        grid within max_pixels whose aspect ratio smart_resize accepts)."""
        unit = self.patch_size * self.merge_size
        max_seq_len = self.max_pixels // (unit * unit)
        height_factor, width_factor = 1, max_seq_len
        for seq_len in range(max_seq_len, 0, -1):
            height_factor, width_factor = _closest_factor_pair(seq_len)
            if width_factor / height_factor <= MAX_ASPECT_RATIO:
                break
        return self.tokens_for(unit * width_factor, unit * height_factor)

    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> VisionSpec:
        """The rule under the engine's ``--mm-processor-kwargs``: ``size`` over the
        directory's, then ``min_pixels`` / ``max_pixels`` over it (vLLM's
        ``_get_vision_size``, the image processor's own order). Other keys are refused by the
        config before this is called."""
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        given = kwargs.get("size")
        if isinstance(given, Mapping):
            size.update({k: v for k, v in given.items() if v is not None})
        if kwargs.get("min_pixels") is not None:
            size["shortest_edge"] = kwargs["min_pixels"]
        if kwargs.get("max_pixels") is not None:
            size["longest_edge"] = kwargs["max_pixels"]
        min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        if min_pixels > max_pixels:
            raise ValueError("min_pixels is larger than max_pixels")
        return VisionSpec(
            self.model_type,
            self.patch_size,
            self.merge_size,
            min_pixels,
            max_pixels,
            self.placeholder,
            self.image_token,
            self.reserved_tokens,
            self.limits,
        )

    def with_limits(self, limits: VisionLimits) -> VisionSpec:
        return VisionSpec(
            self.model_type,
            self.patch_size,
            self.merge_size,
            self.min_pixels,
            self.max_pixels,
            self.placeholder,
            self.image_token,
            self.reserved_tokens,
            limits,
        )


def _closest_factor_pair(n: int) -> tuple[int, int]:
    for d in range(math.isqrt(n), 0, -1):
        if n % d == 0:
            return d, n // d
    return 1, n


class VisionRule(Protocol):
    """What counting needs of a vision family: its placeholders, the tokens one image takes,
    the most one image can take, and the engine's settings applied over the directory's."""

    @property
    def placeholder(self) -> str: ...
    @property
    def image_token(self) -> str: ...
    @property
    def reserved_tokens(self) -> tuple[str, ...]: ...
    @property
    def limits(self) -> VisionLimits: ...
    @property
    def max_tokens_per_image(self) -> int: ...
    def tokens_for(self, width: int, height: int) -> int: ...
    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> VisionRule: ...
    def with_limits(self, limits: VisionLimits) -> VisionRule: ...


@dataclass(frozen=True)
class FixedVisionSpec:
    """A family whose image always takes the same number of tokens (LLaVA-1.5: vLLM's
    ``llava.py``, the placeholder token repeated ``get_num_image_tokens`` times whatever the
    image's size: the vision tower sees it resized to ``image_size``)."""

    model_type: str
    tokens_per_image: int
    placeholder: str = LLAVA_IMAGE_TOKEN
    image_token: str = LLAVA_IMAGE_TOKEN
    reserved_tokens: tuple[str, ...] = (LLAVA_IMAGE_TOKEN,)
    limits: VisionLimits = DEFAULT_VISION_LIMITS

    def tokens_for(self, width: int, height: int) -> int:
        return self.tokens_per_image

    @property
    def max_tokens_per_image(self) -> int:
        return self.tokens_per_image

    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> FixedVisionSpec:
        # vLLM's LLaVA count reads config.json alone: processor kwargs resize the pixels the
        # tower sees, never the number of tokens it gives.
        return self

    def with_limits(self, limits: VisionLimits) -> FixedVisionSpec:
        return FixedVisionSpec(
            self.model_type,
            self.tokens_per_image,
            self.placeholder,
            self.image_token,
            self.reserved_tokens,
            limits,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _positive_int(value: Any, name: str, source: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TokenizerLoadError(str(source), f"{name} must be a positive integer")
    return value


def _image_processor_config(path: Path) -> dict[str, Any]:
    processor = _read_json(path / "preprocessor_config.json")
    nested = _read_json(path / "processor_config.json").get("image_processor")
    if not processor and isinstance(nested, dict):
        processor = nested
    return processor


def _qwen2_vl_spec(path: Path, config: Mapping[str, Any]) -> VisionRule:
    processor = _image_processor_config(path)
    vision_config = config.get("vision_config")
    vision = vision_config if isinstance(vision_config, Mapping) else {}
    source = path / "preprocessor_config.json"
    patch = _positive_int(
        processor.get("patch_size", vision.get("patch_size", 14)), "patch_size", source
    )
    merge = _positive_int(
        processor.get("merge_size", vision.get("spatial_merge_size", 2)), "merge_size", source
    )
    # The image processor's own rule: `size` first, min_pixels / max_pixels over it.
    size = processor.get("size")
    size = dict(size) if isinstance(size, Mapping) else {}
    if processor.get("min_pixels") is not None:
        size["shortest_edge"] = processor["min_pixels"]
    if processor.get("max_pixels") is not None:
        size["longest_edge"] = processor["max_pixels"]
    min_pixels = _positive_int(size.get("shortest_edge", _DEFAULT_MIN_PIXELS), "min_pixels", source)
    max_pixels = _positive_int(size.get("longest_edge", _DEFAULT_MAX_PIXELS), "max_pixels", source)
    if min_pixels > max_pixels:
        raise TokenizerLoadError(str(source), "min_pixels is larger than max_pixels")
    return VisionSpec(str(config["model_type"]), patch, merge, min_pixels, max_pixels)


def _llava_spec(path: Path, config: Mapping[str, Any]) -> VisionRule | None:
    """vLLM's ``BaseLlavaProcessingInfo.get_num_image_tokens`` over the config transformers'
    ``LlavaConfig`` reads: a missing ``vision_config`` is CLIP ViT-L/14-336's, a given one
    takes CLIPVisionConfig's defaults (224, 32) for what it omits; the CLIP tower gives
    (image_size / patch_size)^2 patches and its CLS token, of which ``default`` keeps all
    but the CLS token and ``full`` all."""
    source = path / "config.json"
    given = config.get("vision_config")
    if given is None:
        vision: Mapping[str, Any] = {"model_type": "clip_vision_model", **_LLAVA_DEFAULT_TOWER}
    elif isinstance(given, Mapping):
        vision = given
    else:
        raise TokenizerLoadError(str(source), "vision_config must be an object")
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        return None  # SigLIP, Pixtral towers: not counted (their image parts are refused)
    image_size = _positive_int(vision.get("image_size", 224), "vision_config.image_size", source)
    patch_size = _positive_int(vision.get("patch_size", 32), "vision_config.patch_size", source)
    if image_size % patch_size:
        # vLLM asserts this when it loads the model: it never serves such a directory.
        raise TokenizerLoadError(str(source), "image_size is not a multiple of patch_size")
    tower_tokens = (image_size // patch_size) ** 2 + 1  # CLIPEncoderInfo: the CLS token too
    strategy = config.get("vision_feature_select_strategy", "default")
    # transformers' LlavaConfig accepts these two alone: vLLM never serves another.
    selected = {"default": tower_tokens - 1, "full": tower_tokens}.get(strategy)
    if selected is None:
        raise TokenizerLoadError(
            str(source), f"unknown vision_feature_select_strategy {strategy!r}"
        )
    processor = _read_json(path / "processor_config.json")
    token = processor.get("image_token", LLAVA_IMAGE_TOKEN)
    if not isinstance(token, str) or not token:
        raise TokenizerLoadError(str(path / "processor_config.json"), "image_token is empty")
    return FixedVisionSpec(str(config["model_type"]), selected, token, token, (token,))


# CLIP ViT-L/14-336, the tower LlavaConfig builds when config.json names none.
_LLAVA_DEFAULT_TOWER = {"image_size": 336, "patch_size": 14}

# config.json's model_type -> the family's rule. A family is one more entry here.
VISION_FAMILIES: dict[str, Callable[[Path, Mapping[str, Any]], VisionRule | None]] = {
    **dict.fromkeys(QWEN2_VL_MODEL_TYPES, _qwen2_vl_spec),
    "llava": _llava_spec,
}


def load_vision_spec(model_dir: Path | str) -> VisionRule | None:
    """The image rule of the model in ``model_dir``; None when kvgate counts no images for
    it (no ``config.json`` of a family in ``VISION_FAMILIES``)."""
    path = Path(model_dir)
    try:
        config = _read_json(path / "config.json")
        family = VISION_FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
        if family is None:
            return None
        return family(path, config)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(str(path), f"unreadable vision config: {exc}") from exc


def fetched_images(messages: Any) -> bool:
    """Whether a chat names an image by a URL the engine fetches: its answer is not a function
    of the request's bytes (the image behind the URL can change), so no cache may keep it."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in (
                "image_url",
                "input_image",
            ):
                continue
            url = part.get("image_url")
            if isinstance(url, Mapping):
                url = url.get("url")
            if not (isinstance(url, str) and url[:5].lower() == "data:"):
                return True
    return False


# ------------------------------------------------------------------------- one image


def image_tokens(spec: VisionRule, image: ImageRef) -> int:
    """Tokens ``image`` takes in the prompt: exact for a ``data:`` URL (decoded and checked
    even when the family's count is fixed: the engine refuses what does not decode), the
    model's maximum for an ``http(s)`` URL the engine fetches. ``PromptRenderError`` names
    the part."""
    url = image.url
    if url[:5].lower() == "data:":
        width, height = decode_data_url(url, image.where, spec.limits)
        try:
            return spec.tokens_for(width, height)
        except ValueError as exc:
            raise PromptRenderError(f"{image.where}: {exc}") from None
    check_remote_url(url, image.where, spec.limits)
    return spec.max_tokens_per_image


def decode_data_url(url: str, where: str, limits: VisionLimits) -> tuple[int, int]:
    """(width, height) of the image a ``data:`` URL holds, refused (``PromptRenderError``)
    when it is not a base64 image of a decoded format, declares another type than it
    holds, is larger than the limits or does not decode whole."""
    # RFC 2397 as vLLM splits it: data:[<mediatype>][;<param>=<value>]*;base64,<data>
    spec, comma, data = url[5:].partition(",")
    if not comma:
        raise PromptRenderError(f"{where}: invalid data URL: missing ',' separator")
    media_type, semicolon, encoding = spec.rpartition(";")
    if not semicolon or encoding != "base64":
        raise PromptRenderError(f"{where}: only base64 data URLs are supported")
    media_type = media_type.partition(";")[0].strip().lower()
    # base64 carries 3 bytes in 4 characters: refuse by length before decoding anything.
    if len(data) // 4 * 3 > limits.max_image_bytes:
        raise PromptRenderError(f"{where}: the image is larger than {limits.max_image_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise PromptRenderError(f"{where}: the data URL is not valid base64") from None
    try:
        with Image.open(BytesIO(raw), formats=DECODED_FORMATS) as picture:
            width, height = picture.size
            if width <= 0 or height <= 0:
                raise PromptRenderError(f"{where}: the image has no pixels")
            if width * height > limits.max_image_pixels:
                raise PromptRenderError(
                    f"{where}: the image is {width}x{height} ({width * height} pixels), "
                    f"more than the {limits.max_image_pixels} pixels allowed per image"
                )
            declared = _MIME_ALIASES.get(media_type, media_type)
            actual = Image.MIME.get(picture.format or "", "")
            if declared != actual:
                raise PromptRenderError(
                    f"{where}: the data URL declares {media_type or 'no type'!r} but holds "
                    f"{actual or 'another format'!r}"
                )
            picture.load()  # the whole image must decode, as the engine decodes it
    except PromptRenderError:
        raise
    except (
        OSError,
        UnidentifiedImageError,
        SyntaxError,
        RuntimeError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        reason = (
            "not an image of a supported format"
            if isinstance(exc, UnidentifiedImageError)
            else "the image does not decode"
        )
        raise PromptRenderError(f"{where}: {reason} ({', '.join(DECODED_FORMATS)})") from None
    return width, height


def check_remote_url(url: str, where: str, limits: VisionLimits) -> None:
    """Refuse an image URL the engine must not fetch: not http(s), remote images off, or a
    host that is a private, loopback, link-local or otherwise internal address (unless the
    allow-list names it). A DNS name is not resolved here (see deviations)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise PromptRenderError(f"{where}: the image URL is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise PromptRenderError(f"{where}: an image URL must be a data: or an http(s) URL")
    if not limits.remote_images:
        raise PromptRenderError(
            f"{where}: image URLs are not accepted for this model; send the image as a data: URL"
        )
    host = host.lower().rstrip(".")
    if host in limits.allowed_hosts:
        return
    if host == "localhost" or host.endswith(".localhost") or _is_internal_address(host):
        raise PromptRenderError(
            f"{where}: the image URL names a private or local address, which the engine "
            "may not fetch"
        )


def _is_internal_address(host: str) -> bool:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            # The forms resolvers still read as IPv4 ("127.1", "0x7f.0.0.1", "2130706433").
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return False
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:
            address = mapped
    return not address.is_global or address.is_multicast
