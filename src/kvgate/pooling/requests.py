"""Embeddings and pooling requests (``POST /v1/embeddings``, ``POST /pooling``), as vLLM
0.34 reads them: validation and the canonical request admission counts.

The engine encodes each ``input`` as a completions prompt (a string with the tokenizer's
special tokens unless ``add_special_tokens`` is false, token ids as given), truncates it to
``truncate_prompt_tokens`` when asked, refuses one longer than the model's context, and
generates nothing: the canonical request is a ``pooling`` request whose prompts are the
inputs, reserved with no output tokens. The body is forwarded untouched (``model``
aside, for a budget fallback): there is no output cap to write.

Refused here, each with a 400 naming the field: what kvgate cannot count or meter
(the chat form, ``padding: "max_length"``, plug-in ``data``, multimodal arguments, an
answer in raw bytes) and what an abusive client sends to make one request huge (more
than ``MAX_INPUTS`` inputs, nested junk, negative token ids). Types vLLM's pydantic
models would refuse are refused here too, before anything is reserved.
"""

from __future__ import annotations

from typing import Any, Final

from kvgate.openai import ParsedRequest
from kvgate.openai.errors import ApiError, invalid_request
from kvgate.openai.requests import load_json_object

EMBEDDINGS_PATH: Final = "/v1/embeddings"
POOLING_PATH: Final = "/pooling"

#: The most inputs a body may carry, whatever the configuration: the ceiling of
#: server.max_pooling_inputs (2048 by default), which admission applies.
MAX_INPUTS: Final = 65536
#: encoding_format values whose answer is JSON with its usage. vLLM's "bytes" and
#: "bytes_only" answer raw bytes, whose usage kvgate cannot read.
_JSON_FORMATS: Final = frozenset({"float", "base64"})

_INPUT_TYPES: Final = (
    "a string, an array of strings, an array of token ids or an array of token-id arrays"
)


def _describe(value: object) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a decimal number"}
    kinds |= {str: "a string", list: "an array", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), "an unsupported value")


def type_error(param: str, expected: str, value: object) -> ApiError:
    return invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {_describe(value)} instead.",
        param,
        "invalid_type",
    )


def unsupported(name: str, why: str) -> ApiError:
    return invalid_request(
        f"'{name}' is not supported by this gateway: {why}.", name, "unsupported_parameter"
    )


def _token_ids(ids: list[Any], param: str) -> None:
    if set(map(type, ids)) == {int} and min(ids) >= 0:
        return
    for i, token in enumerate(ids):
        if type(token) is not int:
            raise type_error(f"{param}[{i}]", "an integer token id", token)
        if token < 0:
            raise invalid_request(
                f"Invalid '{param}[{i}]': token ids must be >= 0, but got {token}.",
                f"{param}[{i}]",
                "invalid_value",
            )


def _too_many(count: int, param: str) -> ApiError:
    return invalid_request(
        f"Invalid '{param}': at most {MAX_INPUTS} inputs per request, but got {count}.",
        param,
        "too_many_inputs",
    )


def parse_inputs(value: object, param: str = "input") -> tuple[list[str] | list[list[int]], bool]:
    """The prompts of an ``input`` (one per embedding) and whether they are token ids.

    vLLM's union ``list[int] | list[list[int]] | str | list[str]``: a list mixing kinds is
    refused, an empty list or empty token list too (the engine has no prompt to encode)."""
    if type(value) is str:
        return [value], False
    if type(value) is not list:
        raise type_error(param, _INPUT_TYPES, value)
    if not value:
        raise invalid_request(
            f"Invalid '{param}': empty array. Expected at least one input.", param, "empty_array"
        )
    first = type(value[0])
    if first is int:
        _token_ids(value, param)
        return [value], True
    if len(value) > MAX_INPUTS:
        raise _too_many(len(value), param)
    if first is str:
        for i, item in enumerate(value):
            if type(item) is not str:
                raise type_error(f"{param}[{i}]", "a string", item)
        return value, False
    if first is list:
        for i, item in enumerate(value):
            if type(item) is not list:
                raise type_error(f"{param}[{i}]", "an array of token ids", item)
            if not item:
                raise invalid_request(
                    f"Invalid '{param}[{i}]': empty array. Expected at least one token id.",
                    f"{param}[{i}]",
                    "empty_array",
                )
            _token_ids(item, f"{param}[{i}]")
        return value, True
    if first is dict:
        raise unsupported(param, "it cannot count chat conversations given as embedding inputs yet")
    raise type_error(f"{param}[0]", "a string, a token id or an array of token ids", value[0])


def parse_model(obj: dict[str, Any]) -> str:
    model = obj.get("model")
    if model is None:
        # vLLM would serve its default model; kvgate must know which model it reserves on.
        raise invalid_request(
            "Missing required parameter: 'model'.", "model", "missing_required_parameter"
        )
    if type(model) is not str:
        raise type_error("model", "a string", model)
    if not model:
        raise invalid_request(
            "Invalid 'model': empty string. Expected a model name.", "model", "invalid_value"
        )
    return model


def _opt_int(obj: dict[str, Any], key: str, minimum: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not int:
        raise type_error(key, "an integer", value)
    if value < minimum:
        raise invalid_request(
            f"Invalid '{key}': must be >= {minimum}, but got {value}.", key, "invalid_value"
        )
    return value


def _opt_choice(obj: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not str or value not in allowed:
        names = ", ".join(f"'{a}'" for a in allowed)
        raise invalid_request(f"Invalid '{key}': expected one of {names}.", key, "invalid_value")
    return value


def parse_pooling_request(path: str, body: bytes) -> ParsedRequest:
    """The canonical request of an embeddings or pooling body; ``ApiError`` (400 naming
    the field) for one kvgate cannot accept."""
    obj = load_json_object(body)
    model = parse_model(obj)
    if obj.get("messages") is not None:
        raise unsupported("messages", "it cannot count chat conversations given as inputs yet")
    if obj.get("data") is not None:
        raise unsupported("data", "it cannot count what an input plug-in makes of its data")
    if "input" not in obj or obj["input"] is None:
        raise invalid_request(
            "Missing required parameter: 'input'.", "input", "missing_required_parameter"
        )
    prompts, _ = parse_inputs(obj["input"])
    encoding = obj.get("encoding_format")
    if encoding is not None:
        if type(encoding) is not str:
            raise type_error("encoding_format", "a string", encoding)
        if encoding not in _JSON_FORMATS:
            raise invalid_request(
                f"Invalid 'encoding_format': '{encoding[:32]}' is not supported by this gateway "
                "(it meters JSON answers only); use 'float' or 'base64'.",
                "encoding_format",
                "invalid_value",
            )
    _opt_int(obj, "dimensions", 1)
    truncate = _opt_int(obj, "truncate_prompt_tokens", -1)
    _opt_choice(obj, "truncation_side", ("left", "right"))
    if _opt_choice(obj, "padding", ("max_length", "do_not_pad")) == "max_length":
        raise unsupported("padding", "it cannot count prompts padded to the model's length")
    special = obj.get("add_special_tokens")
    if special is not None and type(special) is not bool:
        raise type_error("add_special_tokens", "a boolean", special)
    if obj.get("mm_processor_kwargs") is not None:
        raise unsupported("mm_processor_kwargs", "it cannot count multimodal inputs")
    return ParsedRequest(
        kind="pooling",
        path=path.partition("?")[0],
        model=model,
        body=obj,
        prompt=prompts[0] if len(prompts) == 1 else prompts,
        num_prompts=len(prompts),
        body_bytes=len(body),
        truncate_prompt_tokens=truncate,
        prompt_field="input",
    )
