"""The embedding model's directory for kvgate: WordLlama's tokenizer, as the simulator's
``--embedding-model wordllama`` encodes its inputs (vllm_sim.embeddings).

``wordllama_model_dir()`` returns ``<repo>/var/models/wordllama-l2-supercat``, built on
first use from the tokenizer file shipped inside the ``wordllama`` wheel (a 32,000-token
Llama-2 vocabulary): its ``tokenizer.json`` is that file, so kvgate's count of an input is
the simulator's, token for token. No chat template: the model serves no chat.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from filelock import FileLock

from testbed.demo_model import REPO_ROOT

WORDLLAMA_MODEL_NAME = "wordllama-l2-supercat"
WORDLLAMA_MODEL_DIR = REPO_ROOT / "var" / "models" / WORDLLAMA_MODEL_NAME
# The simulator's default context for its embedding model (--embedding-max-model-len).
WORDLLAMA_MAX_MODEL_LEN = 8192
_TOKENIZER = Path("tokenizers") / "l2_supercat_tokenizer_config.json"


def _package_tokenizer() -> Path:
    spec = importlib.util.find_spec("wordllama")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedding model needs `pip install wordllama`")
    return Path(spec.origin).parent / _TOKENIZER


def wordllama_model_dir() -> Path:
    """The directory (tokenizer.json, tokenizer_config.json), built if missing."""
    target = WORDLLAMA_MODEL_DIR / "tokenizer.json"
    source = _package_tokenizer()
    if target.is_file() and target.read_bytes() == source.read_bytes():
        return WORDLLAMA_MODEL_DIR
    WORDLLAMA_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(WORDLLAMA_MODEL_DIR.parent / f".{WORDLLAMA_MODEL_NAME}.lock"), timeout=60):
        partial = WORDLLAMA_MODEL_DIR / "tokenizer.json.partial"
        shutil.copyfile(source, partial)
        (WORDLLAMA_MODEL_DIR / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
            encoding="utf-8",
        )
        partial.replace(target)
    return WORDLLAMA_MODEL_DIR
