"""Request parsing with vLLM's error statuses and shapes.

vLLM rejects a request in one of two ways:

* FastAPI/pydantic validation (bad JSON, wrong types, model validators) -> 400 with
  ``type: "Bad Request"`` and the stringified error list as the message;
* the serving layer (unknown model, too long, bad sampling params) -> 400
  ``BadRequestError`` or 404 ``NotFoundError``.

The pydantic messages are reproduced for the common cases only; their exact wording
depends on the FastAPI/pydantic versions vLLM is installed with.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from vllm_sim import protocol
from vllm_sim.tokenization import REASONING_EFFORTS, ChatMessages


class RequestError(Exception):
    """A request vLLM would refuse; carries the exact status and body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> RequestError:
        return cls(400, protocol.error_body(message, "BadRequestError", 400, param))

    @classmethod
    def not_found(cls, message: str) -> RequestError:
        return cls(404, protocol.error_body(message, "NotFoundError", 404))

    @classmethod
    def validation(cls, errors: list[Any]) -> RequestError:
        return cls(400, protocol.request_validation_error(errors))


def _loc(*parts: Any) -> tuple[Any, ...]:
    return ("body", *parts)


def _type_error(kind: str, msg: str, loc: tuple[Any, ...], value: Any) -> RequestError:
    return RequestError.validation([{"type": kind, "loc": loc, "msg": msg, "input": value}])


def _value_error(message: str, body: Any) -> RequestError:
    return RequestError.validation(
        [
            {
                "type": "value_error",
                "loc": ("body",),
                "msg": f"Value error, {message}",
                "input": body,
                "ctx": {"error": ValueError(message)},
            }
        ]
    )


def parse_json_body(raw: bytes, content_type: str) -> dict[str, Any]:
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestError.validation(
            ["Unsupported Media Type: Only 'application/json' is allowed"]
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        reason = getattr(exc, "msg", str(exc))
        raise RequestError.validation(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": reason},
                }
            ]
        ) from exc
    if not isinstance(body, dict):
        raise _type_error(
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            ("body",),
            body,
        )
    return body


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _type_error("string_type", "Input should be a valid string", _loc(key), value)


def _opt_int(body: dict[str, Any], key: str, default: int | None = None) -> int | None:
    if key not in body or body[key] is None:
        return default if key not in body else None
    value = body[key]
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if isinstance(value, float):
        kind, msg = "int_from_float", "got a number with a fractional part"
    elif isinstance(value, str):
        kind, msg = "int_parsing", "unable to parse string as an integer"
    else:
        kind, msg = "int_type", ""
    msg = "Input should be a valid integer" + (f", {msg}" if msg else "")
    raise _type_error(kind, msg, _loc(key), value)


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise _type_error("bool_parsing", "Input should be a valid boolean", _loc(key), value)


@dataclass
class StreamOpts:
    include_usage: bool = True
    continuous_usage_stats: bool = False


def _stream_options(body: dict[str, Any], stream: bool) -> StreamOpts | None:
    raw = body.get("stream_options")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _type_error(
            "model_type",
            "Input should be a valid dictionary or instance of StreamOptions",
            _loc("stream_options"),
            raw,
        )
    # vLLM's model validator: any truthy stream_options without stream=True is refused.
    if not stream:
        raise _value_error("Stream options can only be defined when `stream=True`.", body)
    include = raw.get("include_usage", True)
    continuous = raw.get("continuous_usage_stats", False)
    return StreamOpts(
        include_usage=bool(include) if include is not None else False,
        continuous_usage_stats=bool(continuous) if continuous is not None else False,
    )


@dataclass
class CommonParams:
    model: str | None
    stream: bool
    stream_options: StreamOpts | None
    max_tokens: int | None
    request_id: str | None
    return_token_ids: bool
    n: int
    ignore_eos: bool = False
    min_tokens: int = 0
    # How many top alternatives each sampled token's logprobs carry; None: no
    # logprobs at all (chat: top_logprobs when logprobs is true; completions: logprobs).
    logprobs: int | None = None
    # Salts the prefix cache's first block hash (vLLM's cache_salt).
    cache_salt: str | None = None
    # vLLM's SamplingParams.prompt_logprobs is set: the engine then skips the prefix
    # cache lookup (the whole prompt is computed), though it still fills the cache.
    prompt_logprobs: bool = False


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``check_cache_salt_support`` model validator (the last one declared, so
    the first a request meets)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _value_error("Parameter 'cache_salt' must be a non-empty string if provided.", body)
    return salt


def _common(
    body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None = None
) -> CommonParams:
    stream = _opt_bool(body, "stream", False)
    n = _opt_int(body, "n", 1)
    n = 1 if n is None else n
    if n < 1:
        raise RequestError.bad_request(f"n must be at least 1, got {n}.")
    request_id = _opt_str(body, "request_id")
    return CommonParams(
        model=_opt_str(body, "model"),
        stream=stream,
        stream_options=_stream_options(body, stream),
        max_tokens=max_tokens,
        request_id=request_id,
        return_token_ids=_opt_bool(body, "return_token_ids", False),
        n=n,
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        min_tokens=_opt_int(body, "min_tokens", 0) or 0,
        logprobs=logprobs,
        cache_salt=body.get("cache_salt"),
    )


def _number_or_none(body: dict[str, Any], key: str) -> Any:
    """A field as vLLM's "before" model validators see it (raw; ints compared)."""
    value = body.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's ChatCompletionRequest.check_logprobs, then ``top_logprobs if logprobs``."""
    prompt_logprobs = _number_or_none(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and prompt_logprobs > 0:
            raise _value_error("`prompt_logprobs` are not available when `stream=True`.", body)
        if prompt_logprobs < 0:
            raise _value_error("`prompt_logprobs` must be a positive value.", body)
    top = _number_or_none(body, "top_logprobs")
    if top is not None:
        if top < 0:
            raise _value_error("`top_logprobs` must be a positive value.", body)
        if top > 0 and not body.get("logprobs"):
            raise _value_error("when using `top_logprobs`, `logprobs` must be set to true.", body)
    wanted = _opt_bool(body, "logprobs", False)
    top_logprobs = _opt_int(body, "top_logprobs", 0)
    # An explicit "top_logprobs": null turns logprobs off, as in vLLM.
    return top_logprobs if wanted and top_logprobs is not None else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's CompletionRequest.check_logprobs; ``logprobs: k`` asks for top-k."""
    prompt_logprobs = _number_or_none(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and prompt_logprobs > 0:
            raise _value_error("`prompt_logprobs` are not available when `stream=True`.", body)
        if prompt_logprobs < 0:
            raise _value_error("`prompt_logprobs` must be a positive value.", body)
    logprobs = _number_or_none(body, "logprobs")
    if logprobs is not None and logprobs < 0:
        raise _value_error("`logprobs` must be a positive value.", body)
    return _opt_int(body, "logprobs")


@dataclass
class ChatRequest:
    common: CommonParams
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # As vLLM's validator leaves it: "none", "auto", "required", a named choice or None.
    tool_choice: Any = "none"
    documents: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _cache_salt(body)
    if "messages" not in body:
        raise _type_error("missing", "Field required", _loc("messages"), body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _type_error("list_type", "Input should be a valid list", _loc("messages"), messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _type_error(
                "model_type", "Input should be a valid dictionary", _loc("messages", i), message
            )
        if not isinstance(message.get("role"), str):
            raise _type_error("missing", "Field required", _loc("messages", i, "role"), message)

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _type_error("list_type", "Input should be a valid list", _loc("tools"), tools)
    # vLLM's check_tool_usage: an empty tools list is no tools ("auto" and "required" then
    # fall back to "none"), tools without a tool_choice mean "auto", else the field's
    # default "none".
    tool_choice = body.get("tool_choice", "none")
    if tools == [] and not isinstance(tool_choice, dict):
        tools = None
        if tool_choice in ("auto", "required"):
            tool_choice = "none"
    if "tool_choice" not in body and tools:
        tool_choice = "auto"
    if tool_choice not in (None, "none") and tools is None:
        raise _value_error("When using `tool_choice`, `tools` must be set.", body)

    # None when not sent: vLLM's mistral mode refuses the field whenever it is set.
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _type_error(
            "dict_type", "Input should be a valid dictionary", _loc("chat_template_kwargs"), kwargs
        )
    # vLLM's "before" validator reads the raw values: both truthy ("false" is) is refused.
    # Both true only by default (add_generation_prompt not sent) is left to the chat
    # template renderer, which refuses it too (a 400 with transformers' message).
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise _value_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", body
        )
    add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
    continue_final_message = _opt_bool(body, "continue_final_message", False)
    reasoning_effort = body.get("reasoning_effort")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        allowed = ", ".join(f"'{e}'" for e in REASONING_EFFORTS[:-1])
        raise _type_error(
            "literal_error",
            f"Input should be {allowed} or '{REASONING_EFFORTS[-1]}'",
            _loc("reasoning_effort"),
            reasoning_effort,
        )
    # The template sees the request's reasoning_effort: it travels with the messages.
    chat_messages = ChatMessages(messages)
    chat_messages.reasoning_effort = reasoning_effort
    # OpenAI's newer name wins; vLLM uses `max_completion_tokens or max_tokens`.
    max_tokens = _opt_int(body, "max_completion_tokens") or _opt_int(body, "max_tokens")
    common = _common(body, max_tokens=max_tokens, logprobs=_chat_logprobs(body))
    # vLLM: prompt_logprobs, else top_logprobs (default 0) when chat echo is set.
    common.prompt_logprobs = body.get("prompt_logprobs") is not None or (
        _opt_bool(body, "echo", False) and body.get("top_logprobs", 0) is not None
    )
    return ChatRequest(
        common=common,
        messages=chat_messages,
        tools=tools,
        tool_choice=tool_choice,
        documents=body.get("documents"),
        chat_template=_opt_str(body, "chat_template"),
        chat_template_kwargs=kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=_opt_bool(body, "add_special_tokens", False),
    )


@dataclass
class Prompt:
    """One prompt of a completion request: text to tokenize, or token ids as-is."""

    text: str | None = None
    ids: list[int] | None = None


@dataclass
class CompletionRequest:
    common: CommonParams
    prompts: list[Prompt]
    echo: bool = False
    add_special_tokens: bool = True
    # Base64 strings, as sent (vLLM loads them before the text prompts).
    prompt_embeds: list[str] | None = None


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(prompt: Any) -> list[Prompt]:
    """vLLM's forms: str, list[str], list[int], list[list[int]]."""
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    if _is_ids(prompt):
        return [Prompt(ids=list(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [Prompt(text=p) for p in prompt]
        if all(_is_ids(p) for p in prompt):
            return [Prompt(ids=list(p)) for p in prompt]
    raise _type_error("string_type", "Input should be a valid string", _loc("prompt"), prompt)


def _prompt_embeds(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _type_error("bytes_type", "Input should be a valid bytes", _loc("prompt_embeds"), value)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _cache_salt(body)
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    prompt_is_empty = prompt is None or prompt == ""
    embeds_is_empty = embeds is None or (isinstance(embeds, list) and not embeds)
    if prompt_is_empty and embeds_is_empty:
        raise _value_error("Either prompt or prompt_embeds must be provided and non-empty.", body)
    logprobs = _completion_logprobs(body)
    prompts = [] if prompt_is_empty else _prompts(prompt)
    prompt_embeds = None if embeds is None else _prompt_embeds(embeds)
    common = _common(body, max_tokens=_opt_int(body, "max_tokens", 16), logprobs=logprobs)
    echo = _opt_bool(body, "echo", False)
    # vLLM: prompt_logprobs, else logprobs when echoing.
    common.prompt_logprobs = body.get("prompt_logprobs") is not None or (
        echo and body.get("logprobs") is not None
    )
    if body.get("suffix") is not None:
        raise RequestError.bad_request("suffix is not currently supported")
    if echo and prompt_embeds is not None:
        raise RequestError.bad_request("Echo is unsupported with prompt embeds.")
    return CompletionRequest(
        common=common,
        prompts=prompts,
        echo=echo,
        add_special_tokens=_opt_bool(body, "add_special_tokens", True),
        prompt_embeds=prompt_embeds,
    )


# What vLLM's input processor raises for prompt_embeds without --enable-prompt-embeds.
PROMPT_EMBEDS_DISABLED = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."


def check_prompt_embeds(embeds: list[str]) -> None:
    """vLLM base64-decodes each embedding (``validate=True``) before anything else;
    a bad one is a 400 with the decoder's message. (vLLM then ``torch.load``s it;
    the simulator cannot, so any valid base64 passes here and fails later with
    :data:`PROMPT_EMBEDS_DISABLED`, as in a vLLM started without the flag.)"""
    for embed in embeds:
        try:
            base64.b64decode(embed, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestError.bad_request(str(exc)) from exc


def check_sampling(prompt_len: int | None, common: CommonParams, max_model_len: int) -> None:
    """``SamplingParams._verify_args`` on vLLM's computed max_tokens,
    ``min(max_tokens, max_model_len - prompt)`` (the prompt's length unknown for
    embeddings)."""
    caps = [c for c in (common.max_tokens,) if c is not None]
    if prompt_len is not None:
        caps.append(max_model_len - prompt_len)
    max_tokens = min(caps) if caps else None
    if common.min_tokens < 0:
        raise RequestError.bad_request(
            f"min_tokens must be greater than or equal to 0, got {common.min_tokens}."
        )
    if max_tokens is not None and common.min_tokens > max_tokens:
        raise RequestError.bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {common.min_tokens}."
        )


def check_logprobs(common: CommonParams, max_logprobs: int) -> str | None:
    """The v1 engine processor's check (raised inside the engine, so a stream gets
    it as an SSE error event). The "is is" is vLLM 0.10.2's own wording."""
    if common.logprobs and max_logprobs != -1 and common.logprobs > max_logprobs:
        return (
            f"Requested sample logprobs of {common.logprobs}, "
            f"which is is greater than max allowed: {max_logprobs}"
        )
    return None


def check_lengths(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's ``_validate_input`` then ``SamplingParams`` checks, same messages."""
    if prompt_len >= max_model_len:
        raise RequestError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your request has {prompt_len} input tokens. Please reduce the length of "
            "the input messages."
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise RequestError.bad_request(
            "'max_tokens' or 'max_completion_tokens' is too large: "
            f"{max_tokens}. This model's maximum context length is {max_model_len} tokens "
            f"and your request has {prompt_len} input tokens ({max_tokens} > "
            f"{max_model_len} - {prompt_len})."
        )
    if max_tokens is not None and max_tokens < 1:
        raise RequestError.bad_request(f"max_tokens must be at least 1, got {max_tokens}.")
