"""Embeddings and pooling bodies: what kvgate accepts, the prompts it counts, and every
hostile body refused with a 400 naming the field before anything is reserved."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.lifecycle.protocol import ClientError
from kvgate.pooling import MAX_INPUTS
from kvgate.protocols import EMBEDDINGS, METERED_APIS, POOLING


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def refusal(raw: bytes) -> tuple[int, str | None, str]:
    with pytest.raises(ClientError) as refused:
        EMBEDDINGS.parse(raw)
    answer = json.loads(refused.value.answer.to_body())["error"]
    return refused.value.answer.status, answer["param"], answer["message"]


def test_both_paths_are_metered() -> None:
    assert METERED_APIS["/v1/embeddings"] is EMBEDDINGS
    assert METERED_APIS["/pooling"] is POOLING


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("hello", ["hello"]),
        (["a", "b", "c"], ["a", "b", "c"]),
        (["only"], ["only"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([[7]], [[7]]),
    ],
)
def test_each_input_is_one_prompt(value: Any, prompts: list[Any]) -> None:
    request = EMBEDDINGS.parse(body(input=value))
    assert request.kind == "pooling" and not request.generates
    assert request.prompts() == prompts
    assert request.num_prompts == len(prompts)
    assert request.max_new_tokens is None and request.num_sequences == len(prompts)
    assert request.prompt_param == "input"


def test_passed_through_fields_are_kept_as_sent() -> None:
    raw = body(input="x", dimensions=64, encoding_format="base64", user="u", priority=0)
    request = EMBEDDINGS.parse(raw)
    assert request.body["dimensions"] == 64 and request.body["encoding_format"] == "base64"
    assert request.truncate_prompt_tokens is None


def test_truncation_is_read() -> None:
    assert EMBEDDINGS.parse(body(input="x", truncate_prompt_tokens=7)).truncate_prompt_tokens == 7
    assert EMBEDDINGS.parse(body(input="x", truncate_prompt_tokens=-1)).truncate_prompt_tokens == -1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": [[1]] * (MAX_INPUTS + 1)}, "input"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": {"a": 1}}, "input"),
        ({"input": ["a", 1]}, "input[1]"),
        ({"input": [1, "a"]}, "input[1]"),
        ({"input": [1, -1]}, "input[1]"),
        ({"input": [[1], []]}, "input[1]"),
        ({"input": [[1], [2, -5]]}, "input[1][1]"),
        ({"input": [[1], [[2]]]}, "input[1][0]"),
        ({"input": [[1], "a"]}, "input[1]"),
        ({"input": [1.5]}, "input[0]"),
        ({"input": [True]}, "input[0]"),
        ({"input": [None]}, "input[0]"),
        ({"input": [{"role": "user", "content": "hi"}]}, "input"),
        ({"input": "x", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "x", "encoding_format": "bytes_only"}, "encoding_format"),
        ({"input": "x", "encoding_format": 3}, "encoding_format"),
        ({"input": "x", "dimensions": "64"}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"input": "x", "padding": "max_length"}, "padding"),
        ({"input": "x", "padding": "longest"}, "padding"),
        ({"input": "x", "truncation_side": "middle"}, "truncation_side"),
        ({"input": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"input": "x", "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
        ({"data": {"x": 1}}, "data"),
    ],
)
def test_hostile_bodies_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    status, named, _ = refusal(body(**fields))
    assert (status, named) == (400, param)


def test_model_is_required() -> None:
    assert refusal(json.dumps({"input": "x"}).encode())[:2] == (400, "model")
    assert refusal(json.dumps({"model": 3, "input": "x"}).encode())[:2] == (400, "model")


def test_the_ceiling_is_named_in_the_message() -> None:
    _, _, message = refusal(body(input=["x"] * (MAX_INPUTS + 1)))
    assert str(MAX_INPUTS) in message and str(MAX_INPUTS + 1) in message


def test_non_json_is_refused() -> None:
    assert refusal(b"not json")[0] == 400
    assert refusal(b"[1, 2]")[0] == 400
