"""The official OpenAI client consumes the simulator like a vLLM server."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.helpers import MODEL, USER_HI

openai = pytest.importorskip("openai")


def _client(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


async def test_chat_stream_with_usage(client: TestClient) -> None:
    async with _client(client) as oai:
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=USER_HI,  # type: ignore[arg-type]
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    assert text == " the cat sat on a"
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 5


async def test_completion_and_models(client: TestClient) -> None:
    async with _client(client) as oai:
        models = await oai.models.list()
        assert [m.id for m in models.data] == [MODEL]
        done = await oai.completions.create(model=MODEL, prompt="Say", max_tokens=3)
        assert done.choices[0].text == " the cat sat"
        assert done.usage is not None and done.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError):
            await oai.completions.create(model="other", prompt="Say", max_tokens=3)
