"""Rerank and score (``/rerank``, ``/v1/rerank``, ``/v2/rerank``, ``/score``, ``/v1/score``)
as vLLM 0.34 serves them for a cross-encoder started with a score template
(``--chat-template``, e.g. the Qwen3-Reranker prompt), on the simulator's own tokenizer.

What follows vLLM 0.34 (``entrypoints/pooling/scoring``: protocol, io_processor, utils,
serving; ``renderers/params.py``):

* request: rerank ``query`` + ``documents`` (+ ``top_n``); score ``queries``/``documents``,
  ``queries``/``items``, ``data_1``/``data_2`` or ``text_1``/``text_2``; strings or lists of
  strings, paired 1:1, 1:N or N:N; ``truncate_prompt_tokens``, ``instruction`` (folded into
  ``chat_template_kwargs``), ``chat_template_kwargs``, ``request_id``;
* each pair: the messages ``[{"role": "query", ...}, {"role": "document", ...}]`` rendered
  with the template (no generation prompt), tokenized with special tokens, truncated to
  ``truncate_prompt_tokens`` (``-1``: the context) or else to ``max_model_len + 1``, and
  refused when longer than ``max_model_len`` (a pooling prompt keeps no room for output);
* the score: the share of the query's distinct token ids found in the document (a
  deterministic stand-in for the classifier head, in [0, 1]);
* answers: score ``{"id": "score-<id>", "object": "list", "created", "model", "data":
  [{"index", "object": "score", "score"}], "usage": {...pooling usage}}``; rerank ``{"id":
  "score-<id>", "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index",
  "document": {"text", "multi_modal": null}, "relevance_score"}]}`` sorted by score, cut to
  ``top_n``;
* errors, in vLLM's order: body validation (400), unknown model (404), the inputs' lengths,
  then each pair's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vllm_sim import protocol
from vllm_sim.embeddings import pooling_usage
from vllm_sim.server import _error_response, _json_response
from vllm_sim.validation import RequestError

if TYPE_CHECKING:
    from vllm_sim.config import SimConfig
    from vllm_sim.server import VllmSim

RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS = ("/score", "/v1/score")
_SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
_SCORE_FIELDS += (("text_1", "text_2"),)
NOT_RERANK = "The model does not support Rerank (Score) API"
NOT_SCORE = "The model does not support Score API"


def _texts(value: Any, loc: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise RequestError.bad_request(f"{loc}: Input should be a valid string or list of strings")


@dataclass
class ScoreRequest:
    rerank: bool
    model: str | None
    first: list[str]
    second: list[str]
    top_n: int = 0
    truncate_prompt_tokens: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None


def parse_score(body: dict[str, Any], rerank: bool) -> ScoreRequest:
    """The body as vLLM's pydantic models read it (the common cases)."""
    if rerank:
        names = ("query", "documents")
    else:
        names = next((p for p in _SCORE_FIELDS if all(k in body for k in p)), ("text_1", "text_2"))
    missing = [name for name in names if name not in body]
    if missing:
        raise RequestError.bad_request(f"Field required: {', '.join(missing)}")
    if rerank and not isinstance(body["query"], str):
        raise RequestError.bad_request("query: Input should be a valid string")
    first, second = _texts(body[names[0]], names[0]), _texts(body[names[1]], names[1])
    top_n = body.get("top_n", 0)
    truncate = body.get("truncate_prompt_tokens")
    for key, value, low in (("top_n", top_n, 0), ("truncate_prompt_tokens", truncate, -1)):
        if value is not None and (type(value) is not int or value < low):
            raise RequestError.bad_request(f"{key}: Input should be an integer >= {low}")
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("instruction") is not None:
        kwargs.setdefault("instruction", body["instruction"])
    return ScoreRequest(
        rerank=rerank,
        model=body.get("model"),
        first=first,
        second=second,
        top_n=top_n or 0,
        truncate_prompt_tokens=truncate,
        template_kwargs=kwargs,
        request_id=body.get("request_id"),
    )


class ScoreModel:
    """The served cross-encoder: the simulator's tokenizer and the score template."""

    def __init__(self, model_dir: Path, template: str, served_model_name: str, max_len: int):
        from tokenizers import Tokenizer
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.template = _compile_jinja_template(template)
        self.served_model_name = served_model_name
        self.max_model_len = max_len

    def prompt(self, query: str, document: str, req: ScoreRequest) -> list[int]:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        text = self.template.render(
            messages=messages, add_generation_prompt=False, tools=None, **req.template_kwargs
        )
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        limit = req.truncate_prompt_tokens
        if limit is not None and limit < 0:
            limit = self.max_model_len
        # The tokenizer's truncation (its right side) to the limit, else to max_model_len + 1.
        ids = ids[: self.max_model_len + 1 if limit is None else limit]
        if len(ids) > self.max_model_len:
            some = "at least " if len(ids) == self.max_model_len + 1 else ""
            raise RequestError.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {some}{len(ids)} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        return ids

    def pairs(self, req: ScoreRequest) -> list[tuple[str, str]]:
        first, second = req.first, req.second
        if len(first) > 1 and len(first) != len(second):
            raise RequestError.bad_request("Input lengths must be either 1:1, 1:N or N:N")
        if not first:
            raise RequestError.bad_request("At least one text element must be given")
        if not second:
            raise RequestError.bad_request("At least one text_pair element must be given")
        t = req.truncate_prompt_tokens
        if t is not None and t > self.max_model_len:
            raise RequestError.bad_request(
                f"truncate_prompt_tokens={t} cannot be greater than max_model_len "
                f"= {self.max_model_len}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if len(first) == 1:
            first = first * len(second)
        return list(zip(first, second, strict=True))

    def score(self, query: str, document: str) -> float:
        wanted = set(self.tokenizer.encode(query, add_special_tokens=False).ids)
        found = set(self.tokenizer.encode(document, add_special_tokens=False).ids)
        return len(wanted & found) / len(wanted) if wanted else 0.0


def load_score_model(config: SimConfig, max_model_len: int) -> ScoreModel | None:
    """The score model the configuration names, or None."""
    if config.score_template is None:
        return None
    return ScoreModel(
        config.model_dir, config.score_template, config.score_served_model_name, max_model_len
    )


def score_answer(
    model: ScoreModel, req: ScoreRequest, request_id: str, scores: list[float], tokens: int
) -> dict[str, Any]:
    if not req.rerank:
        return {
            "id": f"score-{request_id}",
            "object": "list",
            "created": protocol.now(),
            "model": model.served_model_name,
            "data": [
                {"index": i, "object": "score", "score": score} for i, score in enumerate(scores)
            ],
            "usage": pooling_usage(tokens),
        }
    results = [
        {"index": i, "document": {"text": doc, "multi_modal": None}, "relevance_score": score}
        for i, (doc, score) in enumerate(zip(req.second, scores, strict=True))
    ]
    results.sort(key=lambda result: result["relevance_score"], reverse=True)
    top_n = req.top_n or len(results)
    if top_n < len(req.second):
        results = results[:top_n]
    return {
        "id": f"score-{request_id}",
        "model": model.served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


class ScoringRoutes:
    """The rerank and score handlers, on the server's score model (None: not served)."""

    def __init__(self, sim: VllmSim, model: ScoreModel | None) -> None:
        self.sim = sim
        self.model = model

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._handle(request, rerank=True)

    async def score(self, request: web.Request) -> web.Response:
        return await self._handle(request, rerank=False)

    async def _handle(self, request: web.Request, *, rerank: bool) -> web.Response:
        try:
            body, _ = await self.sim._read(request)
            req = parse_score(body, rerank)
            model = self.model
            if model is None:
                raise RequestError.bad_request(NOT_RERANK if rerank else NOT_SCORE)
            if req.model and req.model != model.served_model_name:
                raise RequestError.not_found(f"The model `{req.model}` does not exist.")
            pairs = model.pairs(req)
            prompts = [model.prompt(query, doc, req) for query, doc in pairs]
        except RequestError as err:
            return _error_response(err)
        scores = [model.score(query, doc) for query, doc in pairs]
        request_id = request.headers.get("X-Request-Id") or req.request_id or protocol.random_uuid()
        tokens = sum(map(len, prompts))
        return _json_response(score_answer(model, req, request_id, scores, tokens))
