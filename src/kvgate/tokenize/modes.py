"""Which of vLLM's prompt paths a model takes, and the counter that reproduces it.

* ``hf``: the Hugging Face tokenizer and chat template (``PromptCounter``).
* ``mistral``: vLLM's mistral tokenizer mode, ``mistral_common`` (``MistralPromptCounter``).
* ``harmony``: gpt-oss, whose chats vLLM renders with the harmony library whatever the
  tokenizer mode (``HarmonyPromptCounter``; completions and output as ``hf``).
* ``deepseek_v32`` / ``deepseek_v4``: vLLM's modes of those names, DeepSeek's Python prompt
  encoders in place of the chat template, the Hugging Face tokenizer for the rest
  (``DeepseekV32PromptCounter`` / ``DeepseekV4PromptCounter``).

``auto`` decides from the model directory as vLLM does: a ``config.json`` whose
``model_type`` is ``gpt_oss`` is harmony; an architecture (``architectures``, the first
entry vLLM supports) ``DeepseekV32ForCausalLM`` is deepseek_v32, ``DeepseekV4ForCausalLM`` or
``DeepseekV4ForConditionalGeneration`` deepseek_v4 (vLLM sets these before it looks for
Mistral files); a Mistral tokenizer file (``tekken.json`` or
``tokenizer.model.v*``) is the mistral mode when the directory also holds Mistral-format
weights (``consolidated*.safetensors``, vLLM's own condition) or has no ``tokenizer.json``
(a Mistral-format-only directory, which nothing but mistral_common can read); anything
else is ``hf``. A hub snapshot carries no weights: the loader records whether the repo has
them when it fetches the tokenizer files. A model served with an explicit
``--tokenizer-mode`` takes the same setting here.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Literal

from kvgate.tokenize.counter import CountingApi, PromptCounter
from kvgate.tokenize.engine_flags import NO_FLAGS, EngineFlags
from kvgate.tokenize.errors import TokenizerLoadError
from kvgate.tokenize.loader import MISTRAL_WEIGHTS_RECORD

TokenizerMode = Literal["auto", "hf", "mistral", "harmony", "deepseek_v32", "deepseek_v4"]
ResolvedMode = Literal["hf", "mistral", "harmony", "deepseek_v32", "deepseek_v4"]
RESOLVED_MODES: tuple[ResolvedMode, ...] = (
    "hf",
    "mistral",
    "harmony",
    "deepseek_v32",
    "deepseek_v4",
)

MISTRAL_TOKENIZER_PATTERNS = ("tekken.json", "tokenizer.model.v*")
MISTRAL_WEIGHTS_PATTERN = "consolidated*.safetensors"
HARMONY_MODEL_TYPE = "gpt_oss"
# The architectures vLLM's ModelConfig gives a DeepSeek encoder mode under auto.
DEEPSEEK_ARCHITECTURES: dict[str, ResolvedMode] = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV4ForConditionalGeneration": "deepseek_v4",
}
# Architectures whose chats vLLM builds with an encoder kvgate does not reproduce: counting
# them with the chat template would not be the engine's count.
UNCOUNTED_ARCHITECTURES = {"DeepseekV41ForCausalLM": "deepseek_v41"}


def _has(names: list[str], pattern: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for name in names)


def model_type(model_dir: Path) -> str | None:
    """``model_type`` from the directory's config.json, if it has a readable one."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def architectures(model_dir: Path) -> list[str]:
    """``architectures`` from the directory's config.json (empty when it has none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    value = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in value if isinstance(a, str)] if isinstance(value, list) else []


def _encoder_mode(model_dir: Path) -> ResolvedMode | None:
    """The DeepSeek encoder mode vLLM's auto picks from the architecture, if any.

    vLLM resolves the first listed architecture it supports; kvgate does not carry vLLM's
    model registry, so an encoder architecture listed after another one is refused rather
    than guessed (a real config lists one)."""
    listed = architectures(model_dir)
    for position, arch in enumerate(listed):
        if arch not in DEEPSEEK_ARCHITECTURES and arch not in UNCOUNTED_ARCHITECTURES:
            continue
        if position > 0:
            raise TokenizerLoadError(
                str(model_dir),
                f"config.json lists {arch} after {listed[0]}: which one vLLM serves decides "
                "its prompt path; set tokenizer_mode to the --tokenizer-mode vLLM runs with",
            )
        if arch in UNCOUNTED_ARCHITECTURES:
            raise TokenizerLoadError(
                str(model_dir),
                f"vLLM renders {arch} chats with its {UNCOUNTED_ARCHITECTURES[arch]} encoder, "
                "which kvgate does not reproduce",
            )
        return DEEPSEEK_ARCHITECTURES[arch]
    return None


def detect_tokenizer_mode(model_dir: Path) -> ResolvedMode:
    """``auto`` resolved for this directory (see the module docstring)."""
    if model_type(model_dir) == HARMONY_MODEL_TYPE:
        return "harmony"
    encoder = _encoder_mode(model_dir)
    if encoder is not None:
        return encoder
    try:
        names = os.listdir(model_dir)
    except OSError:
        return "hf"
    if any(_has(names, p) for p in MISTRAL_TOKENIZER_PATTERNS) and (
        _has(names, MISTRAL_WEIGHTS_PATTERN)
        or _recorded_weights(model_dir)
        or "tokenizer.json" not in names
    ):
        return "mistral"
    return "hf"


def _recorded_weights(model_dir: Path) -> bool:
    """Whether a fetched hub snapshot's record lists Mistral-format weights."""
    try:
        record = json.loads((model_dir / MISTRAL_WEIGHTS_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and bool(record.get("consolidated_weights"))


def resolve_tokenizer_mode(configured: str, model_dir: Path) -> ResolvedMode:
    """The mode to count in; a setting that cannot match what vLLM does is refused."""
    if configured == "auto":
        return detect_tokenizer_mode(model_dir)
    if configured not in RESOLVED_MODES:
        raise TokenizerLoadError(str(model_dir), f"unknown tokenizer_mode {configured!r}")
    gpt_oss = model_type(model_dir) == HARMONY_MODEL_TYPE
    if gpt_oss and configured != "harmony":
        raise TokenizerLoadError(
            str(model_dir),
            f"tokenizer_mode {configured!r} on a gpt-oss model: vLLM renders its chats with "
            "harmony whatever the tokenizer mode (use harmony or auto)",
        )
    if configured == "harmony" and not gpt_oss and model_type(model_dir) is not None:
        raise TokenizerLoadError(
            str(model_dir),
            "tokenizer_mode harmony on a model whose config.json is not gpt_oss: vLLM "
            "renders its chats with the chat template",
        )
    return configured


def load_counter(
    model_dir: Path | str,
    *,
    name: str = "",
    counting_engine: str = "auto",
    tokenizer_mode: str = "auto",
    harmony_system_instructions: bool = False,
    engine_flags: EngineFlags = NO_FLAGS,
) -> CountingApi:
    """The counter for ``model_dir`` in the mode vLLM serves it in.

    ``harmony_system_instructions``: vLLM runs with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS
    (gpt-oss instructions in the system message). ``engine_flags``: the engine's server
    options that shape chats (its template and content format only reach the chat-template
    path; the Mistral, harmony and DeepSeek renderers take no template)."""
    path = Path(model_dir)
    mode = resolve_tokenizer_mode(tokenizer_mode, path)
    counter: CountingApi
    if mode == "mistral":
        from kvgate.tokenize.mistral import MistralPromptCounter

        counter = MistralPromptCounter.from_model_dir(path, name=name)
    elif mode in ("deepseek_v32", "deepseek_v4"):
        from kvgate.tokenize.deepseek import DeepseekV4PromptCounter, DeepseekV32PromptCounter

        cls = DeepseekV32PromptCounter if mode == "deepseek_v32" else DeepseekV4PromptCounter
        counter = cls.from_model_dir(path, name=name, counting_engine=counting_engine)
    elif mode == "harmony":
        from kvgate.tokenize.harmony import HarmonyPromptCounter

        harmony = HarmonyPromptCounter.from_model_dir(
            path, name=name, counting_engine=counting_engine
        )
        harmony.instructions_in_system = harmony_system_instructions
        counter = harmony
    else:
        return PromptCounter.from_model_dir(
            path, name=name, counting_engine=counting_engine, engine_flags=engine_flags
        )
    counter.engine_flags = engine_flags
    return counter
