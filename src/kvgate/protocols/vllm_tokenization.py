"""vLLM's tokenization endpoints, ``POST /tokenize`` and ``POST /detokenize`` (vLLM 0.34).

They generate nothing and hold no KV: the engine's API server tokenizes a prompt or a chat
(``/tokenize``: ``{count, max_model_len, tokens, token_strs}``) or decodes token ids
(``/detokenize``: ``{prompt}``). kvgate forwards them to the model's backend after the
tenant's key and the tenant's RPM slot, and charges no tokens (``UnmeteredApi``).

What the engine would do beyond tokenizing is refused, as on chat: a per-request
``chat_template`` (any Jinja the tenant writes, run on the engine's API server),
``mm_processor_kwargs`` / ``media_io_kwargs``, and content parts other than text (the
engine fetches and decodes images, audio and video for them). ``model`` is required: it
names the backend the request goes to (vLLM itself defaults it to its one model).
"""

from __future__ import annotations

from typing import Any

from kvgate.lifecycle.protocol import ClientError, UnmeteredApi
from kvgate.openai import ApiError, invalid_request, load_json_object
from kvgate.openai import errors as openai_errors

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"

# Fields of vLLM's TokenizeChatRequest that make the engine run more than its tokenizer.
_ENGINE_WORK_FIELDS = {
    "chat_template": "a per-request chat template",
    "mm_processor_kwargs": "multimodal processor arguments",
    "media_io_kwargs": "media loading arguments",
}
# vLLM: token ids are non-negative 64-bit integers.
_MAX_TOKEN_ID = 2**63 - 1


def _refused(message: str, param: str, code: str = "invalid_value") -> ClientError:
    return ClientError(invalid_request(message, param, code))


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if type(model) is not str or not model:
        raise _refused(
            "'model' is required: a non-empty string naming the model whose tokenizer to use.",
            "model",
        )
    return model


def _check_messages(messages: Any) -> None:
    if type(messages) is not list or not messages:
        raise _refused("'messages' must be a non-empty list of messages.", "messages")
    for i, message in enumerate(messages):
        if type(message) is not dict:
            raise _refused("Each message must be an object.", f"messages[{i}]")
        content = message.get("content")
        if content is None or type(content) is str:
            continue
        if type(content) is not list:
            raise _refused(
                "A message's content must be a string or a list of parts.",
                f"messages[{i}].content",
            )
        for j, part in enumerate(content):
            kind = part.get("type") if type(part) is dict else None
            if kind != "text" or type(part.get("text")) is not str:
                raise _refused(
                    "Only text parts can be tokenized through this gateway "
                    f"(got {kind!r}): the engine would fetch or decode media for the others.",
                    f"messages[{i}].content[{j}]",
                    "unsupported_parameter",
                )


def parse_tokenize(body: bytes) -> str:
    """The model of a valid ``/tokenize`` body (a prompt or a chat); ``ClientError``
    otherwise."""
    try:
        obj = load_json_object(body)
    except ApiError as error:
        raise ClientError(error) from None
    model = _model(obj)
    for name, what in _ENGINE_WORK_FIELDS.items():
        if obj.get(name) is not None:
            raise _refused(
                f"'{name}' is not supported by this gateway: the engine would run {what}.",
                name,
                "unsupported_parameter",
            )
    if "messages" in obj:
        if "prompt" in obj:
            raise _refused("Send either 'prompt' or 'messages', not both.", "messages")
        _check_messages(obj["messages"])
    elif type(obj.get("prompt")) is not str:
        raise _refused("'prompt' (a string) or 'messages' is required.", "prompt")
    return model


def parse_detokenize(body: bytes) -> str:
    """The model of a valid ``/detokenize`` body; ``ClientError`` otherwise."""
    try:
        obj = load_json_object(body)
    except ApiError as error:
        raise ClientError(error) from None
    model = _model(obj)
    tokens = obj.get("tokens")
    if type(tokens) is not list or not all(
        type(token) is int and 0 <= token <= _MAX_TOKEN_ID for token in tokens
    ):
        raise _refused("'tokens' must be a list of non-negative integer token ids.", "tokens")
    return model


class VllmTokenization(UnmeteredApi):
    """``/tokenize`` or ``/detokenize``: forwarded after the key and the RPM slot."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path, openai_errors)
        self._parse = parse_tokenize if path == TOKENIZE_PATH else parse_detokenize

    def model(self, body: bytes) -> str:
        return self._parse(body)


TOKENIZE = VllmTokenization("tokenize", TOKENIZE_PATH)
DETOKENIZE = VllmTokenization("detokenize", DETOKENIZE_PATH)
