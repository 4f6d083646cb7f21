"""The aiohttp application: vLLM's OpenAI-compatible routes plus /sim/* controls.

Test steering headers (all optional):

``x-sim-output-tokens: N``    generate N tokens (capped by max_tokens unless ignored)
``x-sim-ignore-max-tokens: 1`` generate N even past max_tokens (a backend ignoring it)
``x-sim-ttft-ms`` / ``x-sim-itl-ms``  per-request latency override
``x-sim-error: STATUS``       answer STATUS with vLLM's error JSON at once
``x-sim-stall-after: K``      send K tokens, then hang until the client goes away
``x-sim-abort-after: K``      send K tokens, then cut the connection (no [DONE])
``x-sim-chunk-tokens: K``     stream K tokens per SSE event (vLLM merging deltas)
``x-sim-stream-error-after: K`` send K tokens, then fail: vLLM's in-band error event, [DONE]
``x-sim-end-after: K``        send K tokens, then end the stream cleanly without [DONE]
``x-sim-finish-abort-after: K`` after K tokens the engine aborts: finish_reason "abort"
``x-sim-proxy-answer: html|empty`` a 200 from "a proxy in front": an HTML page, or no body
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vllm_sim import protocol
from vllm_sim.config import SimConfig
from vllm_sim.embeddings import (
    NOT_SUPPORTED,
    EmbeddingRequest,
    EmbeddingServer,
    load_embedding_model,
    parse_embedding,
)
from vllm_sim.engine import KVEngine, SimRequest
from vllm_sim.engine_tokenizers import load_sim_tokenizer
from vllm_sim.logprobs import LogprobSource, Position
from vllm_sim.metrics import SimMetrics
from vllm_sim.record import RequestLog, RequestRecord
from vllm_sim.tokenization import PromptError, SimTokenizer
from vllm_sim.validation import (
    PROMPT_EMBEDS_DISABLED,
    ChatRequest,
    CommonParams,
    CompletionRequest,
    Prompt,
    RequestError,
    StreamOpts,
    check_lengths,
    check_logprobs,
    check_prompt_embeds,
    check_sampling,
    parse_chat,
    parse_completion,
    parse_json_body,
)

log = logging.getLogger("vllm_sim")

SIM_KEY = web.AppKey("vllm_sim", "VllmSim")
DISCONNECT_POLL_S = 0.02
RECORD_KEY = web.RequestKey("vllm_sim_record", RequestRecord)
# vLLM's AuthenticationMiddleware answers with a bare Starlette JSONResponse.
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
# x-sim-proxy-answer: what a proxy or load balancer in front of vLLM may answer with a 200
# (a maintenance or login page, an empty body) without vLLM ever seeing the request.
PROXY_ANSWERS = ("html", "empty")
PROXY_HTML_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>Service maintenance</title></head>"
    b"<body><h1>We'll be back soon</h1></body></html>\n"
)
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# How a generation may end early (Steering.ending_at).
GENERATION_FAILED = "failed"  # x-sim-stream-error-after
END_CLEANLY = "end"  # x-sim-end-after
ENGINE_ABORT = "abort"  # x-sim-finish-abort-after
# vLLM 0.10.2 when its engine dies mid-stream: the exception's text in its streaming error
# event (create_streaming_error_response's defaults, json.dumps' default separators).
ENGINE_DEAD_ERROR = protocol.error_body(
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "BadRequestError",
    400,
)


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=protocol.dumps(body).encode(), status=status, content_type="application/json"
    )


def _error_response(err: RequestError) -> web.Response:
    return _json_response(err.body, err.status)


@web.middleware
async def _http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes, wrong methods, oversized bodies: vLLM's HTTPException handler
    answers them in its ErrorResponse shape, with the status phrase as message and type."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = protocol.error_body(exc.reason, exc.reason, exc.status)
        return _json_response(body, exc.status)


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    # vLLM runs under uvicorn; look the part down to the Server header.
    response.headers["Server"] = "uvicorn"
    record: RequestRecord | None = request.get(RECORD_KEY)
    if record is not None:
        record.status = response.status


class DisconnectWatcher:
    """Cancels generation handlers whose client has gone.

    aiohttp's default (``handler_cancellation=False``) lets a handler run on after its
    client disconnects until a write fails, which never happens while a request waits
    for KV or stalls. One task polls every in-flight generation's transport and
    cancels the orphans, whatever runner serves the app.
    """

    def __init__(self, interval_s: float = DISCONNECT_POLL_S) -> None:
        self._interval_s = interval_s
        self._active: dict[asyncio.Task[Any], web.Request] = {}
        self._loop_task: asyncio.Task[None] | None = None

    def watch(self, request: web.Request, task: asyncio.Task[Any]) -> None:
        self._active[task] = request
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run())

    def unwatch(self, task: asyncio.Task[Any]) -> None:
        self._active.pop(task, None)

    async def _run(self) -> None:
        while self._active:
            await asyncio.sleep(self._interval_s)
            for task, request in list(self._active.items()):
                transport = request.transport
                if transport is None or transport.is_closing():
                    del self._active[task]
                    task.cancel()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task


@dataclass
class Steering:
    """A request's x-sim-* headers, parsed (latencies default to the server's)."""

    output_tokens: int | None = None
    ignore_max_tokens: bool = False
    ttft_s: float = 0.0
    itl_s: float = 0.0
    error_status: int | None = None
    stall_after: int | None = None
    abort_after: int | None = None
    chunk_tokens: int = 1
    stream_error_after: int | None = None
    end_after: int | None = None
    finish_abort_after: int | None = None

    @classmethod
    def from_headers(cls, headers: Any, config: SimConfig) -> Steering:
        def number(name: str) -> float | None:
            raw = headers.get(name)
            if raw is None or raw.strip() == "":
                return None
            try:
                value = float(raw)
            except ValueError as exc:
                raise RequestError.bad_request(f"invalid {name} header: {raw!r}") from exc
            if not math.isfinite(value) or value < 0:
                raise RequestError.bad_request(f"invalid {name} header: {raw!r}")
            return value

        def count(name: str) -> int | None:
            value = number(name)
            return None if value is None else int(value)

        ttft = number("x-sim-ttft-ms")
        itl = number("x-sim-itl-ms")
        error_status = count("x-sim-error")
        if error_status is not None and not 400 <= error_status <= 599:
            raise RequestError.bad_request(f"x-sim-error must be 400..599, got {error_status}")
        return cls(
            output_tokens=count("x-sim-output-tokens"),
            ignore_max_tokens=headers.get("x-sim-ignore-max-tokens", "").strip().lower()
            in ("1", "true", "yes"),
            ttft_s=(config.ttft_ms if ttft is None else ttft) / 1000.0,
            itl_s=(config.itl_ms if itl is None else itl) / 1000.0,
            error_status=error_status,
            stall_after=count("x-sim-stall-after"),
            abort_after=count("x-sim-abort-after"),
            chunk_tokens=max(1, count("x-sim-chunk-tokens") or 1),
            stream_error_after=count("x-sim-stream-error-after"),
            end_after=count("x-sim-end-after"),
            finish_abort_after=count("x-sim-finish-abort-after"),
        )

    def ending_at(self, produced: int) -> str | None:
        """How the generation ends now that `produced` tokens were taken from the engine
        (over all choices), if one of the early endings is due."""
        for after, ending in (
            (self.stream_error_after, GENERATION_FAILED),
            (self.end_after, END_CLEANLY),
            (self.finish_abort_after, ENGINE_ABORT),
        ):
            if after is not None and produced >= after:
                return ending
        return None


def plan_output(
    *,
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    default_output_tokens: int,
    steering: Steering,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> tuple[int, str]:
    """How many tokens to generate and why generation stops.

    The cap is vLLM's ``min(max_tokens, max_model_len - prompt)``. Without a header the
    "model" wants ``default_output_tokens``; with ``x-sim-output-tokens`` it wants that
    many. It finishes with "length" when the cap cuts it, else "stop" (on EOS).
    ``x-sim-ignore-max-tokens`` drops max_tokens from the cap; the context length still
    binds. ``ignore_eos`` (benchmarks use it) runs to the cap; ``min_tokens`` raises
    what the model wants.
    """
    model_cap = max_model_len - prompt_len
    cap = model_cap
    if max_tokens is not None and not steering.ignore_max_tokens:
        cap = min(cap, max_tokens)
    wanted = steering.output_tokens if steering.output_tokens is not None else default_output_tokens
    wanted = max(wanted, min_tokens, 1)  # an engine always samples at least one token
    if ignore_eos or wanted >= cap:
        return cap, "length"
    return wanted, "stop"


class VllmSim:
    """The simulator: tokenizer, KV engine, metrics and the HTTP handlers."""

    def __init__(self, config: SimConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_sim_tokenizer(config.model_dir, config.tokenizer_mode)
        self.max_model_len = config.effective_max_model_len
        # vLLM's chat-rendering flags, applied on every route that renders a chat.
        self.chat_flags = config.chat_flags
        self.engine = KVEngine(
            num_gpu_blocks=config.gpu_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            served_history=config.served_history,
        )
        self.metrics = SimMetrics(config, self.engine)
        self.engine.listener = self.metrics
        # One worker, like vLLM's tokenizer executor: HF tokenizers dislike
        # concurrent use of one instance.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-sim-tok")
        self._watcher = DisconnectWatcher()
        self.requests = RequestLog(capacity=config.request_history)
        self._logprob_source: LogprobSource | None = None
        self._auth_values = frozenset(f"Bearer {key}" for key in config.api_keys)
        # The embedding model, loaded at start like vLLM's; its own worker thread.
        self.embedder: EmbeddingServer | None = None
        self._embed_executor: ThreadPoolExecutor | None = None
        if config.embedding_model is not None:
            self.embedder = EmbeddingServer(
                load_embedding_model(config.embedding_model),
                config.embedding_served_model_name,
                config.embedding_max_model_len,
            )
            self._embed_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="vllm-sim-embed"
            )
        if self.max_model_len < config.max_model_len:
            log.warning(
                "KV capacity %d tokens < max_model_len %d: serving max_model_len=%d",
                config.kv_capacity_tokens,
                config.max_model_len,
                self.max_model_len,
            )

    @property
    def logprob_source(self) -> LogprobSource:
        assert self._logprob_source is not None, "call _prepare_logprobs first"
        return self._logprob_source

    async def _prepare_logprobs(self, k: int, echo_ids: list[list[int]]) -> None:
        """Built on the first request that asks for logprobs (never on the common
        path); all decoding happens on the tokenizer's executor thread, like every
        other use of the tokenizer."""
        if self._logprob_source is None:
            self._logprob_source = await self._off_loop(LogprobSource, self.tokenizer)
        ids = [t for p in echo_ids for t in p]
        await self._off_loop(self._logprob_source.prepare, k, ids)

    # --- plumbing ------------------------------------------------------------------

    def create_app(self) -> web.Application:
        @web.middleware
        async def front(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._front(request, handler)

        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[front, _http_errors])
        app.on_response_prepare.append(_on_prepare)
        app[SIM_KEY] = self
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        # vLLM's /pooling on the embedding model (imported here: it builds on this module).
        from vllm_sim.pooling import PoolingRoutes

        app.router.add_post("/pooling", PoolingRoutes(self).pooling)
        # vLLM's rerank and score, for a cross-encoder with a score template.
        from vllm_sim.scoring import RERANK_PATHS, SCORE_PATHS, ScoringRoutes, load_score_model

        scoring = ScoringRoutes(self, load_score_model(self.config, self.max_model_len))
        for path in RERANK_PATHS:
            app.router.add_post(path, scoring.rerank)
        for path in SCORE_PATHS:
            app.router.add_post(path, scoring.score)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        # vLLM's Anthropic Messages API (imported here: the module builds on this one).
        from vllm_sim.anthropic import AnthropicRoutes

        anthropic = AnthropicRoutes(self)
        app.router.add_post("/v1/messages", anthropic.messages)
        app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
        # vLLM's Responses API (chat-template path).
        from vllm_sim.responses import ResponsesRoutes

        responses = ResponsesRoutes(self)
        app.router.add_post("/v1/responses", responses.create)
        app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", responses.cancel)
        app.router.add_get("/sim/stats", self.sim_stats)
        app.router.add_get("/sim/requests", self.sim_requests)
        app.router.add_post("/sim/reset", self.sim_reset)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _app: web.Application) -> None:
        await self._watcher.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._embed_executor is not None:
            self._embed_executor.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _front(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Record every /v1/* arrival, then vLLM's API-key check (same paths).

        vLLM checks ``Authorization`` against ``Bearer <key>`` on every path that
        starts with /v1 (OPTIONS excepted), before routing; /health, /metrics and
        /sim/* stay open.
        """
        path = request.path
        if not path.startswith("/v1"):
            return await handler(request)
        request[RECORD_KEY] = self.requests.add(request.method, path, request.headers)
        proxy_answer = request.headers.get("x-sim-proxy-answer")
        if proxy_answer is not None and path in GENERATION_PATHS:
            return await self._proxy_answer(request, proxy_answer.strip().lower())
        if (
            self._auth_values
            and request.method != "OPTIONS"
            and request.headers.get("Authorization") not in self._auth_values
        ):
            return web.Response(body=UNAUTHORIZED_BODY, status=401, content_type="application/json")
        return await handler(request)

    async def _proxy_answer(self, request: web.Request, kind: str) -> web.Response:
        """A 200 that does not come from vLLM (x-sim-proxy-answer): an HTML page, or an
        empty body typed as the request expects (an event stream or JSON)."""
        if kind not in PROXY_ANSWERS:
            err = RequestError.bad_request(f"x-sim-proxy-answer must be html or empty: {kind!r}")
            return _error_response(err)
        body: dict[str, Any] | None = None
        with contextlib.suppress(RequestError):
            body = parse_json_body(await request.read(), request.headers.get("Content-Type", ""))
        record: RequestRecord | None = request.get(RECORD_KEY)
        if record is not None and body is not None:
            record.note_body(body)
        if kind == "html":
            return web.Response(body=PROXY_HTML_PAGE, content_type="text/html", charset="utf-8")
        if body is not None and body.get("stream") is True:
            return web.Response(content_type="text/event-stream", charset="utf-8")
        return web.Response(content_type="application/json")

    def _check_model(self, common: CommonParams) -> None:
        # vLLM: a missing/empty model means the served one.
        if common.model and common.model != self.config.served_model_name:
            raise RequestError.not_found(f"The model `{common.model}` does not exist.")

    # --- simple routes ---------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, _request: web.Request) -> web.Response:
        return _json_response(protocol.version())

    async def models(self, _request: web.Request) -> web.Response:
        body = protocol.model_list(
            self.config.served_model_name, str(self.config.model_dir), self.max_model_len
        )
        if self.embedder is not None:
            name = self.embedder.served_model_name
            body["data"] += protocol.model_list(name, name, self.embedder.max_model_len)["data"]
        return _json_response(body)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render(request.headers.get("Accept", ""))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def sim_stats(self, _request: web.Request) -> web.Response:
        snap = self.engine.snapshot()
        snap["http_requests_total"] = self.requests.total
        snap["generation_requests_total"] = self.requests.generation_total
        snap["config"] = {
            "served_model_name": self.config.served_model_name,
            "max_model_len": self.max_model_len,
            "num_gpu_blocks": self.config.gpu_blocks,
            "block_size": self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "enable_prompt_tokens_details": self.config.enable_prompt_tokens_details,
            "prefill_ms_per_1k_tokens": self.config.prefill_ms_per_1k_tokens,
        }
        if self.embedder is not None:
            snap["embeddings"] = self.embedder.stats()
        return _json_response(snap)

    async def sim_requests(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit")
        try:
            limit = int(raw) if raw is not None else None
        except ValueError:
            return _json_response(
                protocol.error_body(f"invalid limit: {raw!r}", "BadRequestError", 400), 400
            )
        return _json_response(self.requests.to_json(limit))

    async def sim_reset(self, _request: web.Request) -> web.Response:
        self.engine.reset_stats()
        # A cold prefix cache too, so each test starts from the same state.
        self.engine.reset_prefix_cache()
        self.requests.clear()
        if self.embedder is not None:
            self.embedder.reset()
        self.metrics = SimMetrics(self.config, self.engine)
        self.engine.listener = self.metrics
        return _json_response({"ok": True})

    # --- generation routes --------------------------------------------------------------

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], Steering]:
        record: RequestRecord | None = request.get(RECORD_KEY)
        steering = Steering.from_headers(request.headers, self.config)
        if steering.error_status is not None:
            status = steering.error_status
            if record is not None:
                # Still show what was sent; the simulated error wins over a bad body.
                with contextlib.suppress(RequestError):
                    record.note_body(
                        parse_json_body(
                            await request.read(), request.headers.get("Content-Type", "")
                        )
                    )
            raise RequestError(
                status,
                protocol.error_body(
                    f"Simulated error (x-sim-error: {status})",
                    protocol.error_type_for(status),
                    status,
                ),
            )
        raw = await request.read()
        body = parse_json_body(raw, request.headers.get("Content-Type", ""))
        if record is not None:
            record.note_body(body)
        return body, steering

    def _base_id(self, request: web.Request, common: CommonParams) -> str:
        # vLLM: X-Request-Id header, else the body's request_id, else a fresh uuid.
        return request.headers.get("X-Request-Id") or common.request_id or protocol.random_uuid()

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body, steering = await self._read(request)
            chat = parse_chat(body)
            self._check_model(chat.common)
            prompt_ids = await self._tokenize_chat(chat)
        except RequestError as err:
            return _error_response(err)
        # vLLM answers as "assistant" unless the client continues its own last turn.
        role = (
            chat.messages[-1]["role"]
            if chat.messages and not chat.add_generation_prompt
            else "assistant"
        )
        fmt = protocol.ChatFormatter(
            f"chatcmpl-{self._base_id(request, chat.common)}",
            self.config.served_model_name,
            role=role,
            return_token_ids=chat.common.return_token_ids,
        )
        return await self._serve(request, "chat", chat.common, steering, [prompt_ids], fmt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body, steering = await self._read(request)
            comp = parse_completion(body)
            self._check_model(comp.common)
            if comp.prompt_embeds is not None:
                check_prompt_embeds(comp.prompt_embeds)
            prompts: list[list[int]] = []
            echoes: list[str] = []
            for prompt in comp.prompts:
                ids, text = await self._tokenize_prompt(comp, prompt)
                prompts.append(ids)
                echoes.append(text)
        except RequestError as err:
            return _error_response(err)
        fmt = protocol.CompletionFormatter(
            f"cmpl-{self._base_id(request, comp.common)}",
            self.config.served_model_name,
            return_token_ids=comp.common.return_token_ids,
        )
        return await self._serve(
            request,
            "completion",
            comp.common,
            steering,
            prompts,
            fmt,
            echoes=echoes if comp.echo else None,
            engine_error=PROMPT_EMBEDS_DISABLED if comp.prompt_embeds else None,
            embeds=len(comp.prompt_embeds or ()),
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's /v1/embeddings (see vllm_sim.embeddings): the body is validated first,
        then a server without an embedding model refuses, as a generation vLLM does."""
        try:
            body, steering = await self._read(request)
            req = parse_embedding(body)
            server = self.embedder
            if server is None or self._embed_executor is None:
                raise RequestError.bad_request(NOT_SUPPORTED)
            server.check(req)
            loop = asyncio.get_running_loop()

            def prepare(req: EmbeddingRequest) -> list[list[int]]:
                prompts = server.render(req)
                server.check_pooling(req)
                server.check_engine(prompts)
                return prompts

            prompts = await loop.run_in_executor(self._embed_executor, prepare, req)
        except RequestError as err:
            return _error_response(err)
        if steering.ttft_s > 0:
            await asyncio.sleep(steering.ttft_s)  # the forward pass
        vectors = await loop.run_in_executor(self._embed_executor, server.compute, req, prompts)
        request_id = request.headers.get("X-Request-Id") or req.request_id or protocol.random_uuid()
        return _json_response(server.response(request_id, vectors, prompts, req.encoding_format))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a completion prompt or a chat (rendered as the chat route
        renders it) -> ``{count, max_model_len, tokens, token_strs}``. No length check and
        no API key (vLLM guards only /v1 paths)."""
        try:
            body = parse_json_body(await request.read(), request.headers.get("Content-Type", ""))
            kind, fields = _tokenize_request(body)
            model = body.get("model")
            if model and model != self.config.served_model_name:
                raise RequestError.not_found(f"The model `{model}` does not exist.")
            if kind == "chat":

                def render() -> list[int]:
                    try:
                        # vLLM's ServingTokenization renders with the server's template,
                        # content format and default keywords; TokenizeChatRequest has no
                        # tool_choice (and no reasoning_effort), so the tools always stay
                        # (gpt-oss: its chat request defaults tool_choice to "auto").
                        return self.tokenizer.encode_chat(
                            fields["messages"],
                            tools=fields["tools"],
                            chat_template=fields["chat_template"],
                            add_generation_prompt=fields["add_generation_prompt"],
                            continue_final_message=fields["continue_final_message"],
                            chat_template_kwargs=fields["chat_template_kwargs"],
                            add_special_tokens=fields["add_special_tokens"],
                            flags=self.chat_flags,
                        )
                    except PromptError as exc:
                        # vLLM formats preprocessing failures as f"{e} {e.__cause__}".
                        raise RequestError.bad_request(f"{exc} {exc.__cause__}") from exc

                ids: list[int] = await self._off_loop(render)
            else:
                ids = await self._off_loop(
                    lambda: self.tokenizer.encode(
                        fields["prompt"], add_special_tokens=fields["add_special_tokens"]
                    )
                )
            token_strs = (
                await self._off_loop(self._token_strs, ids) if fields["return_token_strs"] else None
            )
        except RequestError as err:
            return _error_response(err)
        # TokenizeResponse's declaration order; token_strs is null unless asked for.
        return _json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": token_strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``, decoded as
        its renderer decodes a prompt (special tokens kept). No API key (vLLM guards only
        /v1 paths)."""
        try:
            body = parse_json_body(await request.read(), request.headers.get("Content-Type", ""))
            tokens = _detokenize_tokens(body)
            model = body.get("model")
            if model and model != self.config.served_model_name:
                raise RequestError.not_found(f"The model `{model}` does not exist.")
            text = await self._off_loop(self.tokenizer.detokenize, tokens)
        except RequestError as err:
            return _error_response(err)
        return _json_response({"prompt": text})

    def _token_strs(self, ids: list[int]) -> list[str]:
        """``tokenizer.convert_ids_to_tokens``: vocabulary forms, not decoded text."""
        backend = getattr(self.tokenizer, "_tok", None)
        convert = getattr(backend, "convert_ids_to_tokens", None)
        if convert is not None:
            return list(convert(ids))
        return [self.tokenizer.decode_token(i) for i in ids]

    async def _tokenize_chat(self, chat: ChatRequest) -> list[int]:
        def work() -> list[int]:
            return self.tokenizer.encode_chat(
                chat.messages,
                # --exclude-tools-when-tool-choice-none (OnlineRenderer.render_chat).
                tools=self.chat_flags.tools_for(chat.tools, chat.tool_choice),
                documents=chat.documents,
                chat_template=chat.chat_template,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                chat_template_kwargs=chat.chat_template_kwargs,
                add_special_tokens=chat.add_special_tokens,
                flags=self.chat_flags,
            )

        try:
            ids: list[int] = await self._off_loop(work)
        except PromptError as exc:
            # vLLM formats preprocessing failures as f"{e} {e.__cause__}".
            raise RequestError.bad_request(f"{exc} {exc.__cause__}") from exc
        check_lengths(len(ids), chat.common.max_tokens, self.max_model_len)
        return ids

    async def _tokenize_prompt(
        self, comp: CompletionRequest, prompt: Prompt
    ) -> tuple[list[int], str]:
        """Token ids (a token-id prompt counts as-is) and the text echo would show."""
        if prompt.ids is not None:
            ids = prompt.ids
            text: str = await self._off_loop(self.tokenizer.decode, ids) if comp.echo else ""
        else:
            text = prompt.text or ""
            ids = await self._off_loop(
                lambda: self.tokenizer.encode(text, add_special_tokens=comp.add_special_tokens)
            )
        check_lengths(len(ids), comp.common.max_tokens, self.max_model_len)
        if not ids:
            raise RequestError.bad_request("The decoder prompt cannot be empty")
        return ids, text

    # --- the generation loop ----------------------------------------------------------------

    def _usage_flags(self, common: CommonParams) -> tuple[bool, bool]:
        """(include_usage, continuous_usage), as vLLM's ``should_include_usage``."""
        opts: StreamOpts | None = common.stream_options
        if opts is not None:
            include = opts.include_usage or self.config.force_include_usage
            return include, include and opts.continuous_usage_stats
        return self.config.force_include_usage, False

    def _new_choice(
        self,
        index: int,
        prompt_ids: list[int],
        common: CommonParams,
        steering: Steering,
        request_id: str,
        endpoint: str,
        echo: str | None,
    ) -> _Choice:
        n_out, finish_reason = plan_output(
            prompt_len=len(prompt_ids),
            max_tokens=common.max_tokens,
            max_model_len=self.max_model_len,
            default_output_tokens=self.config.default_output_tokens,
            steering=steering,
            ignore_eos=common.ignore_eos,
            min_tokens=common.min_tokens,
        )
        eos = self.tokenizer.eos_token_id if self.config.eos_on_stop else None
        eos_id = eos if finish_reason == "stop" else None
        tokenizer = self.tokenizer

        def output_id(i: int) -> int:
            # The prefix cache hashes generated tokens too (as _token sends them).
            if eos_id is not None and i == n_out - 1:
                return eos_id
            return tokenizer.output_token(i)[0]

        req = SimRequest(
            request_id=request_id,
            prompt_tokens=len(prompt_ids),
            target_tokens=n_out,
            finish_reason=finish_reason,
            endpoint=endpoint,
            stream=common.stream,
            max_tokens=common.max_tokens,
            prompt_ids=prompt_ids,
            output_id=output_id,
            cache_salt=common.cache_salt,
            prefix_lookup=not common.prompt_logprobs,
        )
        return _Choice(index=index, prompt_ids=prompt_ids, req=req, eos_id=eos_id, echo=echo)

    def _cached_tokens(self, choices: list[_Choice], n: int, *, stream: bool) -> int:
        """``prompt_tokens_details.cached_tokens`` of a response; 0 leaves it out.

        vLLM reports one sequence's ``num_cached_tokens`` (its prefix-cache hit at
        its first scheduling), and only with --enable-prompt-tokens-details: a stream
        takes the first output it reads (the first sequence admitted), a plain
        response its last prompt's output, completed by that prompt's last sequence
        to finish (n > 1 fans out into sequences).
        """
        if not self.config.enable_prompt_tokens_details:
            return 0
        if stream:
            first = min(choices, key=lambda c: c.req.admit_order)
            return first.req.cached_tokens
        return max(choices[-n:], key=lambda c: c.req.finish_order).req.cached_tokens

    def _token(self, choice: _Choice, i: int) -> tuple[int, str]:
        # The last token of a "stop" finish is EOS: counted, never shown.
        if choice.eos_id is not None and i == choice.req.target_tokens - 1:
            return choice.eos_id, ""
        return self.tokenizer.output_token(i)

    async def _serve(
        self,
        request: web.Request,
        endpoint: str,
        common: CommonParams,
        steering: Steering,
        prompts: list[list[int]],
        fmt: protocol.ChatFormatter | protocol.CompletionFormatter,
        *,
        echoes: list[str] | None = None,
        engine_error: str | None = None,
        embeds: int = 0,
    ) -> web.StreamResponse:
        # vLLM builds SamplingParams (its checks answer 400) for every prompt before
        # the engine sees any; the engine's own refusals come next.
        try:
            for _ in range(embeds):
                check_sampling(None, common, self.max_model_len)
            for prompt_ids in prompts:
                check_sampling(len(prompt_ids), common, self.max_model_len)
        except RequestError as err:
            return _error_response(err)
        if steering.end_after is not None and not common.stream:
            return _error_response(
                RequestError.bad_request("x-sim-end-after applies to streamed requests only")
            )
        engine_error = check_logprobs(common, self.config.max_logprobs) or engine_error
        if engine_error is not None:
            return await self._engine_refusal(request, common, engine_error)
        if common.logprobs is not None:
            await self._prepare_logprobs(common.logprobs, prompts if echoes is not None else [])
        # One engine sequence per (prompt, n) pair, as vLLM fans n out into child
        # requests; choice index = prompt_index * n + k.
        many = len(prompts) * common.n > 1
        choices: list[_Choice] = []
        for p_idx, prompt_ids in enumerate(prompts):
            for _ in range(common.n):
                index = len(choices)
                choices.append(
                    self._new_choice(
                        index,
                        prompt_ids,
                        common,
                        steering,
                        f"{fmt.request_id}-{index}" if many else fmt.request_id,
                        endpoint,
                        echoes[p_idx] if echoes is not None else None,
                    )
                )

        def answer(feed: _Feed) -> Awaitable[web.StreamResponse]:
            if common.stream:
                return self._stream(request, common, steering, prompts, choices, feed, fmt)
            return self._unary(request, common, steering, prompts, choices, feed, fmt)

        return await self.generate(request, choices, steering, answer)

    async def generate(
        self,
        request: web.Request,
        choices: list[_Choice],
        steering: Steering,
        answer: Callable[[_Feed], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Run `choices` on the engine and answer with `answer(feed)` (every API's path:
        chat, completions, and those served as a converted chat request)."""
        for choice in choices:
            self.engine.submit(choice.req)

        feed = _Feed(choices)
        pumps = [asyncio.create_task(self._pump(c, feed, steering)) for c in choices]
        task = asyncio.current_task()
        assert task is not None
        self._watcher.watch(request, task)
        try:
            return await answer(feed)
        except ConnectionError:
            # The client went away mid-write. Answering with a throwaway response lets
            # aiohttp finish quietly instead of logging a handler error.
            return web.Response(status=499)
        finally:
            self._watcher.unwatch(task)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            # Disconnect (cancellation), failed write, stall or cut: whatever ended
            # the request early, release its KV; what was sent stays recorded.
            for choice in choices:
                if choice.req.final_reason is None:
                    self.engine.abort(choice.req)

    async def _engine_refusal(
        self, request: web.Request, common: CommonParams, message: str
    ) -> web.StreamResponse:
        """A ValueError from vLLM's engine (input processor): a 400 for a plain
        request; a stream has already answered 200, so the error becomes one SSE
        event (``json.dumps`` with default separators, ASCII) before ``[DONE]``."""
        err = RequestError.bad_request(message)
        if not common.stream:
            return _error_response(err)
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps(err.body)}\n\n".encode())
        await resp.write(protocol.SSE_DONE)
        await resp.write_eof()
        return resp

    async def _pump(self, choice: _Choice, feed: _Feed, steering: Steering) -> None:
        req = choice.req
        gen = self.engine.generate(
            req,
            ttft_s=steering.ttft_s,
            itl_s=steering.itl_s,
            prefill_s_per_token=self.config.prefill_ms_per_1k_tokens / 1e6,
        )
        try:
            while req.generated < req.target_tokens:
                await choice.demand.acquire()
                try:
                    i = await anext(gen)
                except StopAsyncIteration:
                    break
                feed.queue.put_nowait((choice, i))
        finally:
            await gen.aclose()
        # The last token is out of the engine: free the KV now, as vLLM does, even
        # though the writer may still be sending (or stalling on) it.
        self.engine.finish(req)
        feed.queue.put_nowait((choice, None))

    @staticmethod
    async def _stall_forever() -> None:
        await asyncio.Event().wait()

    def _cut_connection(self, request: web.Request, choices: list[_Choice]) -> None:
        for choice in choices:
            self.engine.abort(choice.req)
        if request.transport is not None:
            request.transport.close()

    def _prompt_positions(self, prompt_ids: list[int], k: int) -> list[Position | None]:
        """Prompt logprobs for an echo: none for the first token, as in vLLM; the
        same for every choice."""
        return [None, *self.logprob_source.positions(prompt_ids[1:], k, choice=-1, start=1)]

    async def _stream(
        self,
        request: web.Request,
        common: CommonParams,
        steering: Steering,
        prompts: list[list[int]],
        choices: list[_Choice],
        feed: _Feed,
        fmt: protocol.ChatFormatter | protocol.CompletionFormatter,
    ) -> web.StreamResponse:
        include_usage, continuous = self._usage_flags(common)
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        resp.enable_chunked_encoding()
        # Headers go out at once, as Starlette's StreamingResponse does; the body
        # starts with the first generated token.
        await resp.prepare(request)
        chat = isinstance(fmt, protocol.ChatFormatter)
        k = common.logprobs
        lps = self.logprob_source if k is not None else None

        def usage_now(choice: _Choice, done: int) -> dict[str, Any] | None:
            if not continuous:
                return None
            # Chat chunks drop unset fields; completion chunks dump them all.
            return protocol.usage(len(choice.prompt_ids), done, details=not chat)

        role_sent = False
        # Tokens taken from the engine but not yet written, per choice: one SSE event
        # carries x-sim-chunk-tokens of them (vLLM merges the deltas a slow reader
        # has not taken yet).
        pending: dict[_Choice, list[int]] = {}

        async def flush(choice: _Choice, finish_as: str | None = None) -> None:
            """Write the choice's pending tokens as one event. `finish_as`: the engine
            ended the choice here (an abort), even with no token left to send."""
            nonlocal role_sent
            indices = pending.pop(choice, None) or []
            if not indices and finish_as is None:
                return
            start = indices[0] if indices else choice.req.sent
            ids: list[int] = []
            texts: list[str] = []
            for i in indices:
                token_id, text = self._token(choice, i)
                ids.append(token_id)
                texts.append(text)
            out_text = "".join(texts)
            done = start + len(indices)
            finish = choice.req.finish_reason if done == choice.req.target_tokens else None
            finish = finish_as or finish
            if isinstance(fmt, protocol.ChatFormatter):
                if not role_sent:
                    # vLLM sends every choice's role chunk on the first engine output.
                    for c in choices:
                        chunk = fmt.role_chunk(c.index, c.prompt_ids, usage_now(c, 0))
                        await resp.write(protocol.sse(chunk))
                    role_sent = True
                logprobs = None
                if lps is not None and k is not None:
                    logprobs = lps.chat(lps.positions(ids, k, choice.index, start), k)
                chunk = fmt.token_chunk(
                    choice.index, out_text, ids, finish, usage_now(choice, done), logprobs
                )
            else:
                first = start == 0
                echo = first and choice.echo is not None
                logprobs = None
                if lps is not None and k is not None:
                    positions: list[Position | None] = [*lps.positions(ids, k, choice.index, start)]
                    lp_ids = ids
                    if echo:
                        positions = [*self._prompt_positions(choice.prompt_ids, k), *positions]
                        lp_ids = choice.prompt_ids + ids
                    logprobs = lps.completion(lp_ids, positions, k, choice.text_len)
                chunk = fmt.token_chunk(
                    choice.index,
                    (choice.echo or "") + out_text if echo else out_text,
                    ids,
                    finish,
                    usage_now(choice, done),
                    choice.prompt_ids if first else None,
                    logprobs,
                )
            # vLLM's text offsets count the generated text only, never the echo.
            choice.text_len += len(out_text)
            await resp.write(protocol.sse(chunk))
            choice.req.sent = done

        produced = 0
        remaining = len(choices)
        while remaining:
            # Stall/abort-after count tokens taken from the engine; whatever is
            # pending goes out first.
            stall = steering.stall_after is not None and produced >= steering.stall_after
            cut = steering.abort_after is not None and produced >= steering.abort_after
            if stall or cut:
                for c in list(pending):
                    await flush(c)
                if stall:
                    await self._stall_forever()
                self._cut_connection(request, choices)
                return resp
            ending = steering.ending_at(produced)
            if ending is not None:
                for c in list(pending):
                    await flush(c)
                if ending == ENGINE_ABORT:
                    # vLLM's engine aborted the request: each choice still running gets
                    # a last event without tokens, finishing it with "abort".
                    for c in choices:
                        if c.req.sent < c.req.target_tokens:
                            self.engine.abort(c.req)
                            await flush(c, finish_as="abort")
                    break
                for c in choices:
                    self.engine.abort(c.req)  # generation stops: its KV is freed
                if ending == GENERATION_FAILED:
                    await resp.write(f"data: {json.dumps(ENGINE_DEAD_ERROR)}\n\n".encode())
                    await resp.write(protocol.SSE_DONE)
                await resp.write_eof()  # END_CLEANLY: the body ends, no [DONE]
                return resp
            choice, i = await feed.next()
            if i is None:
                remaining -= 1
                await flush(choice)
                continue
            batch = pending.setdefault(choice, [])
            batch.append(i)
            produced += 1
            if len(batch) >= steering.chunk_tokens or i + 1 == choice.req.target_tokens:
                await flush(choice)
        if include_usage:
            prompt_tokens = len(prompts[0]) if chat else sum(len(p) for p in prompts)
            completion = sum(c.req.sent for c in choices)
            cached = self._cached_tokens(choices, common.n, stream=True)
            await resp.write(protocol.sse(fmt.usage_chunk(prompt_tokens, completion, cached)))
        await resp.write(protocol.SSE_DONE)
        await resp.write_eof()
        return resp

    async def _unary(
        self,
        request: web.Request,
        common: CommonParams,
        steering: Steering,
        prompts: list[list[int]],
        choices: list[_Choice],
        feed: _Feed,
        fmt: protocol.ChatFormatter | protocol.CompletionFormatter,
    ) -> web.StreamResponse:
        remaining = len(choices)
        produced = 0
        while remaining:
            # Stall/abort-after count produced tokens: nothing reaches the client
            # before the whole body does.
            if steering.stall_after is not None and produced >= steering.stall_after:
                await self._stall_forever()
            if steering.abort_after is not None and produced >= steering.abort_after:
                self._cut_connection(request, choices)
                return web.Response(status=500)  # never reaches the client
            ending = steering.ending_at(produced)
            if ending == GENERATION_FAILED:
                for c in choices:
                    self.engine.abort(c.req)
                # vLLM's handler for a dead engine answers a bare 500.
                return web.Response(status=500)
            if ending == ENGINE_ABORT:
                for c in choices:
                    if len(c.output_ids) < c.req.target_tokens:
                        self.engine.abort(c.req)
                        c.aborted = True
                break
            choice, i = await feed.next()
            if i is None:
                remaining -= 1
                continue
            token_id, text = self._token(choice, i)
            choice.output_ids.append(token_id)
            choice.texts.append(text)
            produced += 1
        chat = isinstance(fmt, protocol.ChatFormatter)
        outputs = [
            protocol.ChoiceOutput(
                index=c.index,
                text=(c.echo or "") + "".join(c.texts),
                finish_reason="abort" if c.aborted else c.req.finish_reason,
                token_ids=c.output_ids,
                prompt_ids=c.prompt_ids,
            )
            for c in choices
        ]
        k = common.logprobs
        if k is not None:
            lps = self.logprob_source
            for c, out in zip(choices, outputs, strict=True):
                positions = lps.positions(c.output_ids, k, c.index)
                if chat:
                    out.logprobs = lps.chat(positions, k)
                elif c.echo is not None:
                    prompt_positions = self._prompt_positions(c.prompt_ids, k)
                    out.logprobs = lps.completion(
                        c.prompt_ids + c.output_ids, [*prompt_positions, *positions], k
                    )
                    out.prompt_logprobs = lps.prompt_logprobs(prompt_positions)
                else:
                    out.logprobs = lps.completion(c.output_ids, positions, k)
        cached = self._cached_tokens(choices, common.n, stream=False)
        if isinstance(fmt, protocol.ChatFormatter):
            body = fmt.response(prompts[0], outputs, cached)
        else:
            body = fmt.response(sum(len(p) for p in prompts), outputs, cached)
        for c in choices:
            c.req.sent = len(c.output_ids)
        return _json_response(body)


@dataclass(eq=False)
class _Choice:
    """One choice of a response, backed by one engine sequence."""

    index: int
    prompt_ids: list[int]
    req: SimRequest
    eos_id: int | None
    echo: str | None
    output_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    # The engine aborted it before its last token (x-sim-finish-abort-after).
    aborted: bool = False
    # Generated text streamed so far (vLLM's previous_text_lens: logprob offsets).
    text_len: int = 0
    # Credits to generate the next token (see _Feed).
    demand: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))


class _Feed:
    """Tokens from every choice's engine sequence, handed over one at a time.

    A choice may generate its next token only once the writer has taken its previous
    one and passed the stall/abort checks, so ``x-sim-stall-after: K`` freezes
    generation at exactly K tokens (the KV stays held, as in a hung engine).
    """

    def __init__(self, choices: list[_Choice]) -> None:
        self.queue: asyncio.Queue[tuple[_Choice, int | None]] = asyncio.Queue()
        self._owed = list(choices)

    async def next(self) -> tuple[_Choice, int | None]:
        for choice in self._owed:
            choice.demand.release()
        self._owed.clear()
        choice, i = await self.queue.get()
        if i is not None:
            self._owed.append(choice)
        return choice, i


def _detokenize_tokens(body: dict[str, Any]) -> list[int]:
    """``DetokenizeRequest.tokens``: a list of integers 0 <= id < 2**63 (pydantic's errors
    for each item that is not)."""
    errors: list[Any] = []
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        errors.append(
            {
                "type": "string_type",
                "loc": ("body", "model"),
                "msg": "Input should be a valid string",
                "input": model,
            }
        )
    tokens = body.get("tokens")
    if "tokens" not in body:
        errors.append(
            {"type": "missing", "loc": ("body", "tokens"), "msg": "Field required", "input": body}
        )
    elif not isinstance(tokens, list):
        errors.append(
            {
                "type": "list_type",
                "loc": ("body", "tokens"),
                "msg": "Input should be a valid list",
                "input": tokens,
            }
        )
    else:
        for i, token in enumerate(tokens):
            loc = ("body", "tokens", i)
            if isinstance(token, bool) or not isinstance(token, int):
                errors.append(
                    {
                        "type": "int_type",
                        "loc": loc,
                        "msg": "Input should be a valid integer",
                        "input": token,
                    }
                )
            elif token < 0:
                errors.append(
                    {
                        "type": "greater_than_equal",
                        "loc": loc,
                        "msg": "Input should be greater than or equal to 0",
                        "input": token,
                        "ctx": {"ge": 0},
                    }
                )
            elif token > 2**63 - 1:
                errors.append(
                    {
                        "type": "less_than_equal",
                        "loc": loc,
                        "msg": f"Input should be less than or equal to {2**63 - 1}",
                        "input": token,
                        "ctx": {"le": 2**63 - 1},
                    }
                )
    if errors:
        raise RequestError.validation(errors)
    return list(tokens)


def _tokenize_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Which member of vLLM's ``TokenizeCompletionRequest | TokenizeChatRequest`` union the
    body validates as, with its fields. pydantic tries both (smart mode): one that
    validates wins, both -> the one with more of its own fields set (a tie: the completion,
    the union's first member); neither -> both members' errors, each under its class name.
    """
    completion_errors: list[Any] = []
    chat_errors: list[Any] = []
    completion = _tokenize_member(body, "TokenizeCompletionRequest", completion_errors)
    chat = _tokenize_member(body, "TokenizeChatRequest", chat_errors)
    if completion is not None and chat is not None:
        own_completion = sum(k in body for k in _TOKENIZE_COMPLETION_FIELDS)
        own_chat = sum(k in body for k in _TOKENIZE_CHAT_FIELDS)
        return ("chat", chat) if own_chat > own_completion else ("completion", completion)
    if completion is not None:
        return "completion", completion
    if chat is not None:
        return "chat", chat
    raise RequestError.validation(completion_errors + chat_errors)


_TOKENIZE_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
_TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "add_generation_prompt",
    "return_token_strs",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "response_format",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "tools",
)


def _tokenize_member(body: dict[str, Any], member: str, errors: list[Any]) -> dict[str, Any] | None:
    """The body's fields as one union member, or None with its errors appended."""

    def error(kind: str, msg: str, loc: tuple[Any, ...], value: Any) -> None:
        errors.append({"type": kind, "loc": ("body", member, *loc), "msg": msg, "input": value})

    def flag(key: str, default: bool, nullable: bool = False) -> bool:
        value = body.get(key, default)
        if value is None and nullable:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _BOOL_STRINGS:
            return value.lower() in ("true", "1", "yes", "on", "t", "y")
        error(
            "bool_parsing" if isinstance(value, str) else "bool_type",
            "Input should be a valid boolean"
            + (", unable to interpret input" if isinstance(value, str) else ""),
            (key,),
            value,
        )
        return default

    before = len(errors)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        error("string_type", "Input should be a valid string", ("model",), model)
    fields: dict[str, Any] = {"return_token_strs": flag("return_token_strs", False, True)}
    if member == "TokenizeCompletionRequest":
        if "prompt" not in body:
            error("missing", "Field required", ("prompt",), body)
        elif not isinstance(body["prompt"], str):
            error("string_type", "Input should be a valid string", ("prompt",), body["prompt"])
        fields["prompt"] = body.get("prompt")
        fields["add_special_tokens"] = flag("add_special_tokens", True)
        return fields if len(errors) == before else None
    # TokenizeChatRequest's model validator (mode="before") runs ahead of its fields.
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        errors.append(
            {
                "type": "value_error",
                "loc": ("body", member),
                "msg": f"Value error, {message}",
                "input": body,
                "ctx": {"error": ValueError(message)},
            }
        )
        return None
    messages = body.get("messages")
    if "messages" not in body:
        error("missing", "Field required", ("messages",), body)
    elif not isinstance(messages, list):
        error("list_type", "Input should be a valid list", ("messages",), messages)
    else:
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                error("model_type", "Input should be a valid dictionary", ("messages", i), message)
            elif not isinstance(message.get("role"), str):
                error("missing", "Field required", ("messages", i, "role"), message)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        error("list_type", "Input should be a valid list", ("tools",), tools)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        error("dict_type", "Input should be a valid dictionary", ("chat_template_kwargs",), kwargs)
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        error("string_type", "Input should be a valid string", ("chat_template",), template)
    fields.update(
        messages=messages,
        tools=tools,
        chat_template=template,
        chat_template_kwargs=kwargs,
        add_generation_prompt=flag("add_generation_prompt", True),
        continue_final_message=flag("continue_final_message", False),
        add_special_tokens=flag("add_special_tokens", False),
    )
    return fields if len(errors) == before else None


# pydantic's lax-mode strings for booleans.
_BOOL_STRINGS = ("0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes")


def create_app(config: SimConfig, tokenizer: SimTokenizer | None = None) -> web.Application:
    """Build the simulator's aiohttp application (tokenizer loaded here, synchronously)."""
    return VllmSim(config, tokenizer).create_app()


def get_sim(app: web.Application) -> VllmSim:
    return app[SIM_KEY]
