"""Rerank and score requests (``/rerank``, ``/v1/rerank``, ``/v2/rerank``, ``/score``,
``/v1/score``), as vLLM 0.34 reads them, into the canonical ``pooling`` request.

A cross-encoder scores query-document pairs: each pair is one prompt the engine encodes and
answers with a score, generating nothing. vLLM pairs the inputs with its broadcasting rule
(one query against N documents, or N against N; ``Input lengths must be either 1:1, 1:N or
N:N``) and, for a model served with a score template (``--chat-template``, e.g. the
Qwen3-Reranker prompt), renders each pair as the two messages ``{"role": "query"}`` and
``{"role": "document"}`` through that template and tokenizes the text with the tokenizer's
special tokens. The canonical request carries the pairs (``score_pairs``) and the template
keywords (``instruction`` folded into ``chat_template_kwargs`` as vLLM does); admission
counts each pair with the model's template.

Rerank: ``query`` and ``documents`` (``top_n`` only shortens the answer). Score:
``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2`` or
``text_1``/``text_2``, each a string or a list of strings. Multimodal inputs (``{"content":
[...]}``) are refused: kvgate does not count them.
"""

from __future__ import annotations

from typing import Any, Final

from kvgate.openai import ParsedRequest
from kvgate.openai.errors import invalid_request
from kvgate.openai.requests import load_json_object
from kvgate.pooling.requests import MAX_INPUTS, parse_model, type_error, unsupported

RERANK_PATHS: Final = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS: Final = ("/score", "/v1/score")
# The field pairs a score body may use, in the order pydantic's union tries them.
_SCORE_FIELDS: Final = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
# Keywords vLLM refuses in chat_template_kwargs (they are the scorer's own arguments).
_RESERVED_KWARGS: Final = frozenset({"chat_template", "tools", "tokenize"})


def _texts(value: object, param: str) -> list[str]:
    """A ScoreInput or a list of them, as strings."""
    if type(value) is str:
        return [value]
    if type(value) is dict:
        raise unsupported(param, "it cannot count multimodal score inputs")
    if type(value) is not list:
        raise type_error(param, "a string or an array of strings", value)
    for i, item in enumerate(value):
        if type(item) is dict:
            raise unsupported(f"{param}[{i}]", "it cannot count multimodal score inputs")
        if type(item) is not str:
            raise type_error(f"{param}[{i}]", "a string", item)
    return value


def _pairs(first: list[str], second: list[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    """vLLM's pairing: 1:1, 1:N or N:N."""
    if not first:
        raise invalid_request("At least one text element must be given", names[0], "empty_array")
    if not second:
        raise invalid_request(
            "At least one text_pair element must be given", names[1], "empty_array"
        )
    if len(first) > 1 and len(first) != len(second):
        raise invalid_request(
            "Input lengths must be either 1:1, 1:N or N:N", names[0], "invalid_value"
        )
    if len(second) > MAX_INPUTS:
        raise invalid_request(
            f"Invalid '{names[1]}': at most {MAX_INPUTS} inputs per request, but got "
            f"{len(second)}.",
            names[1],
            "too_many_inputs",
        )
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second, strict=True))


def _opt_int(obj: dict[str, Any], key: str, minimum: int) -> None:
    value = obj.get(key)
    if value is None:
        return
    if type(value) is not int:
        raise type_error(key, "an integer", value)
    if value < minimum:
        raise invalid_request(
            f"Invalid '{key}': must be >= {minimum}, but got {value}.", key, "invalid_value"
        )


def _template_kwargs(obj: dict[str, Any]) -> dict[str, Any] | None:
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and type(kwargs) is not dict:
        raise type_error("chat_template_kwargs", "an object", kwargs)
    reserved = _RESERVED_KWARGS.intersection(kwargs or ())
    if reserved:
        raise invalid_request(
            "chat_template_kwargs contains reserved keys that conflict with fixed scorer "
            f"arguments: {sorted(reserved)}",
            "chat_template_kwargs",
            "invalid_value",
        )
    instruction = obj.get("instruction")
    if instruction is not None:
        if type(instruction) is not str:
            raise type_error("instruction", "a string", instruction)
        # vLLM: explicit chat_template_kwargs["instruction"] wins over the field.
        kwargs = dict(kwargs or {})
        kwargs.setdefault("instruction", instruction)
    return kwargs


def parse_scoring_request(path: str, body: bytes) -> ParsedRequest:
    """The canonical request of a rerank or score body; ``ApiError`` (400 naming the field)
    for one kvgate cannot accept."""
    route = path.partition("?")[0]
    obj = load_json_object(body)
    model = parse_model(obj)
    names: tuple[str, str]
    if route in RERANK_PATHS:
        names = ("query", "documents")
        for name in names:
            if obj.get(name) is None:
                raise invalid_request(
                    f"Missing required parameter: '{name}'.", name, "missing_required_parameter"
                )
        query = obj["query"]
        if type(query) is list:
            raise type_error("query", "a string", query)
        first = _texts(query, "query")
        _opt_int(obj, "top_n", 0)
    else:
        found = next((pair for pair in _SCORE_FIELDS if all(k in obj for k in pair)), None)
        if found is None:
            raise invalid_request(
                "Missing required parameters: 'text_1' and 'text_2' (or 'queries' and "
                "'documents').",
                "text_1",
                "missing_required_parameter",
            )
        names = found
        first = _texts(obj[names[0]], names[0])
    pairs = _pairs(first, _texts(obj[names[1]], names[1]), names)
    _opt_int(obj, "truncate_prompt_tokens", -1)
    _opt_int(obj, "max_tokens_per_query", 0)
    _opt_int(obj, "max_tokens_per_doc", 0)
    if obj.get("mm_processor_kwargs") is not None:
        raise unsupported("mm_processor_kwargs", "it cannot count multimodal inputs")
    if obj.get("padding") == "max_length":
        raise unsupported("padding", "it cannot count prompts padded to the model's length")
    kwargs = _template_kwargs(obj)
    truncate = obj.get("truncate_prompt_tokens")
    return ParsedRequest(
        kind="pooling",
        path=route,
        model=model,
        body=obj,
        chat_template_kwargs=kwargs,
        num_prompts=len(pairs),
        body_bytes=len(body),
        truncate_prompt_tokens=truncate,
        prompt_field=names[1],
        score_pairs=pairs,
    )


__all__ = ["RERANK_PATHS", "SCORE_PATHS", "parse_scoring_request"]
