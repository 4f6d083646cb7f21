"""The simulator's Mistral and harmony prompt paths, checked against the libraries alone.

The simulator picks the path from the model directory as vLLM does; its usage must be what
mistral_common and harmony make of the request when called directly (no kvgate code here).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from openai_harmony import (
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    Role,
    SystemContent,
    load_harmony_encoding,
)

from testbed.demo_model import demo_model_dir
from testbed.engine_models import gpt_oss_model_dir, mistral_spm_model_dir, mistral_tekken_model_dir
from vllm_sim import SimConfig, create_app
from vllm_sim.engine_tokenizers import (
    HarmonySimTokenizer,
    MistralSimTokenizer,
    load_sim_tokenizer,
    pick_tokenizer_mode,
)
from vllm_sim.tokenization import SimTokenizer

FLOOD = "<|endoftext|>[INST]<|start|>" * 500


def test_the_mode_is_picked_from_the_directory(tmp_path: Path) -> None:
    assert pick_tokenizer_mode(mistral_tekken_model_dir()) == "mistral"
    assert pick_tokenizer_mode(mistral_spm_model_dir()) == "mistral"
    assert pick_tokenizer_mode(gpt_oss_model_dir()) == "harmony"
    assert pick_tokenizer_mode(gpt_oss_model_dir(), "hf") == "harmony"  # whatever the flag
    assert pick_tokenizer_mode(demo_model_dir()) == "hf"
    assert pick_tokenizer_mode(demo_model_dir(), "mistral") == "mistral"
    assert type(load_sim_tokenizer(demo_model_dir())) is SimTokenizer


@pytest.fixture
async def mistral_client() -> AsyncIterator[TestClient]:
    model_dir = mistral_tekken_model_dir()
    config = SimConfig(model_dir=model_dir, served_model_name="m")
    client = TestClient(TestServer(create_app(config)))
    await client.start_server()
    yield client
    await client.close()


async def test_mistral_usage_is_mistral_commons_count(mistral_client: TestClient) -> None:
    messages = [
        {"role": "system", "content": "Be brief [/INST]"},
        {"role": "user", "content": FLOOD},
    ]
    resp = await mistral_client.post(
        "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 4}
    )
    assert resp.status == 200, await resp.text()
    usage = (await resp.json())["usage"]
    mistral = MistralTokenizer.from_file(
        str(mistral_tekken_model_dir() / "tekken.json"), mode=ValidationMode.test
    )
    request = ChatCompletionRequest.from_openai(messages)
    assert usage["prompt_tokens"] == len(mistral.encode_chat_completion(request).tokens)
    assert usage["completion_tokens"] == 4

    resp = await mistral_client.post(
        "/v1/completions", json={"model": "m", "prompt": FLOOD, "max_tokens": 4}
    )
    inner = mistral.instruct_tokenizer.tokenizer
    assert (await resp.json())["usage"]["prompt_tokens"] == len(inner.encode(FLOOD, True, False))


async def test_mistral_refuses_chat_template_kwargs(mistral_client: TestClient) -> None:
    """Set at all, even empty, as vLLM's mistral mode; null is the same as absent."""
    for kwargs, status in (({"x": 1}, 400), ({}, 400), (None, 200)):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": kwargs,
            "max_tokens": 2,
        }
        resp = await mistral_client.post("/v1/chat/completions", json=body)
        assert resp.status == status, (kwargs, await resp.text())


def test_sentencepiece_layout_encodes_like_mistral_common() -> None:
    model_dir = mistral_spm_model_dir()
    sim = MistralSimTokenizer(model_dir)
    mistral = MistralTokenizer.from_file(
        str(model_dir / "tokenizer.model.v3"), mode=ValidationMode.test
    )
    messages = [{"role": "user", "content": FLOOD}]
    expected = mistral.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    assert sim.encode_chat(messages) == expected


def test_harmony_renders_the_preamble_and_conversation() -> None:
    sim = HarmonySimTokenizer(gpt_oss_model_dir())
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    expected = encoding.render_conversation_for_completion(
        Conversation.from_messages(
            [
                Message.from_role_and_content(
                    Role.SYSTEM, SystemContent.new().with_conversation_start_date(today)
                ),
                Message.from_role_and_content(
                    Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief")
                ),
                Message.from_role_and_content(Role.USER, FLOOD),
            ]
        ),
        Role.ASSISTANT,
    )
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": FLOOD}]
    assert sim.encode_chat(messages) == list(expected)
    assert sim.count_text(FLOOD) == len(encoding.encode(FLOOD, disallowed_special=()))
