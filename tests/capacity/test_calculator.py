"""KV bytes per token and token budgets, against figures worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.capacity.calculator import (
    KvBudgetError,
    compute_kv_budget,
    kv_layout,
    load_model_config,
    resolve_kv_dtype,
    text_config,
)
from kvgate.capacity.units import GIB, KIB
from tests.capacity.model_configs import DEEPSEEK_V3, LLAMA3_8B

LLAMA3_70B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

# Falcon-7B: multi-query attention, hidden 4544 over 71 heads -> head_dim 64.
FALCON_7B: dict[str, Any] = {
    "model_type": "falcon",
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "multi_query": True,
    "new_decoder_architecture": False,
    "torch_dtype": "bfloat16",
}


# Llama-4-Scout shape: the decoder lives under text_config, the dtype at the top.
LLAMA4_SCOUT: dict[str, Any] = {
    "model_type": "llama4",
    "torch_dtype": "bfloat16",
    "vision_config": {"num_hidden_layers": 34, "hidden_size": 1408, "num_attention_heads": 16},
    "text_config": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 48,
    },
}


def budget(config: dict[str, Any], **kw: Any) -> Any:
    args: dict[str, Any] = {
        "gpu_memory_bytes": 24 * GIB,
        "weights_bytes": 16 * GIB,
        "overhead_bytes": 2 * GIB,
    }
    args.update(kw)
    return compute_kv_budget(config, **args)


# --- the seed example ---------------------------------------------------------------


def test_llama3_8b_seed_example() -> None:
    # 2 (K,V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 131,072 B = 128 KiB.
    # (24 - 16 - 2) GiB = 6 GiB = 6,442,450,944 B; / 131,072 = 49,152 tokens = 3,072 blocks.
    b = budget(LLAMA3_8B, gpu_memory_utilization=1.0)
    assert b.layout.head_dim == 128  # 4096 / 32
    assert b.layout.bytes_per_token == 131072 == 128 * KIB
    assert b.layout.bytes_per_token_per_gpu == 131072
    assert b.kv_memory_bytes == 6 * GIB
    assert b.kv_tokens == 49152
    assert b.num_gpu_blocks == 3072
    assert b.kv_tokens_block_aligned == 49152
    assert b.layout.attention == "standard"
    assert b.layout.kv_dtype == "bfloat16"


def test_utilization_scales_usable_memory() -> None:
    # 24 GiB x 0.9 = 21.6 GiB; minus 18 GiB = 3.6 GiB = 3,865,470,566 B (floored);
    # / 131,072 = 29,491 tokens (29,491.2); 1,843 whole blocks = 29,488 tokens.
    b = budget(LLAMA3_8B, gpu_memory_utilization=0.9)
    assert b.usable_bytes == 23192823398
    assert b.kv_tokens == 29491
    assert b.num_gpu_blocks == 1843
    assert b.kv_tokens_block_aligned == 29488


def test_block_size_rounds_down_to_whole_blocks() -> None:
    # Same 29,491 tokens in blocks of 32: 921 blocks = 29,472 tokens.
    b = budget(LLAMA3_8B, gpu_memory_utilization=0.9, block_size=32)
    assert b.kv_tokens == 29491
    assert b.num_gpu_blocks == 921
    assert b.kv_tokens_block_aligned == 29472


# --- attention shapes ---------------------------------------------------------------


def test_mqa_falcon_7b() -> None:
    # multi_query: 1 KV head; head_dim 4544 / 71 = 64.
    # 2 x 32 x 1 x 64 x 2 = 8,192 B = 8 KiB per token; 6 GiB / 8 KiB = 786,432 tokens.
    b = budget(FALCON_7B)
    assert b.layout.num_kv_heads == 1
    assert b.layout.head_dim == 64
    assert b.layout.bytes_per_token == 8192
    assert b.kv_tokens == 786432


def test_mqa_under_tp_is_replicated() -> None:
    # One KV head cannot be split over 2 GPUs: each holds it, so per GPU stays 8 KiB.
    layout = kv_layout(FALCON_7B, tp=2)
    assert layout.kv_heads_per_gpu == 1
    assert layout.bytes_per_token == 8192
    assert layout.bytes_per_token_per_gpu == 8192
    assert any("replicated" in n for n in layout.notes)


def test_num_key_value_heads_1_is_mqa_too() -> None:
    cfg = {**LLAMA3_8B, "num_key_value_heads": 1}
    # 2 x 32 x 1 x 128 x 2 = 16,384 B.
    assert kv_layout(cfg).bytes_per_token == 16384


def test_mha_defaults_kv_heads_to_attention_heads() -> None:
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    # 2 x 32 x 32 x 128 x 2 = 524,288 B = 512 KiB.
    layout = kv_layout(cfg)
    assert layout.num_kv_heads == 32
    assert layout.bytes_per_token == 512 * KIB


def test_gpt2_style_field_names() -> None:
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
    # MHA: 2 x 12 x 12 x 64 x 2 = 36,864 B (no torch_dtype: 2 bytes assumed).
    layout = kv_layout(gpt2)
    assert layout.bytes_per_token == 36864
    assert any("assumed bfloat16" in n for n in layout.notes)


def test_gqa_70b() -> None:
    # 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB.
    layout = kv_layout(LLAMA3_70B)
    assert layout.head_dim == 128  # 8192 / 64
    assert layout.bytes_per_token == 327680 == 320 * KIB


def test_explicit_head_dim_beats_hidden_over_heads() -> None:
    # Gemma-7B: hidden 3072 / 16 heads would be 192, but head_dim is 256.
    gemma = {
        "model_type": "gemma",
        "hidden_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "num_hidden_layers": 28,
        "torch_dtype": "bfloat16",
    }
    # 2 x 28 x 16 x 256 x 2 = 458,752 B = 448 KiB.
    assert kv_layout(gemma).bytes_per_token == 458752


def test_null_head_dim_is_derived() -> None:
    cfg = {**LLAMA3_8B, "head_dim": None}
    assert kv_layout(cfg).head_dim == 128


# --- dtypes -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "FP8"])
def test_fp8_halves_bytes_and_doubles_tokens(dtype: str) -> None:
    # 131,072 / 2 = 65,536 B; 6 GiB / 64 KiB = 98,304 tokens.
    b = budget(LLAMA3_8B, kv_dtype=dtype)
    assert b.layout.dtype_bytes == 1
    assert b.layout.bytes_per_token == 65536
    assert b.kv_tokens == 98304 == 2 * 49152


@pytest.mark.parametrize(
    ("dtype", "name", "size"),
    [
        ("bf16", "bfloat16", 2),
        ("bfloat16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("half", "float16", 2),
        ("float16", "float16", 2),
        ("fp32", "float32", 4),
        ("float32", "float32", 4),
    ],
)
def test_explicit_dtypes(dtype: str, name: str, size: int) -> None:
    assert resolve_kv_dtype(dtype, LLAMA3_8B)[:2] == (name, size)


def test_fp32_doubles_bytes() -> None:
    assert kv_layout(LLAMA3_8B, kv_dtype="fp32").bytes_per_token == 262144


def test_auto_follows_model_dtype() -> None:
    assert resolve_kv_dtype("auto", {"torch_dtype": "float16"})[:2] == ("float16", 2)
    # Newer transformers write "dtype" instead of "torch_dtype".
    assert resolve_kv_dtype("auto", {"dtype": "bfloat16"})[:2] == ("bfloat16", 2)
    # vLLM's --dtype auto serves float32 checkpoints in float16.
    name, size, note = resolve_kv_dtype("auto", {"torch_dtype": "float32"})
    assert (name, size) == ("float16", 2)
    assert note is not None and "float32" in note
    # Nothing stated: 2 bytes, and a note says so.
    name, size, note = resolve_kv_dtype("auto", {})
    assert size == 2 and note is not None


def test_unknown_dtype_is_an_error() -> None:
    with pytest.raises(KvBudgetError, match=r"unknown KV dtype 'int3'"):
        kv_layout(LLAMA3_8B, kv_dtype="int3")


# --- tensor parallelism -------------------------------------------------------------


def test_tp2_splits_kv_heads() -> None:
    # 8 KV heads / 2 GPUs = 4 per GPU: 2 x 80 x 4 x 128 x 2 = 163,840 B = 160 KiB per GPU.
    # 80 GiB GPU, 40 GiB of weights per GPU: 40 GiB / 160 KiB = 262,144 tokens.
    b = compute_kv_budget(LLAMA3_70B, gpu_memory_bytes=80 * GIB, weights_bytes=40 * GIB, tp=2)
    assert b.layout.kv_heads_per_gpu == 4
    assert b.layout.bytes_per_token == 327680
    assert b.layout.bytes_per_token_per_gpu == 163840
    assert b.kv_tokens == 262144
    assert b.num_gpu_blocks == 16384


def test_tp_uneven_heads_round_up() -> None:
    # 8 KV heads over 3 GPUs: ceil(8/3) = 3 heads on the busiest GPU.
    layout = kv_layout(LLAMA3_8B, tp=3)
    assert layout.kv_heads_per_gpu == 3
    assert layout.bytes_per_token_per_gpu == 2 * 32 * 3 * 128 * 2


def test_tp_must_be_positive() -> None:
    with pytest.raises(KvBudgetError, match="tensor-parallel"):
        kv_layout(LLAMA3_8B, tp=0)


# --- MLA ----------------------------------------------------------------------------


def test_mla_deepseek_v3() -> None:
    # One latent per layer: 61 x (512 + 64) x 2 B = 70,272 B (~68.6 KiB) -- not
    # 2 x 61 x 128 heads x 192 x 2 = 5,996,544 B as plain MHA would cost.
    layout = kv_layout(DEEPSEEK_V3)
    assert layout.attention == "mla"
    assert layout.head_dim == 576
    assert layout.num_kv_heads == 1
    assert layout.bytes_per_token == 70272


def test_mla_budget() -> None:
    # 10 GiB for KV: 10,737,418,240 / 70,272 = 152,797 tokens; 9,549 blocks = 152,784.
    b = compute_kv_budget(DEEPSEEK_V3, gpu_memory_bytes=20 * GIB, weights_bytes=10 * GIB)
    assert b.kv_tokens == 152797
    assert b.num_gpu_blocks == 9549
    assert b.kv_tokens_block_aligned == 152784


def test_mla_fp8() -> None:
    # 61 x 576 x 1 = 35,136 B.
    assert kv_layout(DEEPSEEK_V3, kv_dtype="fp8").bytes_per_token == 35136


def test_mla_latent_is_not_split_by_tp() -> None:
    # vLLM's get_num_kv_heads() is 1 under MLA whatever the TP size: every rank holds
    # the whole latent.
    layout = kv_layout(DEEPSEEK_V3, tp=8)
    assert layout.bytes_per_token_per_gpu == 70272
    assert any("replicated on every TP rank" in n for n in layout.notes)


def test_mla_null_kv_lora_rank_is_standard_attention() -> None:
    # DeepSeek-V2 configs without MLA carry kv_lora_rank: null.
    cfg = {**LLAMA3_8B, "kv_lora_rank": None, "qk_rope_head_dim": 64}
    assert kv_layout(cfg).attention == "standard"


def test_mla_missing_rope_dim_is_named() -> None:
    cfg = {k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}
    with pytest.raises(KvBudgetError, match="qk_rope_head_dim"):
        kv_layout(cfg)


# --- nested and windowed configs ----------------------------------------------------


def test_nested_text_config() -> None:
    # The text decoder: 2 x 48 x 8 x 128 x 2 = 196,608 B = 192 KiB; the vision tower's
    # 34 layers are not counted. The dtype comes from the top level.
    layout = kv_layout(LLAMA4_SCOUT)
    assert layout.num_layers == 48
    assert layout.bytes_per_token == 196608
    assert layout.kv_dtype == "bfloat16"
    assert layout.model_type == "llama4_text"
    assert text_config(LLAMA4_SCOUT) is LLAMA4_SCOUT["text_config"]


def test_sliding_window_layers_are_noted_and_counted_in_full() -> None:
    # Gemma-3-27B-like: 62 layers, 16 KV heads x 128; 5 of every 6 layers local.
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2
    gemma3 = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 5376,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "num_hidden_layers": 62,
            "sliding_window": 1024,
            "layer_types": layer_types,
        },
    }
    layout = kv_layout(gemma3)
    # Worst case, all 62 layers full: 2 x 62 x 16 x 128 x 2 = 507,904 B.
    assert layout.bytes_per_token == 507904
    assert any("52 of 62 layers are sliding_attention" in n for n in layout.notes)


def test_mistral_sliding_window_note() -> None:
    mistral = {**LLAMA3_8B, "model_type": "mistral", "sliding_window": 4096}
    layout = kv_layout(mistral)
    assert layout.bytes_per_token == 131072
    assert any("window 4096" in n for n in layout.notes)


def test_disabled_sliding_window_has_no_note() -> None:
    # Qwen2 configs name a window but switch it off.
    qwen = {**LLAMA3_8B, "sliding_window": 131072, "use_sliding_window": False}
    assert not kv_layout(qwen).notes


# --- errors -------------------------------------------------------------------------


def test_nothing_left_for_kv_names_the_figures() -> None:
    with pytest.raises(KvBudgetError) as info:
        budget(LLAMA3_8B, overhead_bytes=6 * GIB, gpu_memory_utilization=0.9)
    msg = str(info.value)
    assert "weights 16 GiB + overhead 6 GiB = 22 GiB exceed 24 GiB x 0.9 = 21.6 GiB" in msg


def test_exactly_full_is_an_error() -> None:
    with pytest.raises(KvBudgetError, match="use up"):
        budget(LLAMA3_8B, overhead_bytes=8 * GIB)


def test_less_than_one_block_is_an_error() -> None:
    # 1 MiB of room holds 8 tokens at 128 KiB each: not one 16-token block.
    with pytest.raises(KvBudgetError, match="less than one block of 16 tokens"):
        compute_kv_budget(LLAMA3_8B, gpu_memory_bytes=16 * GIB + 2**20, weights_bytes=16 * GIB)


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("num_hidden_layers", "num_hidden_layers"),
        ("num_attention_heads", "num_attention_heads"),
        ("hidden_size", "hidden_size"),
    ],
)
def test_missing_fields_are_named(drop: str, named: str) -> None:
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != drop}
    with pytest.raises(KvBudgetError, match=named):
        kv_layout(cfg)


def test_bad_field_values() -> None:
    with pytest.raises(KvBudgetError, match="num_hidden_layers must be an integer"):
        kv_layout({**LLAMA3_8B, "num_hidden_layers": "32"})
    with pytest.raises(KvBudgetError, match="num_key_value_heads must be positive"):
        kv_layout({**LLAMA3_8B, "num_key_value_heads": 0})
    with pytest.raises(KvBudgetError, match="not a multiple"):
        kv_layout({**LLAMA3_8B, "hidden_size": 4000, "num_attention_heads": 48})
    # 32.0 is an integer written by a float-happy tool.
    assert kv_layout({**LLAMA3_8B, "num_hidden_layers": 32.0}).num_layers == 32


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"gpu_memory_utilization": 0.0}, "utilization"),
        ({"gpu_memory_utilization": 1.5}, "utilization"),
        ({"block_size": 0}, "block size"),
        ({"weights_bytes": -1}, "negative"),
        ({"gpu_memory_bytes": 0}, "more than 0"),
    ],
)
def test_bad_arguments(kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(KvBudgetError, match=pattern):
        budget(LLAMA3_8B, **kw)


# --- loading ------------------------------------------------------------------------


def test_load_from_dir_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_model_config(tmp_path) == LLAMA3_8B
    assert load_model_config(tmp_path / "config.json") == LLAMA3_8B


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(KvBudgetError, match=r"has no config\.json"):
        load_model_config(tmp_path)
    with pytest.raises(KvBudgetError, match="no such file"):
        load_model_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KvBudgetError, match="not valid JSON"):
        load_model_config(bad)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(KvBudgetError, match="expected a JSON object"):
        load_model_config(listed)


def test_to_dict_is_json_ready() -> None:
    data = json.loads(json.dumps(budget(LLAMA3_8B).to_dict()))
    assert data["bytes_per_token"] == 131072
    assert data["kv_tokens"] == 49152
    assert data["num_gpu_blocks"] == 3072
    assert data["layout"]["num_kv_heads"] == 8
