"""SSE framing, byte for byte, against vLLM 0.10.2's serving code."""

from __future__ import annotations

from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, event_json, split_sse
from vllm_sim.tokenization import SimTokenizer


def _head(raw: bytes) -> tuple[str, int]:
    first = event_json(split_sse(raw)[0])
    return first["id"], first["created"]


async def test_chat_stream_is_byte_exact(client: TestClient) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=4)
    resp = await client.post(CHAT, json=body, headers={"x-sim-output-tokens": "10"})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert "Content-Length" not in resp.headers
    raw = await resp.read()
    rid, created = _head(raw)
    assert rid.startswith("chatcmpl-") and len(rid) == len("chatcmpl-") + 32
    usage = event_json(split_sse(raw)[-2])["usage"]
    prompt = usage["prompt_tokens"]

    head = f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":"{MODEL}"'
    expected = (
        f'data: {head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
        f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":null}}\n\n'
    )
    for word in (" the", " cat", " sat"):
        expected += (
            f'data: {head},"choices":[{{"index":0,"delta":{{"content":"{word}"}},'
            f'"logprobs":null,"finish_reason":null,"token_ids":null}}]}}\n\n'
        )
    expected += (
        f'data: {head},"choices":[{{"index":0,"delta":{{"content":" on"}},"logprobs":null,'
        f'"finish_reason":"length","stop_reason":null,"token_ids":null}}]}}\n\n'
        f'data: {head},"choices":[],"usage":{{"prompt_tokens":{prompt},'
        f'"total_tokens":{prompt + 4},"completion_tokens":4}}}}\n\n'
        "data: [DONE]\n\n"
    )
    assert raw.decode() == expected


async def test_chat_stream_one_http_chunk_per_event(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(stream=True, max_tokens=6))
    chunks: list[bytes] = []
    buf = b""
    async for data, end_of_chunk in resp.content.iter_chunks():
        buf += data
        if end_of_chunk:
            chunks.append(buf)
            buf = b""
    # role chunk, 6 one-token chunks, [DONE]: each its own write.
    assert len(chunks) == 8
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert [event_json(c)["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == [
        " the",
        " cat",
        " sat",
        " on",
        " a",
        " mat",
    ]


async def test_chat_stream_without_usage_option_has_no_usage(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(stream=True, max_tokens=3))
    events = split_sse(await resp.read())
    assert events[-1] == b"data: [DONE]"
    assert all(b'"usage"' not in e for e in events)
    assert len(events) == 1 + 3 + 1


async def test_chat_stream_stop_ends_on_hidden_eos(client: TestClient) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=50)
    resp = await client.post(CHAT, json=body, headers={"x-sim-output-tokens": "3"})
    events = split_sse(await resp.read())
    last = event_json(events[-3])["choices"][0]
    # vLLM: the EOS step streams an empty delta carrying the finish reason.
    assert last == {
        "index": 0,
        "delta": {"content": ""},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": None,
    }
    assert event_json(events[-2])["usage"]["completion_tokens"] == 3
    texts = [event_json(e)["choices"][0]["delta"]["content"] for e in events[1:-2]]
    assert texts == [" the", " cat", ""]


async def test_chat_continuous_usage_on_every_chunk(client: TestClient) -> None:
    body = chat_body(
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        max_tokens=2,
    )
    raw = (await (await client.post(CHAT, json=body)).read()).decode()
    events = split_sse(raw.encode())
    usages = [event_json(e)["usage"] for e in events[:-1]]
    prompt = usages[0]["prompt_tokens"]
    assert usages == [
        {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0},
        {"prompt_tokens": prompt, "total_tokens": prompt + 1, "completion_tokens": 1},
        {"prompt_tokens": prompt, "total_tokens": prompt + 2, "completion_tokens": 2},
        {"prompt_tokens": prompt, "total_tokens": prompt + 2, "completion_tokens": 2},
    ]
    # Key order inside usage is vLLM's field order.
    assert '"usage":{"prompt_tokens":' in raw and '"total_tokens":' in raw


async def test_completion_stream_is_byte_exact(client: TestClient) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 2,
    }
    raw = await (await client.post(COMPLETIONS, json=body)).read()
    rid, created = _head(raw)
    assert rid.startswith("cmpl-")
    head = f'{{"id":"{rid}","object":"text_completion","created":{created},"model":"{MODEL}"'
    expected = (
        f'data: {head},"choices":[{{"index":0,"text":" the","logprobs":null,'
        f'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}}],'
        f'"usage":null}}\n\n'
        f'data: {head},"choices":[{{"index":0,"text":" cat","logprobs":null,'
        f'"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}}],'
        f'"usage":null}}\n\n'
        f'data: {head},"choices":[],"usage":{{"prompt_tokens":4,"total_tokens":6,'
        f'"completion_tokens":2}}}}\n\n'
        "data: [DONE]\n\n"
    )
    assert raw.decode() == expected


async def test_force_include_usage(make_client: MakeClient) -> None:
    client = await make_client(force_include_usage=True)
    raw = await (await client.post(CHAT, json=chat_body(stream=True, max_tokens=2))).read()
    events = split_sse(raw)
    assert event_json(events[-2])["choices"] == []
    assert event_json(events[-2])["usage"]["completion_tokens"] == 2
    # An explicit include_usage=false is overridden too.
    body = chat_body(stream=True, stream_options={"include_usage": False}, max_tokens=2)
    events = split_sse(await (await client.post(CHAT, json=body)).read())
    assert event_json(events[-2])["usage"]["completion_tokens"] == 2


async def test_return_token_ids(client: TestClient, sim_tokenizer: SimTokenizer) -> None:
    body = chat_body(stream=True, max_tokens=2, return_token_ids=True)
    events = split_sse(await (await client.post(CHAT, json=body)).read())
    first = event_json(events[0])
    assert isinstance(first["prompt_token_ids"], list) and first["prompt_token_ids"]
    ids = [event_json(e)["choices"][0]["token_ids"] for e in events[1:-1]]
    assert ids == [[sim_tokenizer.output_token(0)[0]], [sim_tokenizer.output_token(1)[0]]]


async def test_n_choices_stream(client: TestClient) -> None:
    body = chat_body(stream=True, n=2, max_tokens=3, stream_options={"include_usage": True})
    events = split_sse(await (await client.post(CHAT, json=body)).read())
    objs = [event_json(e) for e in events[:-1]]
    # Both role chunks come first, then each choice's 3 tokens; usage sums choices.
    assert [o["choices"][0]["delta"].get("role") for o in objs[:2]] == ["assistant"] * 2
    assert sorted(o["choices"][0]["index"] for o in objs[:2]) == [0, 1]
    per_index: dict[int, list[str]] = {0: [], 1: []}
    for o in objs[2:-1]:
        per_index[o["choices"][0]["index"]].append(o["choices"][0]["delta"]["content"])
    assert per_index == {0: [" the", " cat", " sat"], 1: [" the", " cat", " sat"]}
    assert objs[-1]["usage"]["completion_tokens"] == 6
