"""vLLM's request checks a gateway relies on: min_tokens vs max_tokens, prompt_embeds,
context overflow, and generating to the end of the context without max_tokens."""

from __future__ import annotations

import base64
import json

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, split_sse, stats
from vllm_sim.tokenization import SimTokenizer


def _error(message: str, err_type: str = "BadRequestError") -> dict[str, object]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": 400}}


# --- min_tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_min_tokens_above_max_tokens(client: TestClient, path: str) -> None:
    body = chat_body() if path == CHAT else {"model": MODEL, "prompt": "hi"}
    resp = await client.post(path, json={**body, "max_tokens": 5, "min_tokens": 6})
    assert resp.status == 400
    assert await resp.json() == _error(
        "min_tokens must be less than or equal to max_tokens=5, got 6."
    )
    # Equal is fine, and generation honours it.
    resp = await client.post(path, json={**body, "max_tokens": 5, "min_tokens": 5})
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 5
    assert (await stats(client))["requests_total"] == 1


async def test_min_tokens_against_the_computed_cap(make_client: MakeClient) -> None:
    """vLLM compares min_tokens with min(max_tokens, context - prompt): without
    max_tokens a min_tokens past the context is refused too."""
    client = await make_client(max_model_len=64)
    resp = await client.post(CHAT, json=chat_body(min_tokens=100))
    assert resp.status == 400
    message = (await resp.json())["error"]["message"]
    assert message.startswith("min_tokens must be less than or equal to max_tokens=")
    cap = int(message.split("max_tokens=")[1].split(",")[0])
    assert 0 < cap < 64
    assert message.endswith(", got 100.")
    # max_completion_tokens wins over max_tokens in chat, here as in the cap.
    resp = await client.post(
        CHAT, json=chat_body(max_tokens=50, max_completion_tokens=3, min_tokens=4)
    )
    assert (await resp.json())["error"]["message"] == (
        "min_tokens must be less than or equal to max_tokens=3, got 4."
    )


async def test_negative_min_tokens(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(min_tokens=-1))
    assert resp.status == 400
    assert await resp.json() == _error("min_tokens must be greater than or equal to 0, got -1.")


async def test_context_errors_come_before_min_tokens(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    resp = await client.post(CHAT, json=chat_body(max_tokens=100, min_tokens=200))
    assert resp.status == 400
    assert (await resp.json())["error"]["message"].startswith(
        "'max_tokens' or 'max_completion_tokens' is too large: 100."
    )


async def test_context_overflow_on_each_completion_prompt(make_client: MakeClient) -> None:
    client = await make_client(max_model_len=64)
    resp = await client.post(COMPLETIONS, json={"prompt": ["hi", "word " * 100], "max_tokens": 1})
    assert resp.status == 400
    assert (
        "This model's maximum context length is 64 tokens."
        in (await resp.json())["error"]["message"]
    )
    assert (await stats(client))["requests_total"] == 0


# --- prompt_embeds -----------------------------------------------------------------------

EMBEDS = base64.b64encode(b"\x00" * 32).decode()
DISABLED = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."


async def test_prompt_embeds_refused_as_without_the_flag(client: TestClient) -> None:
    for body in (
        {"model": MODEL, "prompt_embeds": EMBEDS},
        {"model": MODEL, "prompt_embeds": [EMBEDS, EMBEDS], "max_tokens": 3},
        {"model": MODEL, "prompt": "hi", "prompt_embeds": EMBEDS},
    ):
        resp = await client.post(COMPLETIONS, json=body)
        assert resp.status == 400, body
        assert await resp.text() == (
            '{"error":{"message":"You must set `--enable-prompt-embeds` to input '
            '`prompt_embeds`.","type":"BadRequestError","param":null,"code":400}}'
        )
    assert (await stats(client))["requests_total"] == 0


async def test_prompt_embeds_streamed_is_an_sse_error(client: TestClient) -> None:
    """The engine refuses it after the stream answered 200: vLLM's streaming
    error event (json.dumps' default separators), then [DONE]."""
    resp = await client.post(
        COMPLETIONS, json={"model": MODEL, "prompt_embeds": EMBEDS, "stream": True}
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    raw = await resp.read()
    assert split_sse(raw) == [
        b"data: " + json.dumps(_error(DISABLED)).encode(),
        b"data: [DONE]",
    ]
    assert b'{"error": {"message": ' in raw


async def test_prompt_embeds_early_checks(client: TestClient) -> None:
    resp = await client.post(COMPLETIONS, json={"prompt_embeds": EMBEDS, "echo": True})
    assert await resp.json() == _error("Echo is unsupported with prompt embeds.")
    resp = await client.post(COMPLETIONS, json={"prompt_embeds": "not base64!"})
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "BadRequestError"
    resp = await client.post(COMPLETIONS, json={"prompt": "", "prompt_embeds": []})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "Bad Request"
    assert "Either prompt or prompt_embeds must be provided and non-empty." in err["message"]
    # An empty list next to a prompt is no embedding at all.
    resp = await client.post(COMPLETIONS, json={"prompt": "hi", "prompt_embeds": []})
    assert resp.status == 200


# --- no max_tokens: to the end of the context ----------------------------------------------


async def test_no_max_tokens_ignore_eos_runs_to_context_end(
    make_client: MakeClient, sim_tokenizer: SimTokenizer
) -> None:
    client = await make_client(max_model_len=256)
    resp = await client.post(CHAT, json=chat_body(ignore_eos=True))
    data = await resp.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["total_tokens"] == 256
    # Streamed, with n=2 and max_tokens: null: each choice fills the context.
    resp = await client.post(
        CHAT,
        json=chat_body(ignore_eos=True, n=2, max_tokens=None, stream=True, stream_options={}),
    )
    events = split_sse(await resp.read())
    usage = json.loads(events[-2][len(b"data: ") :])["usage"]
    assert usage["completion_tokens"] == 2 * (256 - usage["prompt_tokens"])
    # min_tokens alone also reaches the context end when the model wants less.
    resp = await client.post(
        COMPLETIONS, json={"prompt": "hi", "max_tokens": None, "min_tokens": 200}
    )
    data = await resp.json()
    assert data["usage"]["completion_tokens"] == 200
