"""How many tokens of KV cache a vLLM server gets, from the model's ``config.json``.

Two steps, both pure:

1. :func:`kv_layout` reads the Hugging Face config and works out the KV-cache bytes one
   token costs, for the whole model and per GPU under tensor parallelism.
2. :func:`compute_kv_budget` subtracts weights and overhead from the usable GPU memory
   and divides what is left by that per-token cost, the way vLLM sizes its cache.

Standard attention (MHA, GQA, MQA) stores a K and a V vector per KV head per layer::

    bytes/token = 2 * layers * kv_heads * head_dim * dtype_bytes

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) stores one compressed latent per
layer instead, shared by every head, with no separate V::

    bytes/token = layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes

That is how vLLM sizes it: with MLA on, ``ModelConfig.get_head_size()`` is
``kv_lora_rank + qk_rope_head_dim``, ``get_num_kv_heads()`` is 1 whatever the tensor
parallel size, and ``MLAAttentionSpec.real_page_size_bytes`` is
``block_size * num_kv_heads * head_size * dtype_size`` (no factor of 2). So the latent is
replicated on every TP rank rather than split.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvgate.capacity.units import format_bytes

DEFAULT_BLOCK_SIZE = 16

# Canonical dtype name -> bytes per element. Aliases map onto these names.
_DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
# Why 2 bytes as the fallback: nearly every checkpoint vLLM serves is bf16 or fp16.
_DEFAULT_MODEL_DTYPE = "bfloat16"

# Field names vLLM also accepts for the same quantity, first match wins.
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_FIELDS = ("num_attention_heads", "n_head")
_KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
# Multimodal wrappers keep the language model's config under one of these keys.
_NESTED_TEXT_FIELDS = ("text_config", "llm_config", "language_config")


class KvBudgetError(ValueError):
    """The config cannot be sized, or the memory figures leave nothing for KV."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What one token costs in KV cache, for one model and one KV dtype."""

    model_type: str | None
    attention: Literal["standard", "mla"]
    num_layers: int
    # Total KV heads (1 for MLA: one latent shared by every head).
    num_kv_heads: int
    kv_heads_per_gpu: int
    # Width of one cached vector: head_dim, or kv_lora_rank + qk_rope_head_dim for MLA.
    head_dim: int
    kv_dtype: str
    dtype_bytes: int
    tp: int
    # The model's own figure (each head counted once) ...
    bytes_per_token: int
    # ... and what one GPU holds, replicated heads included.
    bytes_per_token_per_gpu: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KvBudget:
    """The KV cache one vLLM server (one TP group) gets; memory figures are per GPU."""

    layout: KvLayout
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    overhead_bytes: int
    block_size: int
    usable_bytes: int
    kv_memory_bytes: int
    # Tokens of context the cache holds, summed over all running sequences.
    kv_tokens: int
    num_gpu_blocks: int
    kv_tokens_block_aligned: int
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"]["notes"] = list(self.layout.notes)
        out["notes"] = list(self.notes)
        out["bytes_per_token"] = self.layout.bytes_per_token
        out["bytes_per_token_per_gpu"] = self.layout.bytes_per_token_per_gpu
        return out


def load_model_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` from a model directory, or the file itself."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        raw = file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        where = f"{p} has no config.json" if p.is_dir() else f"{file}: no such file"
        raise KvBudgetError(where) from exc
    except OSError as exc:
        raise KvBudgetError(f"{file}: {exc}") from exc
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KvBudgetError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise KvBudgetError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a (possibly multimodal) config.

    Llama-4, Gemma-3, Qwen-VL and friends nest the decoder under ``text_config``; the
    KV cache belongs to that decoder (vLLM sizes it from ``hf_text_config`` too).
    """
    for key in _NESTED_TEXT_FIELDS:
        nested = config.get(key)
        if isinstance(nested, Mapping):
            return nested
    return config


def resolve_kv_dtype(kv_dtype: str, config: Mapping[str, Any]) -> tuple[str, int, str | None]:
    """(canonical name, bytes per element, note) for a ``--kv-cache-dtype`` value."""
    name = kv_dtype.strip().lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name in _DTYPE_BYTES:
        return name, _DTYPE_BYTES[name], None
    if name != "auto":
        known = sorted({*_DTYPE_BYTES, *_DTYPE_ALIASES, "auto"})
        raise KvBudgetError(f"unknown KV dtype {kv_dtype!r}; expected one of {', '.join(known)}")
    # "auto" means the dtype the model is served in. Newer transformers write "dtype",
    # older "torch_dtype"; a multimodal config may carry it only at the top level.
    text = text_config(config)
    raw = None
    for source in (text, config):
        raw = source.get("torch_dtype") or source.get("dtype")
        if raw:
            break
    if not isinstance(raw, str):
        return _DEFAULT_MODEL_DTYPE, 2, "auto: config names no torch_dtype; assumed bfloat16"
    model_dtype = raw.strip().lower().removeprefix("torch.")
    model_dtype = _DTYPE_ALIASES.get(model_dtype, model_dtype)
    if model_dtype == "float32":
        # vLLM's --dtype auto serves FP32 checkpoints in FP16, so the cache is 2 bytes.
        return "float16", 2, "auto: float32 checkpoint is served as float16 by vLLM"
    if model_dtype in ("bfloat16", "float16"):
        return model_dtype, 2, None
    return _DEFAULT_MODEL_DTYPE, 2, f"auto: unrecognised torch_dtype {raw!r}; assumed 2 bytes"


def kv_layout(config: Mapping[str, Any], *, kv_dtype: str = "auto", tp: int = 1) -> KvLayout:
    """The KV bytes per token of the model described by a ``config.json`` dict."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise KvBudgetError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    text = text_config(config)
    dtype_name, dtype_bytes, dtype_note = resolve_kv_dtype(kv_dtype, config)
    notes: list[str] = [dtype_note] if dtype_note else []
    num_layers = _int_field(text, _LAYER_FIELDS)
    model_type = text.get("model_type") or config.get("model_type")

    if text.get("kv_lora_rank") is not None:
        latent = _int_field(text, ("kv_lora_rank",)) + _int_field(
            text, ("qk_rope_head_dim",), allow_zero=True
        )
        per_token = num_layers * latent * dtype_bytes
        if tp > 1:
            notes.append("MLA: the latent is replicated on every TP rank, not split")
        notes.extend(_window_notes(text, num_layers))
        return KvLayout(
            model_type=model_type,
            attention="mla",
            num_layers=num_layers,
            num_kv_heads=1,
            kv_heads_per_gpu=1,
            head_dim=latent,
            kv_dtype=dtype_name,
            dtype_bytes=dtype_bytes,
            tp=tp,
            bytes_per_token=per_token,
            bytes_per_token_per_gpu=per_token,
            notes=tuple(notes),
        )

    num_heads = _int_field(text, _HEAD_FIELDS)
    if text.get("multi_query") is True and not text.get("new_decoder_architecture"):
        # Falcon-7B / GPTBigCode style MQA: one KV head whatever the other fields say.
        num_kv_heads = 1
    elif any(text.get(f) is not None for f in _KV_HEAD_FIELDS):
        num_kv_heads = _int_field(text, _KV_HEAD_FIELDS)
    else:
        num_kv_heads = num_heads  # plain MHA
    head_dim = _head_dim(text, num_heads)
    # Why ceil: heads split evenly across ranks, and when there are fewer KV heads
    # than ranks vLLM replicates them so every GPU still holds one.
    kv_heads_per_gpu = math.ceil(num_kv_heads / tp)
    if tp > 1 and num_kv_heads < tp:
        notes.append(f"{num_kv_heads} KV head(s) < tp={tp}: replicated, one per GPU")
    notes.extend(_window_notes(text, num_layers))
    return KvLayout(
        model_type=model_type,
        attention="standard",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        kv_heads_per_gpu=kv_heads_per_gpu,
        head_dim=head_dim,
        kv_dtype=dtype_name,
        dtype_bytes=dtype_bytes,
        tp=tp,
        bytes_per_token=2 * num_layers * num_kv_heads * head_dim * dtype_bytes,
        bytes_per_token_per_gpu=2 * num_layers * kv_heads_per_gpu * head_dim * dtype_bytes,
        notes=tuple(notes),
    )


def compute_kv_budget(
    config: Mapping[str, Any],
    *,
    gpu_memory_bytes: int,
    weights_bytes: int,
    overhead_bytes: int = 0,
    gpu_memory_utilization: float = 1.0,
    kv_dtype: str = "auto",
    tp: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> KvBudget:
    """The KV token budget of one vLLM server; every memory figure is per GPU.

    ``kv_tokens = floor((gpu_memory * utilization - weights - overhead) / bytes_per_token)``
    with the per-GPU bytes per token. vLLM hands the cache out in whole blocks, so
    ``num_gpu_blocks = kv_tokens // block_size`` is what it will report.
    """
    for name, value in (
        ("gpu memory", gpu_memory_bytes),
        ("weights", weights_bytes),
        ("overhead", overhead_bytes),
    ):
        if value < 0:
            raise KvBudgetError(f"{name} cannot be negative ({value})")
    if gpu_memory_bytes == 0:
        raise KvBudgetError("gpu memory must be more than 0 bytes")
    if not 0 < gpu_memory_utilization <= 1:
        raise KvBudgetError(
            f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise KvBudgetError(f"block size must be a positive integer, got {block_size!r}")

    layout = kv_layout(config, kv_dtype=kv_dtype, tp=tp)
    usable = math.floor(gpu_memory_bytes * gpu_memory_utilization)
    kv_memory = usable - weights_bytes - overhead_bytes
    if kv_memory <= 0:
        taken = weights_bytes + overhead_bytes
        verb = "exceed" if kv_memory < 0 else "use up"
        per_gpu = f" (per GPU, tp={tp})" if tp > 1 else ""
        raise KvBudgetError(
            f"no GPU memory left for the KV cache: weights {format_bytes(weights_bytes)} + "
            f"overhead {format_bytes(overhead_bytes)} = {format_bytes(taken)} {verb} "
            f"{format_bytes(gpu_memory_bytes)} x {gpu_memory_utilization:g} = "
            f"{format_bytes(usable)} usable{per_gpu}"
        )
    per_token = layout.bytes_per_token_per_gpu
    kv_tokens = kv_memory // per_token
    num_blocks = kv_tokens // block_size
    if num_blocks == 0:
        raise KvBudgetError(
            f"only {format_bytes(kv_memory)} left for the KV cache, less than one block of "
            f"{block_size} tokens ({format_bytes(per_token * block_size)}); vLLM would not start"
        )
    return KvBudget(
        layout=layout,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        overhead_bytes=overhead_bytes,
        block_size=block_size,
        usable_bytes=usable,
        kv_memory_bytes=kv_memory,
        kv_tokens=kv_tokens,
        num_gpu_blocks=num_blocks,
        kv_tokens_block_aligned=num_blocks * block_size,
        notes=layout.notes,
    )


# --- helpers -----------------------------------------------------------------------


def _int_field(
    config: Mapping[str, Any], names: tuple[str, ...], *, allow_zero: bool = False
) -> int:
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            # JSON writes some integers as 32.0; accept those, refuse real fractions.
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise KvBudgetError(f"config field {name} must be an integer, got {value!r}")
        if value < 0 or (value == 0 and not allow_zero):
            raise KvBudgetError(f"config field {name} must be positive, got {value}")
        return value
    also = f" (nor {', '.join(names[1:])})" if len(names) > 1 else ""
    raise KvBudgetError(f"model config has no {names[0]}{also}")


def _head_dim(config: Mapping[str, Any], num_heads: int) -> int:
    # Some configs carry "head_dim": null; that means "derive it", as in vLLM.
    if config.get("head_dim") is not None:
        return _int_field(config, ("head_dim",))
    try:
        hidden = _int_field(config, _HIDDEN_FIELDS)
    except KvBudgetError as exc:
        raise KvBudgetError(f"{exc}, and no head_dim to use instead") from None
    if hidden % num_heads:
        raise KvBudgetError(
            f"hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}; "
            "the config needs an explicit head_dim"
        )
    return hidden // num_heads


def _window_notes(config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Say so when the model is not all full attention: we size it as if it were."""
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        other = [t for t in layer_types if t != "full_attention"]
        if other:
            kinds = ", ".join(sorted(set(map(str, other))))
            return [
                f"{len(other)} of {len(layer_types)} layers are {kinds}; all counted as "
                "full attention (worst case: vLLM's hybrid allocator may fit more tokens)"
            ]
        return []
    for key in ("layers_block_type", "attn_type_list"):
        if config.get(key):
            return [
                f"hybrid model ({key} in config); all {num_layers} layers counted as "
                "attention layers (worst case)"
            ]
    window = config.get("sliding_window")
    if isinstance(window, int) and window > 0 and config.get("use_sliding_window", True):
        return [
            f"sliding-window attention (window {window}); counted as full attention: the "
            "cache holds this many tokens, but a long sequence may occupy fewer of them"
        ]
    return []
