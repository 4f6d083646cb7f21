"""logprobs in vLLM 0.10.2's shapes: chat (logprobs + top_logprobs) and completions
(logprobs: k), streamed and not, their validation, and answers big enough to test a
gateway's buffers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.sim.conftest import MakeClient
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, chat_body, event_json, split_sse
from vllm_sim.tokenization import SimTokenizer

MiB = 1024 * 1024


def _decode(tok: SimTokenizer, token_id: int) -> str:
    return tok._tok.decode([token_id])


def _check_chat_entry(entry: dict[str, Any], k: int) -> None:
    assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
    assert entry["bytes"] == list(entry["token"].encode())
    assert entry["logprob"] <= 0
    tops = entry["top_logprobs"]
    assert len(tops) == k
    for top in tops:
        assert list(top) == ["token", "logprob", "bytes"]
        assert top["bytes"] == list(top["token"].encode())
    if k:
        # A greedy model: the sampled token leads, then strictly decreasing.
        assert tops[0] == {k2: entry[k2] for k2 in ("token", "logprob", "bytes")}
        values = [t["logprob"] for t in tops]
        assert values == sorted(values, reverse=True) and len(set(values)) == k
        assert len({t["token"] for t in tops}) == k


# --- chat ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5, 20])
async def test_chat_logprobs_non_stream(
    client: TestClient, sim_tokenizer: SimTokenizer, k: int
) -> None:
    resp = await client.post(
        CHAT,
        json=chat_body(max_tokens=6, logprobs=True, top_logprobs=k, return_token_ids=True),
    )
    assert resp.status == 200
    choice = (await resp.json())["choices"][0]
    content = choice["logprobs"]["content"]
    assert list(choice["logprobs"]) == ["content"]
    # One entry per generated token, and they are the real tokens.
    assert [e["token"] for e in content] == [_decode(sim_tokenizer, t) for t in choice["token_ids"]]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        _check_chat_entry(entry, k)


async def test_chat_logprobs_without_top_logprobs(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body(max_tokens=3, logprobs=True))
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(e["top_logprobs"] == [] for e in content)
    # "top_logprobs": null switches them off again, as in vLLM.
    resp = await client.post(CHAT, json=chat_body(max_tokens=3, logprobs=True, top_logprobs=None))
    assert (await resp.json())["choices"][0]["logprobs"] is None
    resp = await client.post(CHAT, json=chat_body(max_tokens=3, logprobs=False))
    assert (await resp.json())["choices"][0]["logprobs"] is None


async def test_chat_logprobs_eos_token_is_shown(
    client: TestClient, sim_tokenizer: SimTokenizer
) -> None:
    """A "stop" finish ends on EOS: hidden in the text, present in the logprobs
    under its special-token text (vLLM decodes logprob tokens one by one, specials kept)."""
    eos = _decode(sim_tokenizer, sim_tokenizer.eos_token_id)  # type: ignore[arg-type]
    headers = {"x-sim-output-tokens": "3"}
    body = chat_body(max_tokens=10, logprobs=True, top_logprobs=2)
    data = await (await client.post(CHAT, json=body, headers=headers)).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]][-1] == eos
    assert choice["message"]["content"] == " the cat"

    resp = await client.post(CHAT, json={**body, "stream": True}, headers=headers)
    chunks = [event_json(e) for e in split_sse(await resp.read())[:-1]]
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {"content": ""}
    assert last["finish_reason"] == "stop"
    assert [e["token"] for e in last["logprobs"]["content"]] == [eos]


async def test_chat_stream_logprobs_match_non_stream(client: TestClient) -> None:
    body = chat_body(max_tokens=5, n=2, logprobs=True, top_logprobs=3)
    full = await (await client.post(CHAT, json=body)).json()
    resp = await client.post(CHAT, json={**body, "stream": True})
    events = split_sse(await resp.read())
    assert events[-1] == b"data: [DONE]"
    streamed: dict[int, list[Any]] = {0: [], 1: []}
    for event in events[:-1]:
        choice = event_json(event)["choices"][0]
        if "role" in choice["delta"]:
            assert choice["logprobs"] is None
            continue
        # Chat chunks dump only what was set: logprobs sits between delta and finish.
        assert list(choice)[:3] == ["index", "delta", "logprobs"]
        assert len(choice["logprobs"]["content"]) == 1
        streamed[choice["index"]] += choice["logprobs"]["content"]
    for choice in full["choices"]:
        assert streamed[choice["index"]] == choice["logprobs"]["content"]
    # The two choices are sampled independently: different values.
    assert full["choices"][0]["logprobs"] != full["choices"][1]["logprobs"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
        (
            {"top_logprobs": 2, "logprobs": False},
            "when using `top_logprobs`, `logprobs` must be set to true.",
        ),
        ({"top_logprobs": -1, "logprobs": True}, "`top_logprobs` must be a positive value."),
        ({"prompt_logprobs": -1}, "`prompt_logprobs` must be a positive value."),
    ],
)
async def test_chat_logprobs_validation(
    client: TestClient, extra: dict[str, Any], needle: str
) -> None:
    resp = await client.post(CHAT, json=chat_body(**extra))
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "Bad Request"
    assert f"Value error, {needle}" in err["message"]


MAX_LOGPROBS_ERROR = "Requested sample logprobs of 21, which is is greater than max allowed: 20"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat_body(logprobs=True, top_logprobs=21)),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 21}),
    ],
)
async def test_more_than_max_logprobs(client: TestClient, path: str, body: dict[str, Any]) -> None:
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert await resp.json() == {
        "error": {
            "message": MAX_LOGPROBS_ERROR,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    # Streamed: the engine refuses after the 200, so vLLM sends an error event.
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    events = split_sse(await resp.read())
    assert events == [
        b'data: {"error": {"message": "' + MAX_LOGPROBS_ERROR.encode() + b'", '
        b'"type": "BadRequestError", "param": null, "code": 400}}',
        b"data: [DONE]",
    ]


async def test_max_logprobs_is_configurable(make_client: MakeClient) -> None:
    client = await make_client(max_logprobs=30)
    resp = await client.post(CHAT, json=chat_body(max_tokens=2, logprobs=True, top_logprobs=25))
    assert resp.status == 200
    content = (await resp.json())["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 25 for e in content)


# --- completions ---------------------------------------------------------------------------


def _check_completion_logprobs(lp: dict[str, Any], text: str, k: int, offset0: int = 0) -> None:
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    n = len(lp["tokens"])
    assert len(lp["text_offset"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == text
    offset = offset0
    for i in range(n):
        assert lp["text_offset"][i] == offset
        offset += len(lp["tokens"][i])
        top = lp["top_logprobs"][i]
        if lp["token_logprobs"][i] is None:
            assert top is None
            continue
        assert len(top) == max(k, 1)
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert list(top.values()) == sorted(top.values(), reverse=True)


@pytest.mark.parametrize("k", [0, 1, 20])
async def test_completion_logprobs_non_stream(
    client: TestClient, sim_tokenizer: SimTokenizer, k: int
) -> None:
    resp = await client.post(
        COMPLETIONS,
        json={"prompt": "hello", "max_tokens": 7, "logprobs": k, "return_token_ids": True},
    )
    choice = (await resp.json())["choices"][0]
    lp = choice["logprobs"]
    _check_completion_logprobs(lp, choice["text"], k)
    assert lp["tokens"] == [_decode(sim_tokenizer, t) for t in choice["token_ids"]]
    assert None not in lp["token_logprobs"]
    assert choice["prompt_logprobs"] is None


async def test_completion_echo_logprobs(client: TestClient, sim_tokenizer: SimTokenizer) -> None:
    prompt = "Hello there my friend"
    ids = sim_tokenizer.encode(prompt, add_special_tokens=True)
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 2, "echo": True}
    choice = (await (await client.post(COMPLETIONS, json=body)).json())["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    _check_completion_logprobs(lp, choice["text"], 2)
    assert len(lp["tokens"]) == len(ids) + 3
    # The first prompt token has no logprobs (nothing precedes it).
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:], strict=True):
        first_key = next(iter(entry))
        assert first_key == str(token_id)
        assert list(entry[first_key]) == ["logprob", "rank", "decoded_token"]
        assert [v["rank"] for v in entry.values()] == list(range(1, len(entry) + 1))
    # Prompt logprobs do not depend on the choice.
    resp = await client.post(COMPLETIONS, json={**body, "n": 2})
    two = (await resp.json())["choices"]
    assert two[0]["prompt_logprobs"] == two[1]["prompt_logprobs"] == plp


async def test_completion_stream_logprobs(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "logprobs": 3, "stream": True, "echo": True}
    events = split_sse(await (await client.post(COMPLETIONS, json=body)).read())
    chunks = [event_json(e)["choices"][0] for e in events[:-1]]
    assert len(chunks) == 4
    first = chunks[0]
    assert first["text"].startswith("hi")
    assert first["logprobs"]["token_logprobs"][0] is None  # echoed prompt token
    generated = ""
    for i, chunk in enumerate(chunks):
        lp = chunk["logprobs"]
        if i:
            # vLLM's offsets count generated text only (the echo is not counted).
            assert lp["text_offset"] == [len(generated)]
            _check_completion_logprobs(lp, chunk["text"], 3, len(generated))
            generated += chunk["text"]
        else:
            generated += chunk["text"][len("hi") :]
    full = await (await client.post(COMPLETIONS, json={**body, "stream": False})).json()
    assert full["choices"][0]["logprobs"]["token_logprobs"][1:] == [
        v for c in chunks for v in c["logprobs"]["token_logprobs"] if v is not None
    ]


# --- several tokens per event, and big answers ----------------------------------------------


async def test_chunk_tokens_header(client: TestClient) -> None:
    body = chat_body(max_tokens=7, logprobs=True, top_logprobs=1, return_token_ids=True)
    resp = await client.post(
        CHAT, json={**body, "stream": True}, headers={"x-sim-chunk-tokens": "3"}
    )
    chunks = [event_json(e)["choices"][0] for e in split_sse(await resp.read())[1:-1]]
    assert [len(c["token_ids"]) for c in chunks] == [3, 3, 1]
    assert [len(c["logprobs"]["content"]) for c in chunks] == [3, 3, 1]
    assert [c["finish_reason"] for c in chunks] == [None, None, "length"]
    full = await (await client.post(CHAT, json=body)).json()
    assert (
        "".join(c["delta"]["content"] for c in chunks) == full["choices"][0]["message"]["content"]
    )
    assert [e for c in chunks for e in c["logprobs"]["content"]] == full["choices"][0]["logprobs"][
        "content"
    ]


async def test_big_non_streamed_answer(client: TestClient) -> None:
    body = chat_body(max_tokens=2000, n=4, ignore_eos=True, logprobs=True, top_logprobs=20)
    resp = await client.post(CHAT, json=body)
    raw = await resp.read()
    assert len(raw) > 8 * MiB
    data = json.loads(raw)
    assert data["usage"]["completion_tokens"] == 8000
    assert all(len(c["logprobs"]["content"]) == 2000 for c in data["choices"])


async def test_big_sse_events(client: TestClient) -> None:
    # Completions: echo + logprobs puts the whole prompt's logprobs in the first event.
    body = {"prompt": "hi " * 8000, "max_tokens": 2, "logprobs": 20, "echo": True, "stream": True}
    events = split_sse(await (await client.post(COMPLETIONS, json=body)).read())
    assert len(events[0]) > 4 * MiB
    assert len(event_json(events[0])["choices"][0]["logprobs"]["tokens"]) > 8000
    # Chat: one event carrying many tokens' logprobs.
    body = chat_body(max_tokens=4000, ignore_eos=True, logprobs=True, top_logprobs=20, stream=True)
    resp = await client.post(CHAT, json=body, headers={"x-sim-chunk-tokens": "4000"})
    events = split_sse(await resp.read())
    assert len(events) == 3  # role, the 4000 tokens, [DONE]
    assert len(events[1]) > 4 * MiB


async def test_steering_and_auth_with_logprobs(make_client: MakeClient) -> None:
    client = await make_client(api_keys=("k",))
    headers = {"Authorization": "Bearer k", "x-sim-output-tokens": "4"}
    body = chat_body(max_tokens=50, logprobs=True, top_logprobs=2)
    data = await (await client.post(CHAT, json=body, headers=headers)).json()
    assert data["usage"]["completion_tokens"] == 4
    assert len(data["choices"][0]["logprobs"]["content"]) == 4
    resp = await client.post(CHAT, json=body, headers={**headers, "x-sim-error": "429"})
    assert resp.status == 429
    # Abort-after with several tokens per event: what is pending goes out first.
    resp = await client.post(
        CHAT,
        json={**body, "stream": True},
        headers={**headers, "x-sim-abort-after": "3", "x-sim-chunk-tokens": "2"},
    )
    raw = b""
    with pytest.raises(Exception):  # noqa: B017 - the cut surfaces as a payload error
        async for piece in resp.content.iter_any():
            raw += piece
    assert b"[DONE]" not in raw
    contents = [
        len(json.loads(e[6:])["choices"][0]["logprobs"]["content"])
        for e in raw.split(b"\n\n")
        if e.startswith(b"data: {") and b'"logprobs":{' in e
    ]
    assert contents == [2, 1]
    records = (await (await client.get("/sim/requests")).json())["requests"]
    assert records[0]["body"]["logprobs"] is True and records[0]["body"]["top_logprobs"] == 2


async def test_many_top_logprobs_when_allowed(make_client: MakeClient) -> None:
    client = await make_client(max_logprobs=-1)
    body = chat_body(max_tokens=3, logprobs=True, top_logprobs=100)
    content = (await (await client.post(CHAT, json=body)).json())["choices"][0]["logprobs"][
        "content"
    ]
    for entry in content:
        _check_chat_entry(entry, 100)
