"""vLLM's OpenAI-server JSON, byte for byte (vLLM 0.10.2).

vLLM builds these from pydantic models, so key order is the models' field order and
which keys appear depends on how each object is dumped:

* non-streaming bodies and errors: ``JSONResponse(model.model_dump())`` -> every field,
  Starlette's ``json.dumps(..., ensure_ascii=False, separators=(",", ":"))``;
* chat stream chunks: ``model_dump_json(exclude_unset=True)`` -> only the fields the
  server passed explicitly (None included when passed);
* completion stream chunks: ``model_dump_json(exclude_unset=False)`` -> every field,
  so each chunk carries ``"usage":null``;
* the final usage chunk (both APIs): ``exclude_none=True`` as well, so
  ``prompt_tokens_details`` shows only when set (``--enable-prompt-tokens-details``
  and a prefix-cache hit: ``{"cached_tokens": N}``).

Both serializers produce compact JSON with raw UTF-8, which ``dumps`` reproduces.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from vllm_sim.config import VLLM_VERSION


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def random_uuid() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())


# --- errors ---------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
}


def error_type_for(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word[:1].upper() + word[1:] for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` (error -> message, type, param, code)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def request_validation_error(errors: list[Any]) -> dict[str, Any]:
    """What vLLM's RequestValidationError handler returns: 400, type "Bad Request"."""
    return error_body(str(errors), HTTPStatus.BAD_REQUEST.phrase, 400)


# --- shared pieces ----------------------------------------------------------------


@dataclass
class ChoiceOutput:
    """One finished choice of a non-streaming response."""

    index: int
    text: str
    finish_reason: str
    token_ids: list[int]
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


def usage(prompt: int, completion: int, *, details: bool, cached_tokens: int = 0) -> dict[str, Any]:
    """``UsageInfo``; field order is prompt, total, completion (vLLM's declaration).

    ``details``: the dump shows unset fields (``prompt_tokens_details: null``).
    ``cached_tokens``: what vLLM puts in ``prompt_tokens_details`` (it does so only
    with ``--enable-prompt-tokens-details`` and a non-zero count; the caller decides).
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    elif details:
        out["prompt_tokens_details"] = None
    return out


def model_list(served_model_name: str, root: str, max_model_len: int) -> dict[str, Any]:
    created = now()
    card = {
        "id": served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{random_uuid()}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return {"object": "list", "data": [card]}


def version() -> dict[str, Any]:
    return {"version": VLLM_VERSION}


# --- chat completions ---------------------------------------------------------------


class ChatFormatter:
    """Builds one chat completion's JSON objects."""

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        role: str = "assistant",
        return_token_ids: bool = False,
        created: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.role = role
        self.return_token_ids = return_token_ids
        self.created = now() if created is None else created

    def _chunk(self, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def role_chunk(
        self, index: int, prompt_ids: list[int], usage_now: dict[str, Any] | None
    ) -> dict[str, Any]:
        chunk = self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": self.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if usage_now is not None:
            chunk["usage"] = usage_now
        chunk["prompt_token_ids"] = prompt_ids if self.return_token_ids else None
        return chunk

    def token_chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        usage_now: dict[str, Any] | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = token_ids if self.return_token_ids else None
        chunk = self._chunk([choice])
        if usage_now is not None:
            chunk["usage"] = usage_now
        return chunk

    def usage_chunk(self, prompt: int, completion: int, cached_tokens: int = 0) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt, completion, details=False, cached_tokens=cached_tokens)
        return chunk

    def response(
        self, prompt_ids: list[int], outputs: list[ChoiceOutput], cached_tokens: int = 0
    ) -> dict[str, Any]:
        choices = [
            {
                "index": out.index,
                "message": {
                    "role": self.role,
                    "content": out.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": out.logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": None,
                "token_ids": out.token_ids if self.return_token_ids else None,
            }
            for out in outputs
        ]
        completion = sum(len(out.token_ids) for out in outputs)
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(len(prompt_ids), completion, details=True, cached_tokens=cached_tokens),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if self.return_token_ids else None,
            "kv_transfer_params": None,
        }


# --- completions --------------------------------------------------------------------


class CompletionFormatter:
    """Builds one text completion's JSON objects."""

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        return_token_ids: bool = False,
        created: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.return_token_ids = return_token_ids
        self.created = now() if created is None else created

    def token_chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        usage_now: dict[str, Any] | None,
        prompt_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_token_ids": prompt_ids if self.return_token_ids else None,
            "token_ids": token_ids if self.return_token_ids else None,
        }
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_now,
        }

    def usage_chunk(self, prompt: int, completion: int, cached_tokens: int = 0) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt, completion, details=False, cached_tokens=cached_tokens),
        }

    def response(
        self, prompt_tokens: int, outputs: list[ChoiceOutput], cached_tokens: int = 0
    ) -> dict[str, Any]:
        choices = [
            {
                "index": out.index,
                "text": out.text,
                "logprobs": out.logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": out.prompt_logprobs,
                "prompt_token_ids": out.prompt_ids if self.return_token_ids else None,
                "token_ids": out.token_ids if self.return_token_ids else None,
            }
            for out in outputs
        ]
        completion = sum(len(out.token_ids) for out in outputs)
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(prompt_tokens, completion, details=True, cached_tokens=cached_tokens),
            "kv_transfer_params": None,
        }
