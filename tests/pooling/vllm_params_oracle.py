"""vLLM 0.34's ``TokenizeParams`` (``vllm/renderers/params.py``), run from the wheel's source
as an oracle of what the engine does with a pooling prompt's length: truncation
(``truncate_prompt_tokens``, ``-1`` = the context, the tokenizer's side), the refusal of a
truncation over the context, and the length check against the whole context (a pooling
request reserves no output: ``max_output_tokens=0``).

The module is loaded as it is; what it imports from the rest of vLLM is stubbed (the error
type, prompt dicts, a logger, two helpers it does not call here). No engine, no torch.
"""

from __future__ import annotations

import sys
import types
import zipfile
from typing import Any

from testbed.engine_models import vllm_wheel
from tests.vllm_source import SilentLogger

_PARAMS = "vllm/renderers/params.py"


class VLLMValidationError(ValueError):
    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def load_tokenize_params() -> Any:
    """vLLM's ``TokenizeParams`` class, or None without the wheel."""
    wheel = vllm_wheel()
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(_PARAMS).decode("utf-8")
    stubs = {
        "vllm": _module("vllm"),
        "vllm.exceptions": _module("vllm.exceptions", VLLMValidationError=VLLMValidationError),
        "vllm.inputs": _module(
            "vllm.inputs", EmbedsPrompt=dict, TextPrompt=dict, TokensPrompt=dict
        ),
        "vllm.logger": _module("vllm.logger", init_logger=lambda name: SilentLogger()),
        "vllm.multimodal": _module("vllm.multimodal"),
        "vllm.multimodal.media": _module("vllm.multimodal.media"),
        "vllm.multimodal.media.connector": _module(
            "vllm.multimodal.media.connector", merge_media_io_kwargs=lambda *a, **k: {}
        ),
        "vllm.tokenizers": _module("vllm.tokenizers", TokenizerLike=Any),
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.import_utils": _module(
            "vllm.utils.import_utils", LazyLoader=lambda *args, **kwargs: None
        ),
    }
    module = _module("vllm_reference_renderers_params")
    # dataclasses resolves the module's annotations through sys.modules.
    stubs[module.__name__] = module
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        exec(compile(source, _PARAMS, "exec"), module.__dict__)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module.TokenizeParams


class Tokenizer:
    """What TokenizeParams reads of a tokenizer: its truncation side (HF's default)."""

    truncation_side = "right"
    max_chars_per_token = 16


def engine_prompt_length(
    params_class: Any, length: int, max_model_len: int, truncate: int | None
) -> int | str:
    """The prompt's length after vLLM's pooling checks (token ids of ``length``), or the
    refused parameter's name."""
    try:
        params = params_class(
            max_total_tokens=max_model_len,
            max_output_tokens=0,
            truncate_prompt_tokens=truncate,
            add_special_tokens=True,
        )
        prompt = params.apply_post_tokenization(Tokenizer(), {"prompt_token_ids": [5] * length})
    except VLLMValidationError as error:
        return error.parameter or "?"
    return len(prompt["prompt_token_ids"])
