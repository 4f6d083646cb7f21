"""What several end-to-end modules share: a chat prompt of an exact length in tokens, and the
check that an answer is an OpenAI-shaped error."""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.tokenize import PromptCounter

ERROR_KEYS = {"message", "type", "param", "code"}


# Words the demo (Qwen2) vocabulary holds as single tokens with their leading space, so a
# document's length in tokens can be set exactly by adding or removing words.
_TEXT = (
    "the river runs past the old mill where people walk in the evening and talk about "
    "the weather the market the harvest and the long road to town"
)
_WORDS = _TEXT.split()


def user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def document_messages(counter: PromptCounter, prompt_tokens: int, tag: str) -> list[dict[str, Any]]:
    """A one-message chat whose prompt (chat template included) is exactly
    `prompt_tokens` tokens by kvgate's count."""
    header = f"Document {tag}. Summarise the following text.\n"
    n_words = max(1, prompt_tokens - 30)
    for _ in range(20):
        text = header + " ".join(_WORDS[i % len(_WORDS)] for i in range(n_words))
        messages = user(text)
        got = counter.count_chat(messages)
        if got == prompt_tokens:
            return messages
        n_words += prompt_tokens - got
    raise AssertionError(f"could not build a {prompt_tokens}-token prompt (last {got})")


def assert_openai_error(
    resp: httpx.Response, status: int, *, code: str | None, type_: str = "invalid_request_error"
) -> dict[str, Any]:
    """The response is an OpenAI-shaped error; returns its `error` object."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == type_, error
    assert error["code"] == code, error
    return error
