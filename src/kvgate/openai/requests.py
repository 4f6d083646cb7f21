"""Parsing, validating and rewriting OpenAI-style request bodies.

kvgate sees the request body once (Envoy BUFFERED mode), must decide whether to
admit it, and may rewrite it (force ``stream_options.include_usage``, pin the
model, cap ``max_tokens``). This module is the single place that turns the raw
bytes into a typed :class:`ParsedRequest` or an OpenAI-shaped 400.

Validation is deliberately limited to what admission depends on (model, the
prompt or messages that get tokenized, how many tokens may be generated and how
many sequences) plus cheap structural checks that would otherwise crash later
stages. Sampling parameters (top_p, ...) are the engine's business, except the
few kvgate reads or that change what it meters: ``temperature`` (the response
cache serves only greedy requests), ``logprobs``/``top_logprobs`` (the answer's
size) and the shape of ``tools`` (rendered into the counted prompt). Their
types are checked here, so a request the engine would refuse anyway is a clear
400 naming the field before anything is reserved for it.

Parser-differential note: the engine re-parses whatever bytes are forwarded.
Inputs on which JSON parsers disagree (BOM, NaN/Infinity, lone surrogates,
out-of-range floats) are rejected here. Duplicate keys resolve last-wins as in
Python's json; forwarding the re-serialised body (:func:`rewrite_body`) removes
the remaining room for disagreement.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kvgate.tokenize.request_fields import REASONING_EFFORTS, with_request_fields

from .errors import ApiError, clip, invalid_request, unsupported_path

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "MAX_JSON_DEPTH",
    "ParsedRequest",
    "PromptBound",
    "RequestKind",
    "load_json_object",
    "parse_request",
    "prompt_lower_bound",
    "request_kind",
    "rewrite_body",
]

# "pooling": embeddings, pooling, score and rerank: prompts the engine encodes and answers
# with vectors or scores, generating nothing.
RequestKind = Literal["chat", "completion", "pooling"]
MaxTokensParam = Literal["max_tokens", "max_completion_tokens"]
Prompt = str | list[str] | list[int] | list[list[int]]

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
_ROUTES: Final[dict[str, RequestKind]] = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completion"}

#: Deepest JSON nesting accepted. Real requests stay far below (tool JSON schemas
#: reach ~10); the cap keeps recursive consumers (chat templates, re-serialisation)
#: safe from depth bombs that json.loads alone accepts up to ~1000 levels.
MAX_JSON_DEPTH: Final = 64
#: Upper bound for ``n`` / ``best_of`` (OpenAI documents 128): cost is multiplied by it.
MAX_N: Final = 128
#: Upper bound for max_tokens-like integers: keeps every later computation (Redis
#: Lua numbers are doubles, metrics) within exactly representable integers.
MAX_TOKENS_LIMIT: Final = 2**31 - 1
#: What OpenAI's legacy completions endpoint and vLLM use when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16

CHAT_ROLES: Final = ("system", "user", "assistant", "tool", "developer", "function")
_CHAT_ROLE_SET: Final = frozenset(CHAT_ROLES)
_ROLES_TEXT: Final = ", ".join(f"'{r}'" for r in CHAT_ROLES[:-1]) + f", and '{CHAT_ROLES[-1]}'"

_INVALID_JSON: Final = "invalid_json"
_BOM: Final = b"\xef\xbb\xbf"


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated chat or completions request.

    The containers (``body``, ``messages``, ...) are the parsed JSON itself, not
    copies: treat them as read-only. Fields holding user content are left out of
    ``repr`` so that logging a request never logs a prompt.
    """

    kind: RequestKind
    path: str  # route without the query string
    model: str
    body: dict[str, Any] = field(repr=False)  # the whole parsed body, for rewriting
    messages: list[dict[str, Any]] | None = field(default=None, repr=False)  # chat only
    prompt: Prompt | None = field(default=None, repr=False)  # completions only
    tools: list[dict[str, Any]] | None = field(default=None, repr=False)
    chat_template_kwargs: dict[str, Any] | None = field(default=None, repr=False)
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False  # vLLM extension
    stream: bool = False
    include_usage_requested: bool = False  # the client itself asked for the usage event
    #: Cap on generated tokens *per sequence*, as the engine will apply it;
    #: None = no cap (the engine generates up to the context limit).
    max_new_tokens: int | None = None
    #: Which field the client used for it (None: neither was given).
    max_tokens_param: MaxTokensParam | None = None
    n: int = 1
    best_of: int | None = None
    #: Prompts in the request: >1 only for a completions batch (list of prompts).
    num_prompts: int = 1
    echo: bool = False
    #: vLLM's min_tokens: the engine generates at least this many tokens.
    min_tokens: int = 0
    #: The body's size in bytes: what counting it costs, for fair scheduling.
    body_bytes: int = 0
    #: Both max_tokens and max_completion_tokens were sent, with different values (engines
    #: differ in which one they read, so both are rewritten to the reserved cap).
    conflicting_caps: bool = False
    #: vLLM's truncate_prompt_tokens on a pooling request: the engine keeps at most this
    #: many tokens of each prompt (-1: the model's context). None: no truncation.
    truncate_prompt_tokens: int | None = None
    #: The field a refusal about the prompt names, when the API's is neither chat's nor
    #: completions' (a pooling API's "input", "documents"...).
    prompt_field: str | None = None
    #: A rerank or score request's (query, document) pairs: one prompt each, rendered with
    #: the model's score template (``prompt`` is None then).
    score_pairs: list[tuple[str, str]] | None = field(default=None, repr=False)

    @property
    def generates(self) -> bool:
        """Whether the engine generates tokens for it (a pooling request only encodes its
        prompts: no output is reserved, capped or charged)."""
        return self.kind != "pooling"

    @property
    def prompt_param(self) -> str:
        """The field a refusal about the prompt names (its length, its rendering)."""
        if self.prompt_field is not None:
            return self.prompt_field
        return "messages" if self.kind == "chat" else "prompt"

    def prompts(self) -> list[str | list[int]]:
        """A completions request's prompts, one per generation the engine runs."""
        prompt = self.prompt
        if prompt is None:
            return []
        if type(prompt) is str or self.num_prompts == 1:
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def num_sequences(self) -> int:
        """Sequences the engine will generate: the multiplier for output-token cost.

        OpenAI/vLLM generate ``n`` (or ``best_of`` >= n) sequences per prompt.
        """
        per_prompt = self.n if self.best_of is None else max(self.n, self.best_of)
        return self.num_prompts * per_prompt


# --------------------------------------------------------------------------- JSON


class _NonFiniteNumber(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    # json accepts NaN/Infinity/-Infinity by default; JSON (and OpenAI) do not.
    raise _NonFiniteNumber(name)


def _parse_float(text: str) -> float:
    value = float(text)
    # 1e400 is valid JSON but becomes inf, which json.dumps would re-emit as the
    # non-JSON token Infinity when the body is rewritten.
    if math.isinf(value):
        raise _NonFiniteNumber(text)
    return value


# One decoder reused: json.loads(**kw) would build a new one per call.
_DECODER: Final = json.JSONDecoder(parse_float=_parse_float, parse_constant=_reject_constant)
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_ASCII_ENCODER: Final = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
# A \uD800-\uDFFF escape: only way a lone surrogate can enter after strict UTF-8 decoding.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")


def _exceeds_depth(root: dict[str, Any] | list[Any], limit: int) -> bool:
    # Iterative on purpose: a recursive walk is exactly what a depth bomb attacks.
    stack: list[tuple[Any, int]] = [(root, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        for child in node.values() if type(node) is dict else node:
            kind = type(child)
            if kind is dict or kind is list:
                if depth >= limit:
                    return True
                push((child, depth + 1))
    return False


def _has_lone_surrogate(obj: Any) -> bool:
    try:
        _ENCODER.encode(obj).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def load_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be one strict-JSON object.

    Raises :class:`ApiError` (400, code ``invalid_json``) for: an empty body, a
    UTF-8 BOM, bytes that are not UTF-8, syntax errors, NaN/Infinity or floats
    that overflow, nesting deeper than :data:`MAX_JSON_DEPTH`, escaped lone
    surrogates (no tokenizer or UTF-8 encoder accepts them), or a top level that
    is not an object (code ``invalid_type``).
    """
    if not body or body.isspace():
        raise invalid_request("Request body is empty; expected a JSON object.", code=_INVALID_JSON)
    if body.startswith(_BOM):
        # Python's json and most engines reject it; stripping it here would make
        # kvgate accept bodies the upstream then refuses.
        raise invalid_request(
            "Request body must not start with a byte order mark (BOM).", code=_INVALID_JSON
        )
    try:
        # Decode explicitly: json.loads(bytes) would also guess UTF-16/32.
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(
            f"Request body is not valid UTF-8 (invalid byte at offset {exc.start}).",
            code=_INVALID_JSON,
        ) from None
    try:
        obj = _DECODER.decode(text)
    except _NonFiniteNumber:
        raise invalid_request(
            "Request body contains a non-finite number (NaN, Infinity or a value out of "
            "range); JSON numbers must be finite.",
            code=_INVALID_JSON,
        ) from None
    except RecursionError:
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno}).",
            code=_INVALID_JSON,
        ) from None
    except ValueError:
        # e.g. an integer literal beyond Python's 4300-digit conversion limit.
        raise invalid_request(
            "We could not parse the JSON body of your request: a number is too large.",
            code=_INVALID_JSON,
        ) from None
    if type(obj) is not dict:
        raise invalid_request(
            f"Request body must be a JSON object, but got {_json_type(obj)}.", code="invalid_type"
        )
    # Nesting depth is bounded by the bracket count: skip the walk for the
    # common small body (counting is a C-speed memchr loop).
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _exceeds_depth(obj, MAX_JSON_DEPTH):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text) is not None and _has_lone_surrogate(obj):
        raise invalid_request(
            "Request body contains an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF); "
            "strings must be valid Unicode.",
            code=_INVALID_JSON,
        )
    return obj


def _too_deep() -> ApiError:
    return invalid_request(
        f"Request body nests JSON deeper than {MAX_JSON_DEPTH} levels.", code=_INVALID_JSON
    )


# --------------------------------------------------------------------------- field helpers


def _json_type(value: object) -> str:
    # Names as OpenAI's messages use them ("expected an integer, but got a string").
    if value is None:
        return "null"
    kind = type(value)
    if kind is bool:
        return "a boolean"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a decimal number"
    if kind is str:
        return "a string"
    if kind is list:
        return "an array"
    if kind is dict:
        return "an object"
    return "an unsupported value"


def _type_error(param: str, expected: str, value: object) -> ApiError:
    return invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
        param,
        "invalid_type",
    )


def _missing(param: str) -> ApiError:
    return invalid_request(
        f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    )


def _empty_array(param: str) -> ApiError:
    return invalid_request(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got "
        f"an empty array instead.",
        param,
        "empty_array",
    )


def _opt_bool(obj: dict[str, Any], key: str, default: bool) -> bool:
    value = obj.get(key)
    if value is None:  # absent or null: OpenAI's nullable parameters mean "default"
        return default
    if type(value) is not bool:
        raise _type_error(key, "a boolean", value)
    return value


def _opt_int(
    obj: dict[str, Any], key: str, minimum: int, maximum: int, param: str | None = None
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    param = param or key
    # `type(...) is int` on purpose: bool is an int subclass and true/false must
    # not pass as 1/0; a float like 100.0 is rejected as OpenAI does.
    if type(value) is not int:
        raise _type_error(param, "an integer", value)
    if value < minimum:
        raise invalid_request(
            f"Invalid '{param}': integer below minimum value. Expected a value >= {minimum}, "
            f"but got {value} instead.",
            param,
            "integer_below_min_value",
        )
    if value > maximum:
        raise invalid_request(
            f"Invalid '{param}': integer above maximum value. Expected a value <= {maximum}, "
            f"but got {clip(value, 24)} instead.",
            param,
            "integer_above_max_value",
        )
    return value


def _opt_number(obj: dict[str, Any], key: str, minimum: float) -> None:
    value = obj.get(key)
    if value is None:
        return
    kind = type(value)
    if kind is not int and kind is not float:
        raise _type_error(key, "a number", value)
    if value < minimum:
        raise invalid_request(
            f"Invalid '{key}': decimal below minimum value. Expected a value >= {minimum:g}, "
            f"but got {clip(value, 24)} instead.",
            key,
            "decimal_below_min_value",
        )


def _opt_object(obj: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not dict:
        raise _type_error(key, "an object", value)
    return value


def _reasoning_effort(obj: dict[str, Any]) -> str | None:
    value = obj.get("reasoning_effort")
    if value is None:
        return None
    if type(value) is not str:
        raise _type_error("reasoning_effort", "a string", value)
    if value not in REASONING_EFFORTS:
        raise invalid_request(
            f"Invalid value for 'reasoning_effort': expected one of "
            f"{', '.join(REASONING_EFFORTS)}, but got '{clip(value)}'.",
            "reasoning_effort",
            "invalid_value",
        )
    return value


def _list_of_objects(value: object, param: str) -> list[dict[str, Any]]:
    if type(value) is not list:
        raise _type_error(param, "an array", value)
    for i, item in enumerate(value):
        if type(item) is not dict:
            raise _type_error(f"{param}[{i}]", "an object", item)
    return value


def _tools(value: object) -> list[dict[str, Any]]:
    """A chat request's tools: the chat template renders them into the counted prompt, and
    a function tool the engine cannot read (no name) it refuses after kvgate reserved."""
    tools = _list_of_objects(value, "tools")
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type", "function")
        if type(kind) is not str:
            raise _type_error(f"{param}.type", "a string", kind)
        if kind != "function":
            continue  # other tool kinds are the engine's to accept or refuse
        function = tool.get("function")
        if function is None:
            raise _missing(f"{param}.function")
        if type(function) is not dict:
            raise _type_error(f"{param}.function", "an object", function)
        name = function.get("name")
        if name is None:
            raise _missing(f"{param}.function.name")
        if type(name) is not str:
            raise _type_error(f"{param}.function.name", "a string", name)
        for key, expected in (("description", str), ("parameters", dict)):
            field_value = function.get(key)
            if field_value is not None and type(field_value) is not expected:
                what = "a string" if expected is str else "an object"
                raise _type_error(f"{param}.function.{key}", what, field_value)
    return tools


def _sampling(obj: dict[str, Any], kind: RequestKind) -> None:
    """The sampling fields kvgate reads or whose size it meters: their types and ranges.
    -1 for a logprobs count is vLLM's "the whole vocabulary"."""
    _opt_number(obj, "temperature", 0)
    if kind == "chat":
        _opt_bool(obj, "logprobs", False)
        _opt_int(obj, "top_logprobs", -1, MAX_TOKENS_LIMIT)
    else:
        _opt_int(obj, "logprobs", -1, MAX_TOKENS_LIMIT)


# --------------------------------------------------------------------------- sections


def _model(obj: dict[str, Any]) -> str:
    model = obj.get("model")
    if model is None:
        raise _missing("model")
    if type(model) is not str:
        raise _type_error("model", "a string", model)
    if not model:
        raise invalid_request(
            "Invalid 'model': empty string. Expected a model name.", "model", "invalid_value"
        )
    return model


def _stream_options(obj: dict[str, Any], stream: bool) -> bool:
    """Validate stream_options; return whether the client asked for the usage event."""
    options = _opt_object(obj, "stream_options")
    if options is None:
        return False
    if not stream:
        # OpenAI and vLLM both refuse this; refusing it here avoids charging a
        # request the engine will reject.
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )
    for key in ("include_usage", "continuous_usage_stats"):  # the latter: vLLM extension
        value = options.get(key)
        if value is not None and type(value) is not bool:
            raise _type_error(f"stream_options.{key}", "a boolean", value)
    return options.get("include_usage") is True


def _content(msg: dict[str, Any], param: str, role: str) -> None:
    content = msg.get("content")
    if content is None:
        # An assistant turn that only calls tools has no content (OpenAI allows
        # null/absent); the deprecated function role allows null too.
        if role == "function" or (
            role == "assistant" and (msg.get("tool_calls") or msg.get("function_call"))
        ):
            return
        if "content" not in msg:
            raise _missing(param)
        raise _type_error(param, "a string or an array of content parts", None)
    if type(content) is str:
        return
    if type(content) is not list:
        raise _type_error(param, "a string or an array of content parts", content)
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if type(part) is not dict:
            raise _type_error(part_param, "an object", part)
        part_type = part.get("type")
        if part_type is None:
            raise _missing(f"{part_param}.type")
        if type(part_type) is not str:
            raise _type_error(f"{part_param}.type", "a string", part_type)
        if part_type == "image_url":
            # Counted by the model's image rule (a model without one refuses it there).
            image = part.get("image_url")
            if type(image) is not dict:
                if image is None:
                    raise _missing(f"{part_param}.image_url")
                raise _type_error(f"{part_param}.image_url", "an object", image)
            url = image.get("url")
            if type(url) is not str:
                if url is None:
                    raise _missing(f"{part_param}.image_url.url")
                raise _type_error(f"{part_param}.image_url.url", "a string", url)
            continue
        if part_type != "text":
            # Audio, video, files: admitted they would be at an unknown cost.
            raise invalid_request(
                f"Invalid value: '{clip(part_type)}'. Supported values are: 'text' and "
                "'image_url' (audio, video and file parts are not supported).",
                f"{part_param}.type",
                "invalid_value",
            )
        text = part.get("text")
        if type(text) is not str:
            if text is None:
                raise _missing(f"{part_param}.text")
            raise _type_error(f"{part_param}.text", "a string", text)


def _messages(obj: dict[str, Any]) -> list[dict[str, Any]]:
    messages = obj.get("messages")
    if messages is None:
        raise _missing("messages")
    if type(messages) is not list:
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise _empty_array("messages")
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if type(msg) is not dict:
            raise _type_error(param, "an object", msg)
        role = msg.get("role")
        if role is None:
            raise _missing(f"{param}.role")
        if type(role) is not str:
            raise _type_error(f"{param}.role", "a string", role)
        if role not in _CHAT_ROLE_SET:
            raise invalid_request(
                f"Invalid value: '{clip(role)}'. Supported values are: {_ROLES_TEXT}.",
                f"{param}.role",
                "invalid_value",
            )
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            _list_of_objects(tool_calls, f"{param}.tool_calls")
        for key in ("name", "tool_call_id"):
            value = msg.get(key)
            if value is not None and type(value) is not str:
                raise _type_error(f"{param}.{key}", "a string", value)
        _content(msg, f"{param}.content", role)
    return messages


def _token_ids(ids: list[Any], param: str) -> None:
    # map/set/min run in C: ~10 ns per id, so 100k-token prompts stay cheap.
    if set(map(type, ids)) == {int} and min(ids) >= 0:
        return
    for i, token in enumerate(ids):
        if type(token) is not int:
            raise _type_error(f"{param}[{i}]", "an integer token id", token)
        if token < 0:
            raise invalid_request(
                f"Invalid '{param}[{i}]': token ids must be >= 0, but got {token}.",
                f"{param}[{i}]",
                "invalid_value",
            )


_PROMPT_TYPES: Final = (
    "a string, an array of strings, an array of token ids or an array of token-id arrays"
)


def _prompt(obj: dict[str, Any]) -> tuple[Prompt, int]:
    """Validate the completions prompt; return it and how many prompts it holds."""
    prompt = obj.get("prompt")
    if prompt is None:
        raise _missing("prompt")
    if type(prompt) is str:
        return prompt, 1
    if type(prompt) is not list:
        raise _type_error("prompt", _PROMPT_TYPES, prompt)
    if not prompt:
        raise _empty_array("prompt")
    first = type(prompt[0])
    if first is str:
        for i, item in enumerate(prompt):
            if type(item) is not str:
                raise _type_error(f"prompt[{i}]", "a string", item)
        return prompt, len(prompt)
    if first is int:
        _token_ids(prompt, "prompt")
        return prompt, 1
    if first is list:
        for i, item in enumerate(prompt):
            if type(item) is not list:
                raise _type_error(f"prompt[{i}]", "an array of token ids", item)
            if not item:
                raise _empty_array(f"prompt[{i}]")
            _token_ids(item, f"prompt[{i}]")
        return prompt, len(prompt)
    raise _type_error("prompt[0]", "a string, a token id or an array of token ids", prompt[0])


# --------------------------------------------------------------------------- entry point


def request_kind(path: str) -> RequestKind | None:
    """The endpoint kind for an HTTP ``:path`` (query string ignored), or None."""
    return _ROUTES.get(path.partition("?")[0])


# vLLM extension fields that change how the prompt is rendered in ways kvgate does not
# reproduce. Accepting them would let a request be counted with one template and run with
# another, i.e. slip past the KV and token budgets, so they are refused outright.
_UNCOUNTABLE_COMPLETION_FIELDS = {
    "prompt_embeds": "prompt embeddings",
    "multi_modal_data": "multimodal inputs",
}
# Fields that make the engine hold more sequences than n / best_of say.
_UNBOUNDED_FIELDS = {
    "use_beam_search": "beam search keeps more candidate sequences than it returns",
}

_UNCOUNTABLE_CHAT_FIELDS = {
    "chat_template": "a per-request chat template",
    "documents": "documents rendered by the chat template",
    "mm_processor_kwargs": "multimodal processor arguments",
}


def _refuse_uncountable_chat_fields(obj: dict[str, Any]) -> None:
    for name, what in _UNCOUNTABLE_CHAT_FIELDS.items():
        if obj.get(name) is not None:
            raise invalid_request(
                f"'{name}' is not supported by this gateway: it cannot count the tokens of {what}.",
                name,
                "unsupported_parameter",
            )
    if obj.get("add_special_tokens") not in (None, False):
        raise invalid_request(
            "'add_special_tokens' is not supported on chat requests by this gateway.",
            "add_special_tokens",
            "unsupported_parameter",
        )


def _refuse_fields(obj: dict[str, Any], fields: dict[str, str]) -> None:
    for name, what in fields.items():
        value = obj.get(name)
        if value is not None and value is not False:
            raise invalid_request(
                f"'{name}' is not supported by this gateway: it cannot meter {what}.",
                name,
                "unsupported_parameter",
            )


def parse_request(path: str, body: bytes) -> ParsedRequest:
    """Parse and validate a body for ``/v1/chat/completions`` or ``/v1/completions``.

    Raises :class:`ApiError`: 404 ``unsupported_path`` for any other path, 400
    for anything invalid (with ``param`` naming the offending field).
    """
    route = path.partition("?")[0]
    kind = _ROUTES.get(route)
    if kind is None:
        raise unsupported_path(path)
    obj = load_json_object(body)
    model = _model(obj)
    stream = _opt_bool(obj, "stream", False)
    include_usage = _stream_options(obj, stream)
    n = _opt_int(obj, "n", 1, MAX_N) or 1
    best_of = _opt_int(obj, "best_of", 1, MAX_N)
    if best_of is not None and best_of < n:
        raise invalid_request(
            f"Invalid 'best_of': must be greater than or equal to 'n' ({n}), but got {best_of}.",
            "best_of",
            "invalid_value",
        )
    echo = _opt_bool(obj, "echo", False)
    _sampling(obj, kind)
    _refuse_fields(obj, _UNBOUNDED_FIELDS)
    min_tokens = _opt_int(obj, "min_tokens", 0, MAX_TOKENS_LIMIT) or 0

    max_tokens = _opt_int(obj, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if kind == "chat":
        messages = _messages(obj)
        tools_raw = obj.get("tools")
        tools = None if tools_raw is None else _tools(tools_raw)
        _refuse_uncountable_chat_fields(obj)
        add_generation_prompt = _opt_bool(obj, "add_generation_prompt", True)
        continue_final_message = _opt_bool(obj, "continue_final_message", False)
        if add_generation_prompt and continue_final_message:
            # vLLM refuses the combination (the template cannot do both).
            raise invalid_request(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
                "continue_final_message",
                "invalid_value",
            )
        max_completion = _opt_int(obj, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
        # The newer name wins, as in OpenAI and vLLM.
        param: MaxTokensParam | None
        if max_completion is not None:
            max_new, param = max_completion, "max_completion_tokens"
        elif max_tokens is not None:
            max_new, param = max_tokens, "max_tokens"
        else:
            max_new, param = None, None
        return ParsedRequest(
            kind=kind,
            path=route,
            model=model,
            body=obj,
            messages=messages,
            tools=tools,
            # vLLM hands the template reasoning_effort (and a thinking switch) with these.
            chat_template_kwargs=with_request_fields(
                _opt_object(obj, "chat_template_kwargs"), reasoning_effort=_reasoning_effort(obj)
            ),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            stream=stream,
            include_usage_requested=include_usage,
            max_new_tokens=max_new,
            max_tokens_param=param,
            n=n,
            best_of=best_of,
            echo=echo,
            min_tokens=min_tokens,
            body_bytes=len(body),
            conflicting_caps=(
                max_completion is not None
                and max_tokens is not None
                and max_completion != max_tokens
            ),
        )

    _refuse_fields(obj, _UNCOUNTABLE_COMPLETION_FIELDS)
    prompt, num_prompts = _prompt(obj)
    # The completions endpoint has no max_completion_tokens (vLLM ignores it) and
    # defaults max_tokens to 16 when absent; an explicit null means "no cap".
    if "max_tokens" not in obj:
        max_new_c: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        max_new_c = max_tokens
    return ParsedRequest(
        kind=kind,
        path=route,
        model=model,
        body=obj,
        prompt=prompt,
        stream=stream,
        include_usage_requested=include_usage,
        max_new_tokens=max_new_c,
        max_tokens_param="max_tokens" if max_tokens is not None else None,
        n=n,
        best_of=best_of,
        num_prompts=num_prompts,
        echo=echo,
        min_tokens=min_tokens,
        body_bytes=len(body),
    )


# --------------------------------------------------------------------------- size bound


@dataclass(frozen=True, slots=True)
class PromptBound:
    """Prompt tokens a request needs at least: in all, and for its longest prompt."""

    total: int
    longest: int
    exact: bool = False  # token-id prompts are counted exactly


def _text_chars(value: Any) -> int:
    if type(value) is str:
        return len(value)
    if type(value) is list:  # content parts
        return sum(len(part.get("text") or "") for part in value if type(part) is dict)
    return 0


def prompt_lower_bound(request: ParsedRequest, max_token_chars: int) -> PromptBound:
    """A lower bound on the prompt's tokens from its text length alone (no tokenizing):
    no token covers more than ``max_token_chars`` characters. Costs one pass over the
    messages, not over their text (``len`` of a str is O(1))."""
    if request.kind == "chat":
        chars = sum(_text_chars(m.get("content")) for m in request.messages or ())
        tokens = max(1, -(-chars // max_token_chars))
        return PromptBound(total=tokens, longest=tokens)
    counts: list[int] = []
    exact = True
    for prompt in request.prompts():
        if type(prompt) is str:
            exact = False
            counts.append(max(1, -(-len(prompt) // max_token_chars)))
        else:
            counts.append(len(prompt))
    if not counts:
        return PromptBound(total=1, longest=1)
    keep = request.truncate_prompt_tokens
    if keep is not None and keep >= 0:
        # The engine truncates each prompt to `keep` tokens before it checks its length.
        counts = [min(count, keep) for count in counts]
    return PromptBound(total=sum(counts), longest=max(counts), exact=exact)


# --------------------------------------------------------------------------- rewriting


def _dump(body: dict[str, Any]) -> bytes:
    text = _ENCODER.encode(body)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Only reachable for dicts not produced by load_json_object (which rejects
        # lone surrogates): \u-escape them rather than emit invalid UTF-8.
        return _ASCII_ENCODER.encode(body).encode("ascii")


def _max_token_keys(body: dict[str, Any]) -> tuple[str, ...]:
    if "messages" not in body:
        # Completions honour only max_tokens.
        return ("max_tokens",)
    used = tuple(k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None)
    # If both were sent, cap both: engines differ in which one they read.
    return used or ("max_tokens",)


def rewrite_body(
    body: dict[str, Any],
    *,
    model: str | None = None,
    max_tokens: int | None = None,
    force_usage: bool = False,
) -> bytes:
    """Serialise ``body`` once with any of the rewrites applied (compact UTF-8 JSON).

    - ``model``: replace the model name.
    - ``max_tokens``: cap generation; sets whichever of ``max_tokens`` /
      ``max_completion_tokens`` the client used (both if both), else ``max_tokens``.
    - ``force_usage``: set ``stream_options.include_usage = true`` keeping the
      other stream options; ignored unless ``stream`` is true (the engine rejects
      stream_options on non-streaming requests).

    ``body`` itself is not modified (only shallow copies are changed).
    """
    out = dict(body)
    if model is not None:
        out["model"] = model
    if max_tokens is not None:
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        for key in _max_token_keys(body):
            out[key] = max_tokens
    if force_usage and out.get("stream") is True:
        options = out.get("stream_options")
        options = dict(options) if type(options) is dict else {}
        options["include_usage"] = True
        out["stream_options"] = options
    return _dump(out)
