"""``POST /v1/embeddings`` as vLLM 0.34 serves it, backed by a real model: WordLlama.

The model is WordLlama's ``l2_supercat`` (``pip install wordllama``, 0.4.x): a 32,000-token
Llama-2 vocabulary with a 256-dimensional vector per token, shipped inside the wheel. Its
"forward pass" is the mean of the prompt's token vectors, special tokens (``<unk>``, ``<s>``,
``</s>``) left out, so the ``<s>`` vLLM's tokenizer call adds (``add_special_tokens``, on by
default) is counted in ``usage`` but does not move the vector: a text's embedding equals
``wordllama``'s own ``embed(text, norm=True)``. It is matryoshka-trained, so the model
accepts ``dimensions`` 64, 128 or 256 (vLLM's ``matryoshka_dimensions``): the first columns,
normalised after truncation, as vLLM's pooler head does. The files are read from the
installed package with ``tokenizers`` and ``safetensors`` (importing ``wordllama`` would
configure the root logger, and its loader downloads the tokenizer from Hugging Face).

What follows vLLM 0.34 (``entrypoints/pooling/embed``, ``pooling/base``,
``renderers/params.py``, ``pooling_params.py``, the input processor):

* request: ``input`` as a string, a list of strings, a list of token ids or a list of such
  lists; ``encoding_format`` ``float`` | ``base64`` (little-endian float32 bytes);
  ``dimensions``; ``truncate_prompt_tokens`` (each prompt keeps its first N tokens, its
  last N with ``truncation_side: "left"``; ``-1`` = the model length, ``0`` = no prompts
  and an empty ``data``); ``add_special_tokens`` (default true); ``use_activation``
  (default: normalised); ``request_id``; ``user`` and ``priority`` accepted;
  ``normalize`` refused (removed in 0.34). The chat form (``messages``) is refused as vLLM
  refuses it for a model without a chat template;
* answer: ``{"id": "embd-<X-Request-Id | request_id | uuid>", "object": "list",
  "created", "model", "data": [{"index", "object": "embedding", "embedding"}], "usage":
  {"prompt_tokens", "total_tokens", "completion_tokens": 0, "completion_tokens_details":
  null}}``;
* errors, in vLLM's order: body validation (400 ``Bad Request``), unknown model (404), then
  400 ``BadRequestError``: ``truncate_prompt_tokens`` over the model length, the text's
  length in characters, tokenization and length (the whole context: a pooling prompt keeps
  no room for output), ``dimensions``, and the engine's (empty prompt, token id out of
  vocabulary).
"""

from __future__ import annotations

import base64
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_sim import protocol
from vllm_sim.validation import RequestError

WORDLLAMA = "wordllama"
EMBEDDING_MODELS = (WORDLLAMA,)
DEFAULT_EMBEDDING_NAME = "wordllama-l2-supercat"
# A pooling model's context length (vLLM: from the model config; WordLlama has none).
DEFAULT_EMBEDDING_MAX_MODEL_LEN = 8192

_WEIGHTS = "weights/l2_supercat_256.safetensors"
_TOKENIZER = "tokenizers/l2_supercat_tokenizer_config.json"
_TENSOR = "embedding.weight"
MATRYOSHKA_DIMENSIONS = (64, 128, 256)

# vLLM's messages, verbatim.
NOT_SUPPORTED = "The model does not support Embeddings API"
NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)
NO_PROMPT = "please provide at least one prompt"
EMPTY_PROMPT = "The decoder prompt cannot be empty"


def pooling_usage(tokens: int) -> dict[str, Any]:
    """vLLM 0.34's UsageInfo of a pooling answer (``get_pooling_usage``): no output, and
    ``prompt_tokens_details`` left out when None."""
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "completion_tokens_details": None,
    }


class WordLlamaModel:
    """Token ids -> mean-pooled WordLlama vectors (float32)."""

    def __init__(self, package_dir: Path | None = None) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        if package_dir is None:
            spec = importlib.util.find_spec("wordllama")
            if spec is None or spec.origin is None:
                raise RuntimeError("--embedding-model wordllama needs `pip install wordllama`")
            package_dir = Path(spec.origin).parent
        self.tokenizer = Tokenizer.from_file(str(package_dir / _TOKENIZER))
        self.table = np.ascontiguousarray(
            load_file(str(package_dir / _WEIGHTS))[_TENSOR], dtype=np.float32
        )
        self.hidden_size = int(self.table.shape[1])
        self.vocab_size = int(self.table.shape[0])
        # vLLM's max_chars_per_token: the longest entry of the vocabulary, added tokens too.
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))
        self.pooled = np.ones(self.vocab_size, dtype=bool)
        for token_id, token in self.tokenizer.get_added_tokens_decoder().items():
            if token.special and token_id < self.vocab_size:
                self.pooled[token_id] = False

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def pool(self, ids: list[int]) -> np.ndarray:
        """The hidden state: the mean of the non-special tokens' vectors (zeros if none)."""
        arr = np.asarray(ids, dtype=np.intp)
        arr = arr[self.pooled[arr]]
        if not arr.size:
            return np.zeros(self.hidden_size, dtype=np.float32)
        return self.table[arr].mean(axis=0, dtype=np.float32)


@functools.cache
def load_embedding_model(name: str) -> WordLlamaModel:
    """Loaded once per process (read-only: in-process servers of a test session share it)."""
    if name != WORDLLAMA:
        raise ValueError(f"unknown embedding model {name!r} (known: {', '.join(EMBEDDING_MODELS)})")
    return WordLlamaModel()


# --- request --------------------------------------------------------------------------


@dataclass
class EmbeddingRequest:
    model: str | None
    # The "input" as sent (batched into prompts when rendered, as vLLM does).
    input: Any = None
    chat: bool = False
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None
    truncation_side: str | None = None


def _error(kind: str, loc: tuple[Any, ...], msg: str, value: Any, **ctx: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx:
        err["ctx"] = ctx
    return err


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _input_errors(value: Any, member: str) -> list[dict[str, Any]]:
    """pydantic's errors for ``Union[list[int], list[list[int]], str, list[str]]``."""
    if isinstance(value, str):
        return []
    if isinstance(value, list):
        if all(_is_int(v) for v in value):
            return []
        if all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value):
            return []
        if all(isinstance(v, str) for v in value):
            return []
    loc = ("body", member, "input")
    return [_error("string_type", (*loc, "str"), "Input should be a valid string", value)]


def _opt_int_errors(body: dict[str, Any], key: str, member: str) -> list[dict[str, Any]]:
    value = body.get(key)
    if value is None or _is_int(value):
        return []
    if isinstance(value, float) and value.is_integer():
        return []
    return [_error("int_type", ("body", member, key), "Input should be a valid integer", value)]


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    """The body as pydantic validates ``Union[EmbeddingCompletionRequest,
    EmbeddingChatRequest]``: the first member that validates wins; when none does, the
    400 lists both members' errors (the common cases reproduced)."""
    chat = "input" not in body and "messages" in body
    member = "EmbeddingChatRequest" if chat else "EmbeddingCompletionRequest"
    errors: list[dict[str, Any]] = []
    if not chat:
        if "input" not in body:
            errors.append(_error("missing", ("body", member, "input"), "Field required", body))
        else:
            errors += _input_errors(body["input"], member)
    elif not isinstance(body["messages"], list):
        errors.append(
            _error(
                "list_type",
                ("body", member, "messages"),
                "Input should be a valid list",
                body["messages"],
            )
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        errors.append(
            _error(
                "literal_error",
                ("body", member, "encoding_format"),
                "Input should be 'float' or 'base64'",
                fmt,
                expected="'float' or 'base64'",
            )
        )
    for key in ("dimensions", "truncate_prompt_tokens", "priority"):
        errors += _opt_int_errors(body, key, member)
    truncate = body.get("truncate_prompt_tokens")
    if _is_int(truncate) and truncate < -1:
        errors.append(
            _error(
                "greater_than_equal",
                ("body", member, "truncate_prompt_tokens"),
                "Input should be greater than or equal to -1",
                truncate,
                ge=-1,
            )
        )
    if "normalize" in body:
        # vLLM 0.34 (reject_removed_pooling_parameters), before the model validates.
        raise RequestError.bad_request(
            "Parameter `normalize` was removed; use `use_activation` instead.", "normalize"
        )
    side = body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        errors.append(
            _error(
                "literal_error",
                ("body", member, "truncation_side"),
                "Input should be 'left' or 'right'",
                side,
                expected="'left' or 'right'",
            )
        )
    for key in ("add_special_tokens", "use_activation"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            errors.append(
                _error("bool_type", ("body", member, key), "Input should be a valid boolean", value)
            )
    for key in ("model", "user", "request_id"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            errors.append(
                _error(
                    "string_type", ("body", member, key), "Input should be a valid string", value
                )
            )
    if errors:
        if not chat:
            # The other member of the union fails too: it has no messages.
            errors.append(
                _error(
                    "missing", ("body", "EmbeddingChatRequest", "messages"), "Field required", body
                )
            )
        raise RequestError.validation(errors)

    def opt_int(key: str) -> int | None:
        value = body.get(key)
        return None if value is None else int(value)

    req = EmbeddingRequest(
        model=body.get("model"),
        chat=chat,
        encoding_format=fmt,
        dimensions=opt_int("dimensions"),
        truncate_prompt_tokens=opt_int("truncate_prompt_tokens"),
        # The chat form defaults add_special_tokens to false (the template adds them).
        add_special_tokens=not chat
        if body.get("add_special_tokens") is None
        else body["add_special_tokens"],
        # use_activation: the pooler's normalisation (None: the model's default, on).
        normalize=body.get("use_activation"),
        truncation_side=side,
        priority=opt_int("priority") or 0,
        request_id=body.get("request_id"),
    )
    if not chat:
        req.input = body["input"]
    return req


def _batch(value: Any) -> list[tuple[str, Any]]:
    """vLLM's ``parse_and_batch_prompt``, shape-checked already by the validation."""
    if isinstance(value, str):
        return [("text", value)]
    if not value:
        raise RequestError.bad_request(NO_PROMPT)
    if all(isinstance(v, str) for v in value):
        return [("text", v) for v in value]
    if all(_is_int(v) for v in value):
        return [("ids", list(value))]
    if not value[0]:
        raise RequestError.bad_request(NO_PROMPT)
    return [("ids", list(v)) for v in value]


# --- serving ---------------------------------------------------------------------------


@dataclass
class EmbeddingServer:
    """One served embedding model: name, context length, the model."""

    model: WordLlamaModel
    served_model_name: str
    max_model_len: int = DEFAULT_EMBEDDING_MAX_MODEL_LEN
    requests_total: int = 0
    inputs_total: int = 0
    prompt_tokens_total: int = 0

    def check(self, req: EmbeddingRequest) -> None:
        """Everything vLLM checks before the engine runs, in its order."""
        if req.model and req.model != self.served_model_name:
            raise RequestError.not_found(f"The model `{req.model}` does not exist.")
        t = req.truncate_prompt_tokens
        if t is not None and t > self.max_model_len:
            # vLLM 0.34's TokenizeParams (a pooling request keeps the whole context).
            raise RequestError.bad_request(
                f"truncate_prompt_tokens={t} cannot be greater than max_model_len "
                f"= {self.max_model_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if req.chat:
            raise RequestError.bad_request(NO_CHAT_TEMPLATE)

    def render(self, req: EmbeddingRequest) -> list[list[int]]:
        """Tokenize, truncate and length-check (vLLM's CompletionRenderer)."""
        t = req.truncate_prompt_tokens
        if t is not None and t < 0:
            t = self.max_model_len
        if t == 0:
            return []
        max_length = self.max_model_len
        # vLLM 0.34 (renderers/params.py): text over max_model_len x the longest vocabulary
        # entry is refused before tokenizing; untruncated text is tokenized to at most
        # max_model_len + 1 tokens; truncation keeps the start (the tokenizer's
        # truncation_side), or the end with truncation_side "left", for text and ids alike.
        max_chars = max_length * self.model.max_chars_per_token
        keep_end = req.truncation_side == "left"
        out: list[list[int]] = []
        for kind, content in _batch(req.input):
            if kind == "text":
                if t is None and len(content) > max_chars:
                    raise RequestError.bad_request(
                        f"This model's maximum context length is {max_length} tokens. "
                        f"However, your prompt contains {len(content)} characters (more than "
                        f"{max_chars} characters, which is the upper bound for {max_length} "
                        "input tokens). Please reduce the length of the input prompt.",
                        "input_text",
                    )
                ids = self.model.encode(content, req.add_special_tokens)
                if t is None:
                    ids = ids[: max_length + 1]
            else:
                ids = list(content)
            if t is not None and t < len(ids):
                ids = ids[-t:] if keep_end else ids[:t]
            if len(ids) > max_length:
                some = "at least " if kind == "text" and len(ids) == max_length + 1 else ""
                raise RequestError.bad_request(
                    f"This model's maximum context length is {max_length} tokens. However, "
                    f"your prompt contains {some}{len(ids)} input tokens, which exceeds this "
                    "limit even without any output tokens. Please reduce the length of the "
                    "input prompt.",
                    "input_tokens",
                )
            out.append(ids)
        return out

    def check_pooling(self, req: EmbeddingRequest) -> None:
        """``PoolingParams.verify("embed")``."""
        d = req.dimensions
        if d is not None and d not in MATRYOSHKA_DIMENSIONS:
            raise RequestError.bad_request(
                f'Model "{self.served_model_name}" only supports '
                f"{list(MATRYOSHKA_DIMENSIONS)} matryoshka dimensions, use other output "
                "dimensions will lead to poor results."
            )

    def check_engine(self, prompts: list[list[int]]) -> None:
        """The v1 input processor's checks, prompt by prompt."""
        for ids in prompts:
            if not ids:
                raise RequestError.bad_request(EMPTY_PROMPT)
            top = max(ids)
            if top > self.model.vocab_size - 1:
                raise RequestError.bad_request(f"Token id {top} is out of vocabulary")
            low = min(ids)
            if low < 0:  # vLLM would fail inside the model; the simulator refuses it
                raise RequestError.bad_request(f"Token id {low} is out of vocabulary")

    def compute(self, req: EmbeddingRequest, prompts: list[list[int]]) -> np.ndarray:
        """The pooler: mean, then matryoshka truncation, then L2 normalisation."""
        if not prompts:
            return np.zeros((0, req.dimensions or self.model.hidden_size), dtype=np.float32)
        hidden = np.stack([self.model.pool(ids) for ids in prompts])
        if req.dimensions is not None:
            hidden = hidden[:, : req.dimensions]
        if req.normalize is None or req.normalize:
            # torch.nn.functional.normalize: x / max(||x||, 1e-12)
            norms = np.maximum(np.linalg.norm(hidden, axis=1, keepdims=True), 1e-12)
            hidden = (hidden / norms).astype(np.float32)
        return hidden

    def response(
        self, request_id: str, vectors: np.ndarray, prompts: list[list[int]], fmt: str
    ) -> dict[str, Any]:
        data = []
        for index, vector in enumerate(vectors):
            if fmt == "base64":
                embedding: Any = base64.b64encode(
                    np.asarray(vector, dtype="<f4").tobytes()
                ).decode()
            else:
                embedding = np.asarray(vector, dtype=np.float32).tolist()
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        tokens = sum(len(ids) for ids in prompts)
        self.requests_total += 1
        self.inputs_total += len(prompts)
        self.prompt_tokens_total += tokens
        return {
            "id": f"embd-{request_id}",
            "object": "list",
            "created": protocol.now(),
            "model": self.served_model_name,
            "data": data,
            "usage": pooling_usage(tokens),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "served_model_name": self.served_model_name,
            "max_model_len": self.max_model_len,
            "requests_total": self.requests_total,
            "inputs_total": self.inputs_total,
            "prompt_tokens_total": self.prompt_tokens_total,
        }

    def reset(self) -> None:
        self.requests_total = self.inputs_total = self.prompt_tokens_total = 0
