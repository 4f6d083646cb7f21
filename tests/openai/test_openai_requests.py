"""Request parsing, validation (incl. hostile inputs) and body rewriting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.openai import (
    MAX_JSON_DEPTH,
    ApiError,
    load_json_object,
    parse_request,
    request_kind,
    rewrite_body,
)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": USER}
    body.update(fields)
    return json.dumps(body).encode()


def comp(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    body.update(fields)
    return json.dumps(body).encode()


def without(body: bytes, key: str) -> bytes:
    obj = json.loads(body)
    del obj[key]
    return json.dumps(obj).encode()


def nested(depth: int) -> str:
    """A JSON value nesting `depth` arrays."""
    return "[" * depth + "]" * depth


# (id, path, body, code, param) -- every case must be a 400 with that code and param.
BAD_REQUESTS: list[tuple[str, str, bytes, str | None, str | None]] = [
    # --- body-level
    ("empty body", CHAT, b"", "invalid_json", None),
    ("whitespace body", CHAT, b" \r\n\t", "invalid_json", None),
    ("invalid utf-8", CHAT, b'{"model":"m\xff","messages":[]}', "invalid_json", None),
    ("overlong utf-8", CHAT, b'{"model":"\xc0\xaf"}', "invalid_json", None),
    ("utf-16 body", CHAT, chat().decode().encode("utf-16"), "invalid_json", None),
    ("bom", CHAT, b"\xef\xbb\xbf" + chat(), "invalid_json", None),
    ("malformed json", CHAT, b'{"model": "m",', "invalid_json", None),
    ("trailing garbage", CHAT, chat() + b"x", "invalid_json", None),
    ("two documents", CHAT, chat() + chat(), "invalid_json", None),
    ("NaN", CHAT, chat()[:-1] + b',"temperature":NaN}', "invalid_json", None),
    ("Infinity", CHAT, chat()[:-1] + b',"temperature":Infinity}', "invalid_json", None),
    ("-Infinity", CHAT, chat()[:-1] + b',"temperature":-Infinity}', "invalid_json", None),
    ("float overflow", CHAT, chat()[:-1] + b',"temperature":1e400}', "invalid_json", None),
    ("5000-digit int", CHAT, chat()[:-1] + b',"seed":' + b"9" * 5000 + b"}", "invalid_json",
     None),
    ("depth bomb", CHAT, b'{"model":"m","x":' + nested(100_000).encode() + b"}",
     "invalid_json", None),
    ("too deep", CHAT, b'{"model":"m","x":' + nested(MAX_JSON_DEPTH).encode() + b"}",
     "invalid_json", None),
    ("lone high surrogate", CHAT, chat()[:-1] + b',"user":"\\ud800"}', "invalid_json", None),
    ("lone low surrogate", CHAT, chat()[:-1] + b',"user":"a\\uDC00b"}', "invalid_json", None),
    ("top-level array", CHAT, b"[1,2]", "invalid_type", None),
    ("top-level string", CHAT, b'"x"', "invalid_type", None),
    ("top-level null", CHAT, b"null", "invalid_type", None),
    # --- model
    ("model missing", CHAT, b'{"messages":[{"role":"user","content":"x"}]}',
     "missing_required_parameter", "model"),
    ("model null", CHAT, chat(model=None), "missing_required_parameter", "model"),
    ("model int", CHAT, chat(model=3), "invalid_type", "model"),
    ("model empty", CHAT, chat(model=""), "invalid_value", "model"),
    # --- chat messages
    ("messages missing", CHAT, b'{"model":"m"}', "missing_required_parameter", "messages"),
    ("messages string", CHAT, chat(messages="hi"), "invalid_type", "messages"),
    ("messages object", CHAT, chat(messages={"role": "user"}), "invalid_type", "messages"),
    ("messages empty", CHAT, chat(messages=[]), "empty_array", "messages"),
    ("message not object", CHAT, chat(messages=[USER[0], "hi"]), "invalid_type", "messages[1]"),
    ("role missing", CHAT, chat(messages=[{"content": "x"}]), "missing_required_parameter",
     "messages[0].role"),
    ("role int", CHAT, chat(messages=[{"role": 1, "content": "x"}]), "invalid_type",
     "messages[0].role"),
    ("role unknown", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), "invalid_value",
     "messages[0].role"),
    ("role case", CHAT, chat(messages=[{"role": "User", "content": "x"}]), "invalid_value",
     "messages[0].role"),
    ("content missing", CHAT, chat(messages=[{"role": "user"}]), "missing_required_parameter",
     "messages[0].content"),
    ("content null user", CHAT, chat(messages=[{"role": "user", "content": None}]),
     "invalid_type", "messages[0].content"),
    ("content null assistant w/o tool_calls", CHAT,
     chat(messages=[USER[0], {"role": "assistant", "content": None}]), "invalid_type",
     "messages[1].content"),
    ("content int", CHAT, chat(messages=[{"role": "user", "content": 5}]), "invalid_type",
     "messages[0].content"),
    ("content object", CHAT, chat(messages=[{"role": "user", "content": {"text": "x"}}]),
     "invalid_type", "messages[0].content"),
    ("part not object", CHAT, chat(messages=[{"role": "user", "content": ["x"]}]),
     "invalid_type", "messages[0].content[0]"),
    ("part type missing", CHAT, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
     "missing_required_parameter", "messages[0].content[0].type"),
    ("part audio", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]),
     "invalid_value", "messages[0].content[1].type"),
    ("part image_url string", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": "http://x"}]}]),
     "invalid_type", "messages[0].content[0].image_url"),
    ("part image_url missing", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url"}]}]),
     "missing_required_parameter", "messages[0].content[0].image_url"),
    ("part image_url url int", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": 3}}]}]),
     "invalid_type", "messages[0].content[0].image_url.url"),
    ("part text missing", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "missing_required_parameter", "messages[0].content[0].text"),
    ("part text int", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "invalid_type", "messages[0].content[0].text"),
    ("tool_calls not list", CHAT,
     chat(messages=[USER[0], {"role": "assistant", "content": None, "tool_calls": {}}]),
     "invalid_type", "messages[1].tool_calls"),
    ("tool_calls item not object", CHAT,
     chat(messages=[USER[0], {"role": "assistant", "tool_calls": [1]}]),
     "invalid_type", "messages[1].tool_calls[0]"),
    ("name int", CHAT, chat(messages=[{"role": "user", "content": "x", "name": 1}]),
     "invalid_type", "messages[0].name"),
    ("tool_call_id int", CHAT,
     chat(messages=[{"role": "tool", "content": "x", "tool_call_id": 7}]), "invalid_type",
     "messages[0].tool_call_id"),
    # --- chat extras
    ("tools object", CHAT, chat(tools={"type": "function"}), "invalid_type", "tools"),
    ("tools item string", CHAT, chat(tools=["f"]), "invalid_type", "tools[0]"),
    ("chat_template_kwargs list", CHAT, chat(chat_template_kwargs=[]), "invalid_type",
     "chat_template_kwargs"),
    ("add_generation_prompt str", CHAT, chat(add_generation_prompt="yes"), "invalid_type",
     "add_generation_prompt"),
    ("continue_final_message with add_generation_prompt", CHAT,
     chat(continue_final_message=True), "invalid_value", "continue_final_message"),
    # --- max tokens
    ("max_tokens 0", CHAT, chat(max_tokens=0), "integer_below_min_value", "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-5), "integer_below_min_value", "max_tokens"),
    ("max_tokens bool", CHAT, chat(max_tokens=True), "invalid_type", "max_tokens"),
    ("max_tokens float", CHAT, chat(max_tokens=100.0), "invalid_type", "max_tokens"),
    ("max_tokens string", CHAT, chat(max_tokens="100"), "invalid_type", "max_tokens"),
    ("max_tokens huge", CHAT, chat(max_tokens=10**30), "integer_above_max_value", "max_tokens"),
    ("max_tokens 2^31", CHAT, chat(max_tokens=2**31), "integer_above_max_value", "max_tokens"),
    ("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), "integer_below_min_value",
     "max_completion_tokens"),
    ("max_completion_tokens bool", CHAT, chat(max_completion_tokens=False), "invalid_type",
     "max_completion_tokens"),
    ("invalid max_tokens even if max_completion_tokens wins", CHAT,
     chat(max_completion_tokens=5, max_tokens="x"), "invalid_type", "max_tokens"),
    ("completions max_tokens 0", COMP, comp(max_tokens=0), "integer_below_min_value",
     "max_tokens"),
    # --- n / best_of
    ("n 0", CHAT, chat(n=0), "integer_below_min_value", "n"),
    ("n bool", CHAT, chat(n=True), "invalid_type", "n"),
    ("n float", CHAT, chat(n=2.0), "invalid_type", "n"),
    ("n huge", CHAT, chat(n=10**9), "integer_above_max_value", "n"),
    ("best_of < n", COMP, comp(n=3, best_of=2), "invalid_value", "best_of"),
    ("best_of bool", COMP, comp(best_of=True), "invalid_type", "best_of"),
    # --- stream
    ("stream string", CHAT, chat(stream="true"), "invalid_type", "stream"),
    ("stream int", CHAT, chat(stream=1), "invalid_type", "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), None,
     "stream_options"),
    ("stream_options list", CHAT, chat(stream=True, stream_options=[True]), "invalid_type",
     "stream_options"),
    ("include_usage string", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}),
     "invalid_type", "stream_options.include_usage"),
    ("include_usage int", CHAT, chat(stream=True, stream_options={"include_usage": 1}),
     "invalid_type", "stream_options.include_usage"),
    ("continuous_usage_stats str", CHAT,
     chat(stream=True, stream_options={"continuous_usage_stats": "y"}), "invalid_type",
     "stream_options.continuous_usage_stats"),
    # --- completions prompt
    ("prompt missing", COMP, b'{"model":"m"}', "missing_required_parameter", "prompt"),
    ("prompt null", COMP, comp(prompt=None), "missing_required_parameter", "prompt"),
    ("prompt int", COMP, comp(prompt=5), "invalid_type", "prompt"),
    ("prompt object", COMP, comp(prompt={"a": 1}), "invalid_type", "prompt"),
    ("prompt empty list", COMP, comp(prompt=[]), "empty_array", "prompt"),
    ("prompt mixed str/int", COMP, comp(prompt=["a", 1]), "invalid_type", "prompt[1]"),
    ("prompt ids with str", COMP, comp(prompt=[1, 2, "3"]), "invalid_type", "prompt[2]"),
    ("prompt ids with bool", COMP, comp(prompt=[1, True]), "invalid_type", "prompt[1]"),
    ("prompt ids with float", COMP, comp(prompt=[1, 2.0]), "invalid_type", "prompt[1]"),
    ("prompt ids negative", COMP, comp(prompt=[1, -1]), "invalid_value", "prompt[1]"),
    ("prompt nested empty", COMP, comp(prompt=[[1], []]), "empty_array", "prompt[1]"),
    ("prompt nested bad id", COMP, comp(prompt=[[1], [2, None]]), "invalid_type",
     "prompt[1][1]"),
    ("prompt nested not list", COMP, comp(prompt=[[1], 2]), "invalid_type", "prompt[1]"),
    ("prompt list of objects", COMP, comp(prompt=[{"a": 1}]), "invalid_type", "prompt[0]"),
    ("prompt list of bools", COMP, comp(prompt=[True]), "invalid_type", "prompt[0]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request(path: str, body: bytes, code: str | None, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(path, body)
    err = info.value
    assert err.status == 400
    assert err.code == code
    assert err.param == param
    decoded = json.loads(err.to_body())
    assert decoded == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }
    assert err.message and len(err.message) < 400


def test_error_messages_clip_echoed_values() -> None:
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, chat(messages=[{"role": "x" * 100_000, "content": "x"}]))
    assert len(info.value.message) < 300


def test_invalid_utf8_names_offset_and_json_error_names_position() -> None:
    with pytest.raises(ApiError, match="offset 11"):
        load_json_object(b'{"model":"m\xff"}')
    with pytest.raises(ApiError, match="line 1, column"):
        load_json_object(b'{"model" "m"}')
    with pytest.raises(ApiError, match="byte order mark"):
        load_json_object(b'\xef\xbb\xbf{"model":"m"}')


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions/", "/v2/completions",
                                  "/", "", "/v1/chat/completions;x"])  # fmt: skip
def test_unsupported_path_is_404(path: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(path, chat())
    assert info.value.status == 404
    assert info.value.code == "unsupported_path"


def test_request_kind_ignores_query() -> None:
    assert request_kind("/v1/chat/completions?api-version=1") == "chat"
    assert request_kind("/v1/completions") == "completion"
    assert request_kind("/v1/models") is None


# --------------------------------------------------------------------------- valid input


def test_minimal_chat() -> None:
    req = parse_request(CHAT + "?x=1", chat())
    assert req.kind == "chat"
    assert req.path == CHAT
    assert req.model == "m"
    assert req.messages == USER
    assert req.prompt is None
    assert req.tools is None
    assert req.chat_template_kwargs is None
    assert req.add_generation_prompt is True
    assert req.continue_final_message is False
    assert req.stream is False
    assert req.include_usage_requested is False
    assert req.max_new_tokens is None
    assert req.max_tokens_param is None
    assert req.n == 1 and req.best_of is None and req.num_sequences == 1
    assert req.body == json.loads(chat())


def test_full_chat() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": None},
        {"role": "assistant", "content": "", "name": "bot"},
        {"role": "user", "content": []},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = parse_request(
        CHAT,
        chat(
            messages=messages,
            tools=tools,
            chat_template_kwargs={"enable_thinking": False},
            add_generation_prompt=False,
            continue_final_message=True,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": False},
            max_tokens=50,
            max_completion_tokens=70,
            n=3,
            temperature=0.5,
        ),
    )
    assert req.messages == messages
    assert req.tools == tools
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert req.add_generation_prompt is False
    assert req.continue_final_message is True
    assert req.stream is True
    assert req.include_usage_requested is True
    assert req.max_new_tokens == 70  # max_completion_tokens wins
    assert req.max_tokens_param == "max_completion_tokens"
    assert req.n == 3
    assert req.num_sequences == 3


@pytest.mark.parametrize(
    ("fields", "max_new", "param"),
    [
        ({"max_tokens": 5}, 5, "max_tokens"),
        ({"max_completion_tokens": 7}, 7, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": None}, 5, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": None}, None, None),
        ({"max_tokens": 2**31 - 1}, 2**31 - 1, "max_tokens"),
    ],
)
def test_chat_max_tokens(fields: dict[str, Any], max_new: int | None, param: str | None) -> None:
    req = parse_request(CHAT, chat(**fields))
    assert req.max_new_tokens == max_new
    assert req.max_tokens_param == param


def test_nullable_fields_mean_default() -> None:
    req = parse_request(
        CHAT,
        chat(stream=None, stream_options=None, n=None, tools=None, chat_template_kwargs=None,
             add_generation_prompt=None, continue_final_message=None),
    )  # fmt: skip
    assert (req.stream, req.n, req.tools, req.add_generation_prompt) == (False, 1, None, True)


def test_stream_without_usage() -> None:
    req = parse_request(CHAT, chat(stream=True))
    assert req.stream and not req.include_usage_requested
    req = parse_request(CHAT, chat(stream=True, stream_options={"include_usage": False}))
    assert req.stream and not req.include_usage_requested
    req = parse_request(CHAT, chat(stream=True, stream_options={}))
    assert not req.include_usage_requested


@pytest.mark.parametrize(
    ("prompt", "num_prompts"),
    [
        ("hello", 1),
        ("", 1),
        (["a", "b", "c"], 3),
        ([1, 2, 3], 1),
        ([0], 1),
        ([[1, 2], [3]], 2),
    ],
)
def test_completion_prompts(prompt: Any, num_prompts: int) -> None:
    req = parse_request(COMP, comp(prompt=prompt, n=2))
    assert req.kind == "completion"
    assert req.prompt == prompt
    assert req.messages is None
    assert req.num_prompts == num_prompts
    assert req.num_sequences == 2 * num_prompts


def test_completion_max_tokens_defaults() -> None:
    # Absent: the endpoint's default of 16; explicit null: no cap.
    assert parse_request(COMP, comp()).max_new_tokens == 16
    assert parse_request(COMP, comp()).max_tokens_param is None
    assert parse_request(COMP, comp(max_tokens=None)).max_new_tokens is None
    req = parse_request(COMP, comp(max_tokens=99))
    assert (req.max_new_tokens, req.max_tokens_param) == (99, "max_tokens")
    # max_completion_tokens is not a completions parameter (vLLM ignores it).
    assert parse_request(COMP, comp(max_completion_tokens=5)).max_new_tokens == 16


def test_best_of_multiplies_sequences() -> None:
    req = parse_request(COMP, comp(prompt=["a", "b"], n=2, best_of=5))
    assert (req.n, req.best_of, req.num_sequences) == (2, 5, 10)


def test_large_token_id_prompt_is_fast_enough() -> None:
    ids = list(range(200_000))
    req = parse_request(COMP, comp(prompt=ids))
    assert req.prompt == ids


def test_depth_limit_boundary() -> None:
    # The top-level object is level 1; MAX_JSON_DEPTH - 1 nested arrays reach the limit.
    ok = '{"x":' + nested(MAX_JSON_DEPTH - 1) + "}"
    assert load_json_object(ok.encode())["x"]
    with pytest.raises(ApiError):
        load_json_object(('{"x":' + nested(MAX_JSON_DEPTH) + "}").encode())
    # Many brackets but shallow: accepted (exercises the walk, not the fast path).
    wide = '{"x":[' + ",".join(["[]"] * 1000) + "]}"
    assert len(load_json_object(wide.encode())["x"]) == 1000
    # Brackets inside strings do not count as nesting.
    stringy = json.dumps({"x": "[" * 1000})
    assert load_json_object(stringy.encode())["x"] == "[" * 1000


def test_unicode_accepted() -> None:
    # Raw UTF-8, escaped BMP chars and escaped surrogate *pairs* are all fine.
    text = "héllo 世界 🎉"
    for raw in (json.dumps(text, ensure_ascii=False), json.dumps(text, ensure_ascii=True)):
        body = ('{"model":"m","messages":[{"role":"user","content":' + raw + "}]}").encode()
        assert parse_request(CHAT, body).messages == [{"role": "user", "content": text}]


def test_escaped_backslash_before_d800_is_not_a_surrogate() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"\\\\ud800"}]}'
    assert parse_request(CHAT, body).messages[0]["content"] == "\\ud800"


def test_repr_hides_user_content() -> None:
    req = parse_request(CHAT, chat(messages=[{"role": "user", "content": "secret prompt"}]))
    assert "secret prompt" not in repr(req)


def test_parsed_request_is_frozen() -> None:
    req = parse_request(CHAT, chat())
    with pytest.raises(AttributeError):
        req.model = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------- rewriting


def test_force_usage_preserves_other_options_and_does_not_mutate() -> None:
    req = parse_request(
        CHAT, chat(stream=True, stream_options={"continuous_usage_stats": False, "x": 1})
    )
    original = json.dumps(req.body)
    out = rewrite_body(req.body, force_usage=True)
    assert json.loads(out)["stream_options"] == {
        "continuous_usage_stats": False,
        "x": 1,
        "include_usage": True,
    }
    assert json.dumps(req.body) == original  # the parsed body is untouched
    # The rewritten body is itself valid and now asks for usage.
    assert parse_request(CHAT, out).include_usage_requested is True


def test_force_usage_adds_stream_options_and_overrides_false() -> None:
    out = json.loads(rewrite_body(json.loads(chat(stream=True)), force_usage=True))
    assert out["stream_options"] == {"include_usage": True}
    body = json.loads(chat(stream=True, stream_options={"include_usage": False}))
    out = json.loads(rewrite_body(body, force_usage=True))
    assert out["stream_options"] == {"include_usage": True}


def test_force_usage_is_noop_without_stream() -> None:
    body = json.loads(chat())
    assert "stream_options" not in json.loads(rewrite_body(body, force_usage=True))


def test_output_is_compact_utf8() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "世界 🎉"}], "stream": True}
    out = rewrite_body(body, force_usage=True)
    assert (
        out
        == (
            '{"model":"m","messages":[{"role":"user","content":"世界 🎉"}],"stream":true,'
            '"stream_options":{"include_usage":true}}'
        ).encode()
    )


def test_rewrite_model() -> None:
    body = json.loads(chat())
    assert json.loads(rewrite_body(body, model="real-model"))["model"] == "real-model"
    assert body["model"] == "m"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"max_tokens": 9}),
        ({"max_tokens": 100}, {"max_tokens": 9}),
        ({"max_completion_tokens": 100}, {"max_completion_tokens": 9}),
        ({"max_completion_tokens": 100, "max_tokens": None},
         {"max_completion_tokens": 9, "max_tokens": None}),
        ({"max_completion_tokens": 100, "max_tokens": 50},
         {"max_completion_tokens": 9, "max_tokens": 9}),
    ],
)  # fmt: skip
def test_cap_max_tokens_chat(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    out = json.loads(rewrite_body(json.loads(chat(**fields)), max_tokens=9))
    for key in ("max_tokens", "max_completion_tokens"):
        assert out.get(key, "absent") == expected.get(key, "absent")


def test_cap_max_tokens_completions_always_uses_max_tokens() -> None:
    out = json.loads(rewrite_body(json.loads(comp(max_completion_tokens=100)), max_tokens=9))
    assert out["max_tokens"] == 9
    assert out["max_completion_tokens"] == 100


def test_rewrite_body_all_at_once() -> None:
    body = json.loads(chat(stream=True, max_tokens=1000))
    out = json.loads(rewrite_body(body, model="x", max_tokens=10, force_usage=True))
    assert (out["model"], out["max_tokens"], out["stream_options"]) == (
        "x",
        10,
        {"include_usage": True},
    )


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_rewrite_rejects_bad_max_tokens(bad: Any) -> None:
    with pytest.raises(ValueError):
        rewrite_body({"model": "m", "messages": []}, max_tokens=bad)


def test_rewrite_escapes_lone_surrogates_instead_of_failing() -> None:
    out = rewrite_body({"model": "m", "x": "\ud800"}, model="y")
    assert json.loads(out) == {"model": "y", "x": "\ud800"}
