"""Usage extraction from non-streaming response bodies."""

from __future__ import annotations

import json

import pytest

from kvgate.openai import Usage, usage_from_json_body, usage_from_mapping

# A non-streaming chat response as vLLM's OpenAI server serialises it (field order
# and nulls included).
VLLM_CHAT_BODY = (
    b'{"id":"chatcmpl-8f0c","object":"chat.completion","created":1732900000,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","reasoning_content":null,'
    b'"content":"Hello! How can I help?","tool_calls":[]},"logprobs":null,'
    b'"finish_reason":"stop","stop_reason":null}],'
    b'"usage":{"prompt_tokens":21,"total_tokens":28,"completion_tokens":7,'
    b'"prompt_tokens_details":null},"prompt_logprobs":null,"kv_transfer_params":null}'
)

VLLM_COMPLETION_BODY = (
    b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null,"prompt_logprobs":null}],'
    b'"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":2}},"kv_transfer_params":null}'
)

# OpenAI puts fields after usage, pretty-printed with spaces.
OPENAI_BODY = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
        "usage": {
            "prompt_tokens": 19,
            "completion_tokens": 10,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 16, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_1",
    },
    indent=2,
).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (VLLM_CHAT_BODY, Usage(21, 7, 0)),
        (VLLM_COMPLETION_BODY, Usage(3, 2, 2)),
        (OPENAI_BODY, Usage(19, 10, 16)),
    ],
)
def test_usage_from_body(body: bytes, expected: Usage) -> None:
    assert usage_from_json_body(body) == expected
    # Same answer as a plain full parse (the fast path must not change results).
    assert usage_from_mapping(json.loads(body)["usage"]) == expected


def test_total_tokens() -> None:
    assert Usage(3, 4).total_tokens == 7


def test_usage_text_inside_content_is_not_mistaken_for_usage() -> None:
    # The content talks about usage (escaped quotes) and is placed after the real
    # usage object to defeat a naive "last occurrence" search.
    body = json.dumps(
        {
            "usage": {"prompt_tokens": 5, "completion_tokens": 1},
            "choices": [
                {"message": {"content": 'fake "usage": {"prompt_tokens": 999} and "usage"'}}
            ],
        }
    ).encode()
    assert usage_from_json_body(body) == Usage(5, 1)


def test_key_named_usage_in_logprobs_is_skipped() -> None:
    # Legacy completions logprobs map token strings to numbers: a token "usage" is a key.
    body = json.dumps(
        {
            "choices": [{"text": "x", "logprobs": {"top_logprobs": [{"usage": -0.1}]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1},
            "extra": [{"usage": -0.5}, {'"usage': -0.2}],
        }
    ).encode()
    assert usage_from_json_body(body) == Usage(2, 1)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1,2]",
        b'{"error":{"message":"x","type":"BadRequestError","param":null,"code":400}}',
        b'{"object":"error","message":"x","type":"BadRequestError","param":null,"code":400}',
        b'{"id":"x","usage":null}',
        b'{"usage":{"prompt_tokens":"3","completion_tokens":1}}',
        b'{"usage":{"prompt_tokens":true,"completion_tokens":1}}',
        b'{"usage":{"prompt_tokens":-1,"completion_tokens":1}}',
        b'{"usage":{"completion_tokens":1}}',
        b'{"usage":{"prompt_tokens":1,"completion_tokens":1.5}}',
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1',  # truncated
        b"\xff\xfe",
    ],
)
def test_no_usage(body: bytes) -> None:
    assert usage_from_json_body(body) is None


def test_lenient_fields() -> None:
    # completion_tokens may be null/absent (vLLM's UsageInfo allows it); malformed
    # cached_tokens are ignored rather than discarding the whole usage.
    assert usage_from_mapping({"prompt_tokens": 4}) == Usage(4, 0)
    assert usage_from_mapping({"prompt_tokens": 4, "completion_tokens": None}) == Usage(4, 0)
    assert usage_from_mapping(
        {
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": "x"},
        }
    ) == Usage(4, 1, 0)
    assert usage_from_mapping(None) is None
    assert usage_from_mapping([1]) is None
