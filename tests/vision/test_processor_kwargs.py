"""The engine's ``--mm-processor-kwargs`` (``vision.mm_processor_kwargs``): an image's count
under the server's own min / max pixels equals transformers' Qwen2-VL image processor built
with the same keywords (what vLLM hands it), and keys kvgate would not count are refused."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from pydantic import ValidationError

from kvgate.config.model import BackendConfig, ModelConfig, VisionConfig
from kvgate.tokenize.counter import PromptCounter
from kvgate.tokenize.engine_counting import load_model_counter
from kvgate.tokenize.errors import TokenizerLoadError
from testbed.vision_model import PREPROCESSOR_CONFIG, vision_model_dir

hf_qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

KWARGS: list[dict[str, Any]] = [
    {"max_pixels": 1280 * 28 * 28},
    {"min_pixels": 256 * 28 * 28, "max_pixels": 512 * 28 * 28},
    {"size": {"shortest_edge": 100_000, "longest_edge": 400_000}},
    {"size": {"shortest_edge": 50_000, "longest_edge": 400_000}, "max_pixels": 200_000},
]


def _model(tmp_path: Path, kwargs: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        name="vl",
        tokenizer=str(vision_model_dir()),
        max_context=32768,
        default_max_new_tokens=16,
        backend="b",
        vision=VisionConfig(mm_processor_kwargs=kwargs),
    )


def _counter(tmp_path: Path, kwargs: dict[str, Any]) -> PromptCounter:
    backend = BackendConfig(name="b", kv_budget_tokens=48000)
    counter = load_model_counter(_model(tmp_path, kwargs), backend, tmp_path)
    assert isinstance(counter, PromptCounter)
    return counter


@pytest.mark.parametrize("kwargs", KWARGS, ids=[str(k) for k in KWARGS])
def test_counts_under_server_kwargs_equal_transformers(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    spec = _counter(tmp_path, kwargs).vision
    assert spec is not None
    # The processor as the directory configures it, called with the server's keywords (as
    # vLLM calls it: the pixel keys and size aliases of each other, the pixel keys winning).
    settings = {k: v for k, v in PREPROCESSOR_CONFIG.items() if not k.endswith("_type")}
    settings.pop("processor_class", None)
    processor = hf_qwen2_vl.Qwen2VLImageProcessorPil(**settings)
    rng = random.Random(3)
    for _ in range(12):
        width, height = rng.randint(30, 3000), rng.randint(30, 3000)
        image = Image.new("RGB", (width, height))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # min/max_pixels at call time
            grid = processor(images=[image], return_tensors="np", **kwargs)["image_grid_thw"][0]
        assert spec.tokens_for(width, height) == int(grid.prod()) // 4, (width, height)
    # The bound reserved for a fetched image follows the server's max_pixels too.
    assert spec.max_tokens_per_image <= spec.max_pixels // (28 * 28)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_resize": False},
        {"images_kwargs": {"max_pixels": 10}},
        {"max_pixels": 0},
        {"min_pixels": "many"},
        {"size": {"height": 10}},
        {"size": {"longest_edge": 400_000}},
    ],
)
def test_kwargs_kvgate_would_not_count_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="mm_processor_kwargs"):
        _model(tmp_path, kwargs)


def test_min_over_max_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="min_pixels"):
        _counter(tmp_path, {"min_pixels": 10_000_000, "max_pixels": 1_000_000})
