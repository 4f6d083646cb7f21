"""A reranker for the tests: the demo model's Qwen2 vocabulary with a Qwen3-Reranker-style
score template, as vLLM 0.34 serves a Qwen3 reranker (``--chat-template`` with the template
of its ``examples/pooling/score/template/qwen3_reranker.jinja``: the pair rendered as the
messages ``query`` and ``document`` inside the reranker's yes/no judging prompt).

No BERT-style WordPiece vocabulary is shipped by a PyPI package reachable here (the
tokenizer packages checked ship code, not vocabularies), so the reranker is the Qwen one:
kvgate counts its score prompts with the same template (its model's
``engine_flags.chat_template``) and tokenizer the simulator renders them with
(``--score-template``). The template is written at test time beside the demo model.
"""

from __future__ import annotations

from pathlib import Path

from testbed.demo_model import REPO_ROOT, demo_model_dir

RERANKER_MODEL_NAME = "qwen3-reranker-demo"
RERANKER_TEMPLATE = REPO_ROOT / "var" / "models" / "qwen3-reranker-score-template.jinja"

# Qwen3-Reranker's prompt: a system line, then the instruction, query and document in the
# user turn, then an assistant turn with an empty think block (the model answers yes/no).
TEMPLATE = (
    "<|im_start|>system\n"
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
    "<Instruct>: {{ instruction | default('Given a web search query, retrieve relevant "
    "passages that answer the query') }}\n"
    "<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}"
    "<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def reranker_template() -> Path:
    """The score template's file, written if missing or stale."""
    if not RERANKER_TEMPLATE.is_file() or RERANKER_TEMPLATE.read_text() != TEMPLATE:
        RERANKER_TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
        partial = RERANKER_TEMPLATE.with_suffix(f".{id(TEMPLATE)}.partial")
        partial.write_text(TEMPLATE, encoding="utf-8")
        partial.replace(RERANKER_TEMPLATE)
    return RERANKER_TEMPLATE


def reranker_model_dir() -> Path:
    """The tokenizer directory (the demo model's)."""
    return demo_model_dir()
