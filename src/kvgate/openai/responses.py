"""Token usage reported by the engine in OpenAI-style responses.

vLLM (like OpenAI) reports ``usage`` in the final JSON of a non-streaming
response and, when ``stream_options.include_usage`` is set, in a last
``"choices": []`` event of a stream (see :mod:`kvgate.openai.sse`). Settlement
prefers these engine-counted numbers over kvgate's own estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Usage", "usage_from_json_body", "usage_from_mapping"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Engine-reported token counts for one request (all sequences together)."""

    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens served from the prefix cache (``prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _count(value: object) -> int | None:
    # bool is an int subclass: true/false are not token counts.
    if type(value) is int and value >= 0:
        return value
    return None


def usage_from_mapping(usage: Any) -> Usage | None:
    """Build :class:`Usage` from a decoded ``usage`` object, or None if it is not one.

    ``prompt_tokens`` is required; ``completion_tokens`` may be missing or null
    (vLLM's UsageInfo allows it) and then counts as 0; ``cached_tokens`` comes from
    ``prompt_tokens_details`` when present and well-formed.
    """
    if type(usage) is not dict:
        return None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None:
        return None
    raw_completion = usage.get("completion_tokens")
    if raw_completion is None:
        completion = 0
    else:
        completion = _count(raw_completion)
        if completion is None:
            return None
    cached = 0
    details = usage.get("prompt_tokens_details")
    if type(details) is dict:
        cached = _count(details.get("cached_tokens")) or 0
    return Usage(prompt, completion, cached)


_USAGE_KEY: Final = b'"usage"'
_WS: Final = b" \t\r\n"
# Give up on the fast path after this many candidate keys and parse everything.
_FAST_PATH_TRIES: Final = 4
_RAW_DECODER: Final = json.JSONDecoder()


def _usage_fast(body: bytes) -> Usage | None:
    """Find the top-level usage object without decoding the whole body.

    OpenAI and vLLM serialise ``usage`` after ``choices``, so the last
    ``"usage"`` key is the top-level one, and only a handful of bytes follow it.
    Only a JSON *key* named usage can match ``"usage"`` + ``:`` (a string value is
    followed by , ] or }, and quotes inside strings are escaped); the candidate
    must also decode to a well-formed usage object. Anything else: None, and the
    caller falls back to a full parse.
    """
    end = len(body)
    for _ in range(_FAST_PATH_TRIES):
        idx = body.rfind(_USAGE_KEY, 0, end)
        if idx < 0:
            return None
        end = idx
        j = idx + len(_USAGE_KEY)
        while j < len(body) and body[j] in _WS:
            j += 1
        if j >= len(body) or body[j] != 0x3A:  # ':'
            continue
        j += 1
        while j < len(body) and body[j] in _WS:
            j += 1
        if j >= len(body) or body[j] != 0x7B:  # '{'
            continue
        try:
            # raw_decode stops after the object: the rest of the body is ignored.
            obj, _ = _RAW_DECODER.raw_decode(body[j:].decode("utf-8"))
        except (ValueError, RecursionError):
            continue
        usage = usage_from_mapping(obj)
        if usage is not None:
            return usage
    return None


def usage_from_json_body(body: bytes) -> Usage | None:
    """Usage from a non-streaming chat/completions response body, or None.

    None when the body is not JSON, is an error body, or has no (valid) usage.
    """
    if not body:
        return None
    usage = _usage_fast(body)
    if usage is not None:
        return usage
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    return usage_from_mapping(obj.get("usage"))
