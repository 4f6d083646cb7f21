"""Finding a model's tokenizer files: a local model directory or a Hugging Face repo id.

Production points kvgate at the directory vLLM serves from, or at a hub id that is
fetched once at start-up (tokenizer files only, never weights). Tests never download.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path

from kvgate.tokenize.errors import TokenizerLoadError

REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
# A Mistral-format directory holds one of these instead (mistral_common reads it).
MISTRAL_TOKENIZER_FILES = ("tekken.json", "tokenizer.model.v*")
# Tokenizer files plus the optional template files transformers also reads, the Mistral
# tokenizer files and params.json, and the tiny model config.json that the KV calculator
# needs for the layer/head shape (and that names a gpt-oss model).
ALLOW_PATTERNS = [
    *REQUIRED_FILES,
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "config.json",
    *MISTRAL_TOKENIZER_FILES,
    "params.json",
]
_TRUTHY = {"1", "on", "yes", "true"}
# Written into a fetched snapshot: the repo's Mistral-format weight files (never fetched).
MISTRAL_WEIGHTS_RECORD = "kvgate_mistral_weights.json"
log = logging.getLogger("kvgate.tokenize")


def _missing(path: Path) -> list[str]:
    if any(any(path.glob(pattern)) for pattern in MISTRAL_TOKENIZER_FILES):
        return []
    return [name for name in REQUIRED_FILES if not (path / name).is_file()]


def _looks_like_path(source: str) -> bool:
    # Repo ids are "name" or "owner/name"; anything else is meant as a path.
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def resolve_tokenizer_dir(source: str, cache_dir: Path) -> Path:
    """Return a directory holding ``tokenizer.json`` and ``tokenizer_config.json``, or a
    Mistral tokenizer file (``tekken.json``, ``tokenizer.model.v*``).

    ``source`` is an existing local model directory, or a repo id such as
    ``Qwen/Qwen2.5-7B-Instruct`` whose tokenizer files are fetched into ``cache_dir``
    (or reused from it). Any failure raises ``TokenizerLoadError`` naming the source.
    """
    if not source or not isinstance(source, str):
        raise TokenizerLoadError(str(source), "empty tokenizer source")

    local = Path(source).expanduser()
    if local.is_dir():
        missing = _missing(local)
        if missing:
            raise TokenizerLoadError(
                source,
                f"the directory has no {', '.join(missing)} (a fast tokenizer is needed) "
                "and no Mistral tokenizer file (tekken.json, tokenizer.model.v*)",
            )
        return local.resolve()
    if local.exists() or _looks_like_path(source):
        raise TokenizerLoadError(source, "no such model directory")

    return _fetch_from_hub(source, cache_dir)


def _fetch_from_hub(repo_id: str, cache_dir: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise TokenizerLoadError(repo_id, "huggingface_hub is not installed") from exc

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it now so that
    # offline mode set later (tests, start-up scripts) is still honoured.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY
    try:
        snapshot = snapshot_download(
            repo_id=repo_id,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=cache_dir,
            local_files_only=offline,
        )
    except Exception as exc:  # the hub raises many types: network, auth, validation
        hint = " (HF_HUB_OFFLINE is set and it is not in the cache)" if offline else ""
        raise TokenizerLoadError(
            repo_id, f"could not fetch it from the Hugging Face hub{hint}: {exc}"
        ) from exc

    path = Path(str(snapshot))
    missing = _missing(path)
    if missing:
        raise TokenizerLoadError(
            repo_id, f"the repo has no {', '.join(missing)} (a fast tokenizer is needed)"
        )
    if not offline:
        _record_mistral_weights(repo_id, path)
    return path


def _record_mistral_weights(repo_id: str, snapshot: Path) -> None:
    """Note beside the snapshot whether the repo holds Mistral-format weights.

    vLLM serves a repo with a Mistral tokenizer file in its mistral mode only when the repo
    also has ``consolidated*.safetensors``; the weights are never fetched, so the answer is
    kept in ``MISTRAL_WEIGHTS_RECORD`` for the mode choice (and for offline restarts).
    """
    if not any(any(snapshot.glob(pattern)) for pattern in MISTRAL_TOKENIZER_FILES):
        return
    record = snapshot / MISTRAL_WEIGHTS_RECORD
    if record.exists():
        return
    try:
        from huggingface_hub import list_repo_files

        names = list_repo_files(repo_id, revision=snapshot.name)
    except Exception as exc:  # the hub raises many types; the mode then follows local files
        log.warning(
            "could not list the repo's files to tell its tokenizer mode",
            extra={"repo": repo_id, "error": str(exc)},
        )
        return
    weights = sorted(n for n in names if fnmatch.fnmatch(n, "consolidated*.safetensors"))
    record.write_text(json.dumps({"consolidated_weights": weights}), encoding="utf-8")
