"""Usage counts: the simulator's prompt_tokens equal transformers' own count, computed
here from the request with vLLM's preprocessing rules."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from testbed.demo_model import REPO_ROOT
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body

CORPUS = json.loads((REPO_ROOT / "tests" / "corpus" / "chat_requests.json").read_text("utf-8"))


def reference_chat_count(hf: Any, request: dict[str, Any]) -> int:
    """vLLM's chat path spelled out: text parts joined with newlines, tool-call
    arguments parsed to objects, tools as pydantic dumps them (extra keys such as
    "strict" kept), render, then encode without special tokens."""
    messages = []
    for message in request["messages"]:
        m = copy.deepcopy(message)
        content = m.get("content")
        if content is None:
            m["content"] = ""
        elif isinstance(content, list):
            m["content"] = "\n".join(p["text"] for p in content if p.get("text"))
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            call["function"]["arguments"] = json.loads(args) if args else {}
        messages.append(m)
    tools = None
    if request.get("tools"):
        tools = []
        for t in request["tools"]:
            fn = t["function"]
            # pydantic model_dump: declared fields (None when absent), then extras.
            function = {
                "name": fn["name"],
                "description": fn.get("description"),
                "parameters": fn.get("parameters"),
            }
            function.update({k: v for k, v in fn.items() if k not in function})
            tools.append({"type": "function", "function": function})
    text = hf.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=request.get("add_generation_prompt", True),
        continue_final_message=request.get("continue_final_message", False),
        tokenize=False,
        **(request.get("chat_template_kwargs") or {}),
    )
    return len(hf(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("index", range(len(CORPUS)))
async def test_chat_prompt_tokens_match_transformers(
    client: TestClient, hf_tokenizer: Any, index: int
) -> None:
    request = dict(CORPUS[index])
    request.pop("stream", None)
    request.pop("stream_options", None)  # vLLM refuses them without stream=True
    request["max_tokens"] = min(request.get("max_tokens", 8), 8)
    resp = await client.post(CHAT, json=request)
    assert resp.status == 200, await resp.text()
    usage = (await resp.json())["usage"]
    n = request.get("n", 1)
    assert usage["prompt_tokens"] == reference_chat_count(hf_tokenizer, request)
    assert usage["completion_tokens"] == n * request["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_stream_usage_matches_non_stream(client: TestClient) -> None:
    body = chat_body(max_tokens=5)
    plain = (await (await client.post(CHAT, json=body)).json())["usage"]
    stream_body = chat_body(max_tokens=5, stream=True, stream_options={"include_usage": True})
    raw = await (await client.post(CHAT, json=stream_body)).read()
    last = json.loads(raw.split(b"\n\n")[-3][6:])
    assert last["usage"] == {
        k: plain[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")
    }


async def test_chat_template_kwargs_and_system_turn(client: TestClient, hf_tokenizer: Any) -> None:
    request = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 1,
    }
    usage = (await (await client.post(CHAT, json=request)).json())["usage"]
    assert usage["prompt_tokens"] == reference_chat_count(hf_tokenizer, request)


async def test_completion_prompt_counts(client: TestClient, hf_tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé 😀 — done."
    body = {"model": MODEL, "prompt": text, "max_tokens": 3}
    usage = (await (await client.post(COMPLETIONS, json=body)).json())["usage"]
    assert usage["prompt_tokens"] == len(hf_tokenizer(text, add_special_tokens=True).input_ids)

    # A token-id prompt counts as-is, whatever the ids.
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 3}
    usage = (await (await client.post(COMPLETIONS, json=body)).json())["usage"]
    assert usage["prompt_tokens"] == 7

    # Several prompts: one choice each, prompt tokens summed.
    body = {"model": MODEL, "prompt": ["one two", "three four five"], "max_tokens": 2}
    data = await (await client.post(COMPLETIONS, json=body)).json()
    expected = sum(len(hf_tokenizer(p).input_ids) for p in ["one two", "three four five"])
    assert data["usage"]["prompt_tokens"] == expected
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 4
