"""Generated text re-tokenizes to exactly the tokens generated, so a gateway that
counts streamed text (after a disconnect, say) gets the engine's number."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from tokenizers import Tokenizer

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, event_json, split_sse
from vllm_sim.tokenization import SimTokenizer


@pytest.fixture(scope="module")
def raw_tokenizer(model_dir: Path) -> Tokenizer:
    # The bare Rust tokenizer: a second, transformers-free opinion.
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_output_vocabulary(sim_tokenizer: SimTokenizer) -> None:
    assert len(sim_tokenizer.word_ids) >= 20
    assert len(set(sim_tokenizer.word_ids)) == len(sim_tokenizer.word_ids)
    assert all(t.startswith(" ") and t[1:].isalpha() for t in sim_tokenizer.word_texts)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 257])
def test_text_retokenizes_to_same_ids(
    sim_tokenizer: SimTokenizer, hf_tokenizer: Any, raw_tokenizer: Tokenizer, n: int
) -> None:
    pieces = [sim_tokenizer.output_token(i) for i in range(n)]
    ids = [p[0] for p in pieces]
    text = "".join(p[1] for p in pieces)
    assert hf_tokenizer(text, add_special_tokens=False).input_ids == ids
    assert raw_tokenizer.encode(text, add_special_tokens=False).ids == ids
    assert hf_tokenizer.decode(ids) == text


async def _stream_text(client: TestClient, body: dict, **headers: str) -> tuple[str, dict | None]:
    raw = await (await client.post(CHAT, json=body, headers=headers)).read()
    events = split_sse(raw)
    objs = [event_json(e) for e in events[:-1]]
    text = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
    return text, objs[-1].get("usage")


@pytest.mark.parametrize("n", [1, 5, 40])
async def test_streamed_text_counts_as_completion_tokens(
    client: TestClient, hf_tokenizer: Any, n: int
) -> None:
    body = chat_body(max_tokens=n, stream=True, stream_options={"include_usage": True})
    text, usage = await _stream_text(client, body, **{"x-sim-output-tokens": "1000"})
    assert usage is not None and usage["completion_tokens"] == n
    assert len(hf_tokenizer(text, add_special_tokens=False).input_ids) == n


async def test_stop_finish_hides_only_eos(client: TestClient, hf_tokenizer: Any) -> None:
    body = chat_body(max_tokens=100, stream=True, stream_options={"include_usage": True})
    text, usage = await _stream_text(client, body, **{"x-sim-output-tokens": "30"})
    assert usage is not None
    # vLLM counts the EOS that ended a "stop" generation; the text has one less.
    assert usage["completion_tokens"] == 30
    assert len(hf_tokenizer(text, add_special_tokens=False).input_ids) == 29


async def test_no_eos_mode_shows_every_token(make_client: MakeClient, hf_tokenizer: Any) -> None:
    client = await make_client(eos_on_stop=False)
    body = chat_body(max_tokens=100, stream=True, stream_options={"include_usage": True})
    text, usage = await _stream_text(client, body, **{"x-sim-output-tokens": "30"})
    assert usage is not None and usage["completion_tokens"] == 30
    assert len(hf_tokenizer(text, add_special_tokens=False).input_ids) == 30


async def test_cut_stream_text_counts_tokens_sent(client: TestClient, hf_tokenizer: Any) -> None:
    body = {"model": MODEL, "prompt": "Tell me", "stream": True, "max_tokens": 100}
    headers = {"x-sim-abort-after": "23", "x-sim-output-tokens": "1000"}
    resp = await client.post(COMPLETIONS, json=body, headers=headers)
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async for data in resp.content.iter_any():
            received += data
    chunks = [event_json(e) for e in received.split(b"\n\n") if e]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(chunks) == 23
    assert len(hf_tokenizer(text, add_special_tokens=False).input_ids) == 23


async def test_stream_and_unary_agree(client: TestClient) -> None:
    headers = {"x-sim-output-tokens": "20"}
    unary = await (await client.post(CHAT, json=chat_body(max_tokens=50), headers=headers)).json()
    text, _ = await _stream_text(client, chat_body(max_tokens=50, stream=True), **headers)
    assert unary["choices"][0]["message"]["content"] == text
