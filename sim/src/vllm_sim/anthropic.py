"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` as vLLM 0.34 serves them.

vLLM's Anthropic handler converts the request into a chat completion
(:func:`vllm_sim.anthropic_protocol.to_chat_plan`), runs its chat path and converts the answer
back. The simulator does the same on its own chat path: the converted messages render through
the simulator's chat rendering (the same templates, flags and tokenizer modes as
``/v1/chat/completions``), and generation runs in the simulator's KV engine, with the same
``x-sim-*`` steering headers. What vLLM does around that, reproduced here:

* **Probes.** Whether inline system messages are merged into the leading one is decided
  once, as vLLM does at start-up: a Hugging Face template (with tools ``None`` and ``[]``) is
  rendered over ``[system, user, system, user]`` in a bare sandboxed Jinja environment, and
  any failure (e.g. a ``raise_exception`` guard) means "merge"; DeepSeek and Mistral prompts
  are rendered and must keep both system texts in order, distinct from a user turn, with the
  generation prompt still after a trailing one. ``thinking: disabled`` (or
  ``between_tools``) maps to ``reasoning_effort: "none"`` unless rendering with ``"none"``
  fails or renders like one of Anthropic's efforts, then ``"low"``.
* **Refusals, in vLLM's order**, each as an ErrorResponse in Anthropic's shape: an undeclared
  tool in ``tool_addition``/``tool_removal``, a bad ``cache_salt``, an unknown model (404), a
  ``chat_template`` among ``chat_template_kwargs``, ``max_tokens`` over ``max_model_len``, a
  template failure, a prompt over ``max_model_len``, then the sampling checks (temperature,
  top_p, top_k, ``max_tokens`` left at least 1, ``min_tokens``, empty stop strings); an
  enabled ``thinking`` is refused by the engine (a simulator has no ``--reasoning-parser``):
  400 for a plain request, an SSE ``error`` event for a stream (already answered 200).
* **The answer.** A ``message`` (id ``chatcmpl-...``, one text block, ``stop_reason``
  ``end_turn`` / ``max_tokens``, left out when the engine aborted; ``stop_sequence`` left
  out) with ``usage`` ``{input_tokens, output_tokens}``; a stream of named events:
  ``message_start`` (``usage.input_tokens``, ``output_tokens: 0``), ``content_block_start``,
  ``content_block_delta`` (``text_delta``; empty deltas skipped), ``content_block_stop``,
  ``message_delta`` (``stop_reason``, ``stop_sequence: null``, the final usage),
  ``message_stop``; no ``ping`` and no ``[DONE]`` (vLLM sends neither). A failure mid-stream
  closes the open block and ends with an ``error`` event. With
  ``--enable-prompt-tokens-details`` usage adds ``cache_creation_input_tokens`` and
  ``cache_read_input_tokens`` and ``input_tokens`` is what is left of the prompt.
* **count_tokens** renders the same conversion without any length check and answers
  ``{"input_tokens": N, "context_management": {"original_input_tokens": N}}``.

The simulator never generates reasoning or tool calls (it has no reasoning or tool parser),
so its answers hold a single text block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from vllm_sim import protocol
from vllm_sim.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    AnyAnthropicRequest,
    ChatPlan,
    HandlerError,
    body_errors,
    to_chat_plan,
    validation_error_body,
)
from vllm_sim.deepseek_prompts import DeepseekSimTokenizer
from vllm_sim.engine_tokenizers import HarmonySimTokenizer, MistralSimTokenizer
from vllm_sim.record import RequestRecord
from vllm_sim.server import (
    ENGINE_ABORT,
    GENERATION_FAILED,
    RECORD_KEY,
    Steering,
    _Choice,
    _Feed,
    _json_response,
)
from vllm_sim.tokenization import ChatMessages, PromptError
from vllm_sim.validation import CommonParams, RequestError

if TYPE_CHECKING:
    from vllm_sim.server import VllmSim

# Anthropic's efforts, in the order vLLM's disabled-thinking probe tries them.
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
# What EngineDeadError tells API clients (vLLM 0.34).
ENGINE_DEAD_CLIENT_MESSAGE = "The server had an error while processing your request."
THINKING_BUDGET_REFUSED = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set "
    "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
)
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
_INLINE_SYSTEM_MARKERS = ("SYSA", "USRA", "SYSB", "USRB")


class _Refused(Exception):
    """A request answered before the handler runs (a body FastAPI cannot take)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def _http_error(status: int, detail: str) -> _Refused:
    body = protocol.error_body(detail, HTTPStatus(status).phrase, status)
    return _Refused(status, body)


def _read_json(raw: bytes, content_type: str | None) -> Any:
    """The body as FastAPI (0.132 on: strict content types) reads it for vLLM's routes: JSON
    decoded when the content type is JSON, then vLLM's ``validate_json_request`` (exactly
    ``application/json``), then a required body."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    body: Any = None
    if raw:
        if media.startswith("application/") and (
            media == "application/json" or media.endswith("+json")
        ):
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                error = {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
                raise _Refused(400, validation_error_body([error])) from exc
            except Exception as exc:
                raise _http_error(400, "There was an error parsing the body") from exc
        else:
            body = raw
    # validate_json_request compares the raw text before any ";" (not stripped).
    if (content_type or "").lower().split(";", 1)[0] != "application/json":
        message = "Unsupported Media Type: Only 'application/json' is allowed"
        raise _Refused(400, validation_error_body([message]))
    if body is None:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise _Refused(400, validation_error_body([missing]))
    return body


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {protocol.dumps(data)}\n\n".encode()


def _detect_merge_inline_system(template: str | None) -> bool:
    """A Jinja template that cannot render a system message after a user one (as vLLM
    renders it for this probe: bare sandbox, no transformers helpers) needs the merge."""
    if not template:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    roles = ("system", "user", "system", "user")
    try:
        env.from_string(template).render(
            messages=[{"role": role, "content": "t"} for role in roles],
            add_generation_prompt=False,
        )
    except Exception:
        return True
    return False


class AnthropicRoutes:
    """The two Messages routes of one simulator."""

    def __init__(self, sim: VllmSim) -> None:
        self.sim = sim
        self._merge_inline_system: bool | None = None
        self._disabled_thinking_effort: str | None = None

    # --- the probes vLLM runs (once) ------------------------------------------------------

    def _render_ids(self, messages: list[dict[str, Any]], effort: str | None = None) -> list[int]:
        chat = ChatMessages(messages)
        chat.reasoning_effort = effort
        return list(
            self.sim.tokenizer.encode_chat(
                chat, add_generation_prompt=True, flags=self.sim.chat_flags
            )
        )

    def _render_text(self, messages: list[dict[str, Any]]) -> str:
        """A non-Jinja prompt as text (vLLM decodes token prompts with special tokens)."""
        tokenizer = self.sim.tokenizer
        if isinstance(tokenizer, DeepseekSimTokenizer):
            return tokenizer.render_chat(
                ChatMessages(messages), add_generation_prompt=True, flags=self.sim.chat_flags
            )
        ids = self._render_ids(messages)
        return str(tokenizer._tok.decode(ids, skip_special_tokens=False))

    def _renderer_keeps_inline_system(self) -> bool:
        markers = _INLINE_SYSTEM_MARKERS
        messages = [
            {"role": role, "content": marker}
            for role, marker in zip(("system", "user") * 2, markers, strict=True)
        ]

        def between_user_and_system(text: str) -> str:
            return text[text.find(markers[1]) + len(markers[1]) : text.find(markers[2])]

        try:
            full = self._render_text(messages)
            trailing = self._render_text(messages[:3])
            as_user = self._render_text([*messages[:2], {**messages[2], "role": "user"}])
        except Exception:
            return False
        positions = [full.find(marker) for marker in markers]
        if -1 in positions or positions != sorted(positions):
            return False
        separator = between_user_and_system(full)
        if not separator.strip() or separator == between_user_and_system(as_user):
            return False
        generation_prompt = full[positions[-1] + len(markers[-1]) :]
        return trailing.endswith(markers[2] + generation_prompt)

    def merge_inline_system(self) -> bool:
        """vLLM's ``_should_merge_inline_system`` (decided once per server)."""
        if self._merge_inline_system is None:
            tokenizer = self.sim.tokenizer
            if isinstance(tokenizer, MistralSimTokenizer | DeepseekSimTokenizer):
                merge = not self._renderer_keeps_inline_system()
            else:
                merge = False
                no_tools: tuple[list[Any] | None, ...] = (None, [])
                for tools in no_tools:
                    try:
                        template = tokenizer._tok.get_chat_template(
                            self.sim.chat_flags.chat_template, tools=tools
                        )
                    except Exception:
                        template = None
                    merge = merge or _detect_merge_inline_system(template)
            self._merge_inline_system = merge
        return self._merge_inline_system

    def disabled_thinking_effort(self, request: AnyAnthropicRequest) -> str:
        """vLLM's ``DisabledThinkingEffortResolver`` (the server's option left at "auto")."""
        if request.thinking is None or request.thinking.type not in ("disabled", "between_tools"):
            return "none"
        if self._disabled_thinking_effort is None:
            probe = [{"role": "user", "content": "Hi"}]
            try:
                none = self._render_ids(probe, "none")
            except Exception:
                self._disabled_thinking_effort = "low"
                return "low"
            effort = "none"
            for other in ANTHROPIC_EFFORTS:
                try:
                    rendered = self._render_ids(probe, other)
                except Exception:
                    continue
                if rendered == none:
                    effort = "low"
                    break
            self._disabled_thinking_effort = effort
        return self._disabled_thinking_effort

    # --- request handling ---------------------------------------------------------------

    async def _read(
        self, request: web.Request, model: type[AnyAnthropicRequest]
    ) -> tuple[Any, Steering]:
        """Steering headers, then the body validated as vLLM's request model."""
        record: RequestRecord | None = request.get(RECORD_KEY)
        try:
            steering = Steering.from_headers(request.headers, self.sim.config)
        except RequestError as err:
            raise HandlerError(400, str(err)) from err
        raw = await request.read()
        content_type = request.headers.get("Content-Type")
        try:
            body = _read_json(raw, content_type)
        except _Refused:
            if steering.error_status is not None:
                raise HandlerError(steering.error_status, _simulated(steering)) from None
            raise
        if record is not None and isinstance(body, dict):
            record.note_body(body)
        if steering.error_status is not None:
            # The simulated error wins over a bad body, as on the other routes.
            raise HandlerError(steering.error_status, _simulated(steering))
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise _Refused(
                400, validation_error_body(body_errors(exc.errors(include_url=False)))
            ) from exc
        return parsed, steering

    def _prepare(self, req: AnyAnthropicRequest, *, count: bool) -> tuple[ChatPlan, list[int]]:
        """Conversion, model check and rendering, in vLLM's order (the tokenizer thread)."""
        sim = self.sim
        plan = to_chat_plan(
            req,
            merge_inline_system=self.merge_inline_system(),
            disabled_thinking_effort=self.disabled_thinking_effort(req),
        )
        served = sim.config.served_model_name
        if req.model != served:
            raise HandlerError(
                404, f"The model `{req.model}` does not exist. Valid aliases: {served}."
            )
        kwargs = plan.chat_template_kwargs
        if kwargs and kwargs.get("chat_template") is not None:
            raise HandlerError(400, UNTRUSTED_TEMPLATE)
        limit = sim.max_model_len
        if not count and plan.max_tokens is not None and plan.max_tokens > limit:
            raise HandlerError.bad_request(
                f"max_completion_tokens={plan.max_tokens} cannot be greater than "
                f"max_model_len={limit}. Please request fewer output tokens.",
                parameter="max_completion_tokens",
                value=plan.max_tokens,
            )
        messages = ChatMessages(plan.messages)
        messages.reasoning_effort = plan.reasoning_effort
        try:
            ids = list(
                sim.tokenizer.encode_chat(
                    messages,
                    tools=sim.chat_flags.tools_for(plan.tools, plan.tool_choice),
                    chat_template=None,
                    add_generation_prompt=True,
                    continue_final_message=False,
                    chat_template_kwargs=kwargs,
                    add_special_tokens=False,
                    flags=sim.chat_flags,
                )
            )
        except PromptError as exc:
            raise HandlerError(400, str(exc)) from exc
        if not count and len(ids) > limit:
            # A text prompt is tokenized with truncation at max_model_len + 1.
            exact = isinstance(sim.tokenizer, MistralSimTokenizer | HarmonySimTokenizer)
            seen = len(ids) if exact else limit + 1
            qualifier = "at least " if seen == limit + 1 else ""
            raise HandlerError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains {qualifier}{seen} input tokens, which exceeds this limit "
                "even without any output tokens. Please reduce the length of the input prompt.",
                parameter="input_tokens",
                value=seen,
            )
        return plan, ids

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        try:
            req, _ = await self._read(request, AnthropicCountTokensRequest)
            _, ids = await self.sim._off_loop(lambda: self._prepare(req, count=True))
        except _Refused as refused:
            return _json_response(refused.body, refused.status)
        except HandlerError as err:
            return _json_response(err.body, err.status)
        count = len(ids)
        return _json_response(
            {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        )

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req, steering = await self._read(request, AnthropicMessagesRequest)
            plan, ids = await self.sim._off_loop(lambda: self._prepare(req, count=False))
            self._check_sampling(plan, len(ids))
            if steering.end_after is not None and not plan.stream:
                raise HandlerError(400, "x-sim-end-after applies to streamed requests only")
        except _Refused as refused:
            return _json_response(refused.body, refused.status)
        except HandlerError as err:
            return _json_response(err.body, err.status)
        header_id = request.headers.get("X-Request-Id")
        message_id = f"chatcmpl-{header_id if header_id is not None else protocol.random_uuid()}"
        if plan.thinking_token_budget is not None:
            # The engine refuses the request before it is scheduled.
            return await self._engine_refusal(request, plan, THINKING_BUDGET_REFUSED)
        return await self._generate(request, plan, ids, steering, message_id)

    def _check_sampling(self, plan: ChatPlan, prompt_len: int) -> None:
        """``SamplingParams`` built on the clamped max_tokens (vLLM's checks, in order)."""
        assert plan.max_tokens is not None
        max_tokens = min(self.sim.max_model_len - prompt_len, plan.max_tokens)
        temperature = 1.0 if plan.temperature is None else plan.temperature
        top_p = 1.0 if plan.top_p is None else plan.top_p
        top_k = 0 if plan.top_k is None else plan.top_k
        if 0 < temperature < 1e-2:
            temperature = 1e-2  # vLLM raises tiny temperatures, with a warning
        if not math.isfinite(temperature):
            reason = f"temperature must be a finite number, got {temperature}."
        elif temperature < 0.0:
            reason = f"temperature must be non-negative, got {temperature}."
        elif temperature > 2.0:
            reason = f"temperature must be in [0, 2], got {temperature}."
        else:
            reason = ""
        if reason:
            raise HandlerError.bad_request(reason, parameter="temperature", value=temperature)
        if not 0.0 < top_p <= 1.0:
            raise HandlerError.bad_request(
                f"top_p must be in (0, 1], got {top_p}.", parameter="top_p", value=top_p
            )
        if top_k < -1:
            raise HandlerError.bad_request(
                f"top_k must be 0 (disable), or at least 1, got {top_k}."
            )
        if max_tokens < 1:
            raise HandlerError.bad_request(
                f"max_tokens must be at least 1, got {max_tokens}.",
                parameter="max_tokens",
                value=max_tokens,
            )
        if plan.min_tokens < 0:
            raise HandlerError.bad_request(
                f"min_tokens must be greater than or equal to 0, got {plan.min_tokens}."
            )
        if plan.min_tokens > max_tokens:
            raise HandlerError.bad_request(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {plan.min_tokens}."
            )
        if any(not stop for stop in plan.stop or ()):
            raise HandlerError.bad_request("stop cannot contain an empty string.")

    async def _engine_refusal(
        self, request: web.Request, plan: ChatPlan, message: str
    ) -> web.StreamResponse:
        """A request the engine refuses: 400, or (a stream has answered 200) one error event."""
        err = HandlerError(400, message)
        if not plan.stream:
            return _json_response(err.body, err.status)
        resp = await self._open_stream(request)
        await resp.write(_sse("error", err.body))
        await resp.write_eof()
        return resp

    @staticmethod
    async def _open_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        return resp

    # --- generation ----------------------------------------------------------------------

    def _usage(self, choice: _Choice, output_tokens: int) -> dict[str, Any]:
        """vLLM's ``_build_anthropic_usage`` over the chat usage it is given."""
        prompt = len(choice.prompt_ids)
        usage: dict[str, Any] = {"input_tokens": prompt, "output_tokens": output_tokens}
        config = self.sim.config
        if config.enable_prompt_tokens_details:
            # The prefix-cache hit, and the prompt blocks this request wrote to the cache
            # (its full blocks once prefilled, less the hit; none without prefix caching).
            read = choice.req.cached_tokens
            block = config.block_size
            created = max(0, prompt // block * block - read) if config.enable_prefix_caching else 0
            usage["input_tokens"] = max(0, prompt - read - created)
            usage["cache_creation_input_tokens"] = created
            usage["cache_read_input_tokens"] = read
        return usage

    async def _generate(
        self,
        request: web.Request,
        plan: ChatPlan,
        prompt_ids: list[int],
        steering: Steering,
        message_id: str,
    ) -> web.StreamResponse:
        sim = self.sim
        common = CommonParams(
            model=sim.config.served_model_name,
            stream=plan.stream,
            stream_options=None,
            max_tokens=plan.max_tokens,
            request_id=None,
            return_token_ids=False,
            n=1,
            min_tokens=plan.min_tokens,
            cache_salt=plan.cache_salt,
        )
        choice = sim._new_choice(0, prompt_ids, common, steering, message_id, "messages", None)

        def answer(feed: _Feed) -> Awaitable[web.StreamResponse]:
            if plan.stream:
                return self._stream(request, steering, choice, feed, message_id)
            return self._unary(request, steering, choice, feed, message_id)

        return await sim.generate(request, [choice], steering, answer)

    async def _unary(
        self,
        request: web.Request,
        steering: Steering,
        choice: _Choice,
        feed: _Feed,
        message_id: str,
    ) -> web.StreamResponse:
        sim = self.sim
        produced = 0
        while True:
            if steering.stall_after is not None and produced >= steering.stall_after:
                await sim._stall_forever()
            if steering.abort_after is not None and produced >= steering.abort_after:
                sim._cut_connection(request, [choice])
                return web.Response(status=500)  # never reaches the client
            ending = steering.ending_at(produced)
            if ending == GENERATION_FAILED:
                sim.engine.abort(choice.req)
                err = HandlerError(500, ENGINE_DEAD_CLIENT_MESSAGE)
                return _json_response(err.body, err.status)
            if ending == ENGINE_ABORT:
                if len(choice.output_ids) < choice.req.target_tokens:
                    sim.engine.abort(choice.req)
                    choice.aborted = True
                break
            _, i = await feed.next()
            if i is None:
                break
            token_id, text = sim._token(choice, i)
            choice.output_ids.append(token_id)
            choice.texts.append(text)
            produced += 1
        finish = "abort" if choice.aborted else choice.req.finish_reason
        body: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            # An empty answer is still one (empty) text block.
            "content": [{"type": "text", "text": "".join(choice.texts)}],
            "model": sim.config.served_model_name,
        }
        if finish in _STOP_REASONS:
            body["stop_reason"] = _STOP_REASONS[finish]
        body["usage"] = self._usage(choice, len(choice.output_ids))
        choice.req.sent = len(choice.output_ids)
        return _json_response(body)

    async def _stream(
        self,
        request: web.Request,
        steering: Steering,
        choice: _Choice,
        feed: _Feed,
        message_id: str,
    ) -> web.StreamResponse:
        sim = self.sim
        model = sim.config.served_model_name
        resp = await self._open_stream(request)
        started = False  # message_start sent (with the first engine output)
        block_open = False
        pending: list[int] = []
        finish: str | None = None

        async def flush(finish_as: str | None = None) -> None:
            """One engine output: the pending tokens (x-sim-chunk-tokens of them)."""
            nonlocal started, block_open, finish
            indices = pending[:]
            pending.clear()
            if not indices and finish_as is None:
                return
            if not started:
                start: dict[str, Any] = {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": self._usage(choice, 0),
                }
                await resp.write(_sse("message_start", {"type": "message_start", "message": start}))
                started = True
            text = "".join(sim._token(choice, i)[1] for i in indices)
            done = indices[-1] + 1 if indices else choice.req.sent
            if done == choice.req.target_tokens:
                finish = choice.req.finish_reason
            finish = finish_as or finish
            if text:
                if not block_open:
                    await resp.write(
                        _sse(
                            "content_block_start",
                            {
                                "type": "content_block_start",
                                "content_block": {"type": "text", "text": ""},
                                "index": 0,
                            },
                        )
                    )
                    block_open = True
                delta = {"type": "text_delta", "text": text}
                await resp.write(
                    _sse(
                        "content_block_delta",
                        {"type": "content_block_delta", "delta": delta, "index": 0},
                    )
                )
            choice.req.sent = done

        async def close_block() -> None:
            nonlocal block_open
            if block_open:
                stop = {"type": "content_block_stop", "index": 0}
                await resp.write(_sse("content_block_stop", stop))
                block_open = False

        produced = 0
        while True:
            stall = steering.stall_after is not None and produced >= steering.stall_after
            cut = steering.abort_after is not None and produced >= steering.abort_after
            if stall or cut:
                await flush()
                if stall:
                    await sim._stall_forever()
                sim._cut_connection(request, [choice])
                return resp
            ending = steering.ending_at(produced)
            if ending is not None:
                await flush()
                if ending == ENGINE_ABORT:
                    if choice.req.sent < choice.req.target_tokens:
                        sim.engine.abort(choice.req)
                        await flush(finish_as="abort")
                    break
                sim.engine.abort(choice.req)
                if ending == GENERATION_FAILED:
                    # The engine died: the open block is closed, then vLLM's error event.
                    await close_block()
                    err = HandlerError(500, ENGINE_DEAD_CLIENT_MESSAGE)
                    await resp.write(_sse("error", err.body))
                await resp.write_eof()  # x-sim-end-after: the body just ends
                return resp
            _, i = await feed.next()
            if i is None:
                await flush()
                break
            pending.append(i)
            produced += 1
            if len(pending) >= steering.chunk_tokens or i + 1 == choice.req.target_tokens:
                await flush()
        # The usage chunk: the block closes, then the stop reason and the final usage.
        await close_block()
        stop_reason = _STOP_REASONS.get(finish or "stop")
        await resp.write(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": self._usage(choice, choice.req.sent),
                },
            )
        )
        await resp.write(_sse("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp


def _simulated(steering: Steering) -> str:
    return f"Simulated error (x-sim-error: {steering.error_status})"
