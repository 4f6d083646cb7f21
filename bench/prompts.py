"""Request bodies of a given prompt size, as templates for the load generators.

A prompt is plain English made of words that are single tokens in the demo vocabulary (so
N words ~ N tokens), after a fixed-width marker that each request replaces with a unique id:
no two requests share a prompt, so no tokenizer cache (kvgate's or anyone's) hides the cost
of counting. The real prompt size (chat template included) is measured once against the
simulator and reported.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.loadgen import MARKER
from vllm_sim.tokenization import SINGLE_TOKEN_WORDS as SIMULATOR_WORDS

# The simulator's own single-token words: prompts built from them have known token counts.
_WORDS = SIMULATOR_WORDS
# Chat template + role markers + the request id marker, in tokens (measured: 1,000 words
# come to 1,028 prompt tokens).
_OVERHEAD_TOKENS = 28


def prompt_text(tokens: int) -> str:
    words = max(1, tokens - _OVERHEAD_TOKENS)
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def body_template(model: str, tokens: int, *, max_tokens: int, stream: bool = False) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": f"{MARKER.decode()} {prompt_text(tokens)}"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def write_template(
    directory: Path, model: str, tokens: int, *, max_tokens: int, stream: bool = False
) -> Path:
    name = f"body-{tokens}{'-stream' if stream else ''}-{max_tokens}.json"
    path = directory / name
    path.write_bytes(body_template(model, tokens, max_tokens=max_tokens, stream=stream))
    return path


def sample_body(path: Path) -> dict[str, object]:
    """One concrete request from a template (for checks outside the generator)."""
    raw = path.read_bytes().replace(MARKER, b"0" * len(MARKER))
    body: dict[str, object] = json.loads(raw)
    return body
