"""``POST /v1/responses`` (and its stored-response routes) as vLLM 0.34 serves them for a
model on the chat-template path; on a gpt-oss model the prompt is vLLM's harmony rendering
of the request (:mod:`vllm_sim.responses_harmony`), the rest as below.

vLLM's Responses handler converts the request's ``instructions`` and ``input`` items into chat
messages (:mod:`vllm_sim.responses_protocol`), renders them with the chat template and runs
one generation. The simulator does the same on its own chat path: the messages render
through the simulator's chat rendering (the templates, flags and tokenizer modes of
``/v1/chat/completions``), so a Responses request's ``input_tokens`` equal the
``prompt_tokens`` of the chat request vLLM builds from it, and generation runs in the
simulator's KV engine with the same ``x-sim-*`` steering headers. Reproduced:

* **Refusals, in vLLM's order.** The body (``application/json`` only), then the request
  model's errors (FastAPI's 400, or a ``VLLMValidationError`` from a model validator as
  ``BadRequestError``); then the handler: an unknown ``model`` (404 ``NotFoundError``,
  ``model`` may be left out), ``background`` while the store is off (400
  ``invalid_request_error``, param ``background``), ``previous_input_messages`` with
  ``previous_response_id``, a ``chat_template`` among ``chat_template_kwargs``, an unknown
  ``previous_response_id`` (404 ``invalid_request_error``, param ``response_id`` -- with the
  store off every id is unknown), the conversion's refusals (unsupported item type,
  encrypted reasoning), ``max_output_tokens`` over ``max_model_len``, a template failure, a
  prompt over ``max_model_len`` (the tokenizer's check), a prompt of exactly
  ``max_model_len`` (the handler's ``>=`` check, param ``input``), then the sampling
  checks.
* **The store.** vLLM keeps responses only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
  (default off): ``store: true`` (the field's default) is then silently turned off,
  ``background: true`` is refused, ``previous_response_id`` is answered 404, and
  ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` answer 404 ("Response
  with id '...' not found."). The simulator has no store switch: it is always vLLM's default.
* **The answer.** A ``response`` object (``resp_...``; ``status`` ``completed``, or
  ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when the length
  cap cut the generation) with one assistant ``message`` item holding one ``output_text``
  (no content part when nothing was generated) and vLLM's ``usage``: ``input_tokens``,
  ``input_tokens_details.cached_tokens`` (the prefix-cache hit, always reported),
  ``cache_write_tokens`` and the empty per-turn lists, ``output_tokens``,
  ``output_tokens_details.reasoning_tokens: 0``, ``total_tokens``.
* **The stream**: ``event: <type>`` / ``data: <json>`` pairs with ``sequence_number``
  from 0: ``response.created`` and ``response.in_progress`` (the response in progress,
  ``usage: null``), then with the first non-empty engine output ``response.output_item.added``
  and ``response.content_part.added``, one ``response.output_text.delta`` per engine output
  (``x-sim-chunk-tokens`` tokens; empty deltas skipped), ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, and ``response.completed``
  or, when the length cap cut it, ``response.incomplete``, with the usage. No ``[DONE]``.

The simulator has no reasoning or tool parser, so its output is always one message (vLLM
without ``--reasoning-parser`` / ``--tool-call-parser`` answers the same way).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from vllm_sim import protocol
from vllm_sim.anthropic import (
    ENGINE_DEAD_CLIENT_MESSAGE,
    UNTRUSTED_TEMPLATE,
    _read_json,
    _Refused,
    _simulated,
)
from vllm_sim.engine_tokenizers import HarmonySimTokenizer, MistralSimTokenizer
from vllm_sim.record import RequestRecord
from vllm_sim.responses_harmony import harmony_messages, refuse_logprobs, render_harmony
from vllm_sim.responses_protocol import (
    ResponsesError,
    ResponsesRequest,
    Sampling,
    VLLMValidationError,
    body_errors,
    construct_input_messages,
    construct_tool_dicts,
    fastapi_validation_body,
    now,
    output_message,
    output_text_part,
    response_body,
    should_continue_final_message,
    to_sampling,
    usage_body,
)
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

# vLLM's VLLM_ENABLE_RESPONSES_API_STORE default: responses are not stored.
STORE_ENABLED = False
BACKGROUND_NEEDS_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {protocol.dumps(event)}\n\n".encode()


def not_found(response_id: str) -> ResponsesError:
    return ResponsesError.invalid(
        f"Response with id '{response_id}' not found.", "response_id", status=404
    )


class _Prepared:
    def __init__(self, req: ResponsesRequest, prompt_ids: list[int], sampling: Sampling) -> None:
        self.req = req
        self.prompt_ids = prompt_ids
        self.sampling = sampling


class ResponsesRoutes:
    """The Responses routes of one simulator."""

    def __init__(self, sim: VllmSim) -> None:
        self.sim = sim

    # --- request handling ---------------------------------------------------------------

    async def _read(self, request: web.Request) -> tuple[ResponsesRequest, Steering]:
        record: RequestRecord | None = request.get(RECORD_KEY)
        try:
            steering = Steering.from_headers(request.headers, self.sim.config)
        except RequestError as err:
            raise ResponsesError(400, str(err)) from err
        raw = await request.read()
        try:
            body = _read_json(raw, request.headers.get("Content-Type"))
        except _Refused:
            if steering.error_status is not None:
                raise ResponsesError(steering.error_status, _simulated(steering)) from None
            raise
        if record is not None and isinstance(body, dict):
            record.note_body(body)
        if steering.error_status is not None:
            raise ResponsesError(steering.error_status, _simulated(steering))
        try:
            parsed = ResponsesRequest.model_validate(body)
        except ValidationError as exc:
            errors = body_errors(exc.errors(include_url=False))
            raise _Refused(400, fastapi_validation_body(errors)) from exc
        except VLLMValidationError as exc:
            raise ResponsesError.from_validation(exc) from exc
        return parsed, steering

    def _check_request(self, req: ResponsesRequest) -> None:
        """The handler's checks before rendering (``_create_responses``)."""
        served = self.sim.config.served_model_name
        if req.model and req.model != served:
            raise ResponsesError(
                404,
                f"The model `{req.model}` does not exist. Valid aliases: {served}.",
                "NotFoundError",
                "model",
            )
        if isinstance(self.sim.tokenizer, HarmonySimTokenizer):
            refuse_logprobs(req)
        if req.store and not STORE_ENABLED and req.background:
            raise ResponsesError.invalid(BACKGROUND_NEEDS_STORE, "background")
        if req.previous_input_messages and req.previous_response_id:
            raise ResponsesError.invalid(
                "Only one of `previous_input_messages` and `previous_response_id` can be set.",
                "previous_response_id",
            )
        kwargs = req.chat_template_kwargs
        if kwargs and kwargs.get("chat_template") is not None:
            raise ResponsesError(400, UNTRUSTED_TEMPLATE)
        if req.store and not STORE_ENABLED:
            req.store = False  # silently, as vLLM does
        if req.previous_response_id is not None:
            raise not_found(req.previous_response_id)  # nothing is ever stored

    def render(self, req: ResponsesRequest) -> list[int]:
        """The conversion and the chat rendering (vLLM's ``render_responses``)."""
        sim = self.sim
        if isinstance(sim.tokenizer, HarmonySimTokenizer):
            # gpt-oss: vLLM renders the request itself through harmony, not as a chat.
            effort_map = sim.chat_flags.reasoning_effort_map
            conversation = harmony_messages(sim.tokenizer, req, effort_map)
            self._check_max_output_tokens(req)
            ids = render_harmony(sim.tokenizer, conversation)
            return self._within_context(ids, exact=True)
        try:
            messages = construct_input_messages(req)
        except VLLMValidationError as exc:
            raise ResponsesError.from_validation(exc) from exc
        tools = construct_tool_dicts(req, sim.chat_flags.exclude_tools_when_tool_choice_none)
        self._check_max_output_tokens(req)
        continue_final = should_continue_final_message(req.input)
        chat = ChatMessages(messages)
        chat.reasoning_effort = req.reasoning.effort if req.reasoning is not None else None
        try:
            ids = list(
                sim.tokenizer.encode_chat(
                    chat,
                    tools=tools,
                    chat_template=None,
                    add_generation_prompt=not continue_final,
                    continue_final_message=continue_final,
                    chat_template_kwargs=req.chat_template_kwargs,
                    add_special_tokens=False,
                    flags=sim.chat_flags,
                )
            )
        except PromptError as exc:
            raise ResponsesError(400, str(exc)) from exc
        return self._within_context(ids, exact=isinstance(sim.tokenizer, MistralSimTokenizer))

    def _check_max_output_tokens(self, req: ResponsesRequest) -> None:
        limit = self.sim.max_model_len
        if req.max_output_tokens is not None and req.max_output_tokens > limit:
            raise ResponsesError.from_validation(
                VLLMValidationError(
                    f"max_output_tokens={req.max_output_tokens} cannot be greater than "
                    f"max_model_len={limit}. Please request fewer output tokens.",
                    parameter="max_output_tokens",
                    value=req.max_output_tokens,
                )
            )

    def _within_context(self, ids: list[int], *, exact: bool) -> list[int]:
        """``ids`` when they fit ``max_model_len``; a prompt tokenized with truncation at
        ``max_model_len + 1`` (not ``exact``) reports that many tokens."""
        limit = self.sim.max_model_len
        if len(ids) > limit:
            seen = len(ids) if exact else limit + 1
            qualifier = "at least " if seen == limit + 1 else ""
            raise ResponsesError.from_validation(
                VLLMValidationError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt contains {qualifier}{seen} input tokens, which exceeds this "
                    "limit even without any output tokens. Please reduce the length of the "
                    "input prompt.",
                    parameter="input_tokens",
                    value=seen,
                )
            )
        return ids

    def _prepare(self, req: ResponsesRequest) -> _Prepared:
        ids = self.render(req)
        limit = self.sim.max_model_len
        if len(ids) >= limit:
            raise ResponsesError.invalid(
                f"The engine prompt length {len(ids)} exceeds the max_model_len {limit}. "
                "Please reduce prompt.",
                "input",
            )
        try:
            sampling = to_sampling(req, limit - len(ids))
        except VLLMValidationError as exc:
            raise ResponsesError.from_validation(exc) from exc
        return _Prepared(req, ids, sampling)

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            req, steering = await self._read(request)
            self._check_request(req)
            prepared: _Prepared = await self.sim._off_loop(lambda: self._prepare(req))
            if steering.end_after is not None and not req.stream:
                raise ResponsesError(400, "x-sim-end-after applies to streamed requests only")
        except _Refused as refused:
            return _json_response(refused.body, refused.status)
        except ResponsesError as err:
            return _json_response(err.body, err.status)
        return await self._generate(request, prepared, steering)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}``: nothing is stored, so every id is unknown."""
        err = not_found(request.match_info["response_id"])
        return _json_response(err.body, err.status)

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses/{id}/cancel``: likewise unknown."""
        err = not_found(request.match_info["response_id"])
        return _json_response(err.body, err.status)

    # --- generation ----------------------------------------------------------------------

    def _usage(self, choice: _Choice, output_tokens: int) -> dict[str, Any]:
        prompt = len(choice.prompt_ids)
        config = self.sim.config
        read = choice.req.cached_tokens
        block = config.block_size
        # Prompt blocks this request wrote to the prefix cache (its full blocks, less the hit).
        created = max(0, prompt // block * block - read) if config.enable_prefix_caching else 0
        return usage_body(prompt, output_tokens, read, created)

    def _body(
        self,
        prepared: _Prepared,
        created_at: int,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        return response_body(
            prepared.req,
            prepared.sampling,
            model_name=self.sim.config.served_model_name,
            created_at=created_at,
            output=output,
            status=status,
            usage=usage,
        )

    async def _generate(
        self, request: web.Request, prepared: _Prepared, steering: Steering
    ) -> web.StreamResponse:
        sim = self.sim
        req = prepared.req
        common = CommonParams(
            model=sim.config.served_model_name,
            stream=bool(req.stream),
            stream_options=None,
            max_tokens=prepared.sampling.max_tokens,
            request_id=None,
            return_token_ids=False,
            n=1,
            ignore_eos=req.ignore_eos,
            cache_salt=req.cache_salt,
        )
        choice = sim._new_choice(
            0, prepared.prompt_ids, common, steering, f"{req.request_id}_0", "responses", None
        )

        def answer(feed: _Feed) -> Awaitable[web.StreamResponse]:
            if req.stream:
                return self._stream(request, prepared, steering, choice, feed)
            return self._unary(request, prepared, steering, choice, feed)

        return await sim.generate(request, [choice], steering, answer)

    async def _unary(
        self,
        request: web.Request,
        prepared: _Prepared,
        steering: Steering,
        choice: _Choice,
        feed: _Feed,
    ) -> web.StreamResponse:
        sim = self.sim
        created_at = now()
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
                err = ResponsesError(500, ENGINE_DEAD_CLIENT_MESSAGE, "InternalServerError")
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
        status = "incomplete" if finish == "length" else "completed"
        text = "".join(choice.texts)
        parts = [output_text_part(text, None)] if text else []
        item = output_message(f"msg_{protocol.random_uuid()}", parts, status)
        usage = self._usage(choice, len(choice.output_ids))
        choice.req.sent = len(choice.output_ids)
        return _json_response(self._body(prepared, created_at, [item], status, usage))

    async def _stream(
        self,
        request: web.Request,
        prepared: _Prepared,
        steering: Steering,
        choice: _Choice,
        feed: _Feed,
    ) -> web.StreamResponse:
        sim = self.sim
        created_at = now()
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        sequence = 0

        async def send(event: dict[str, Any]) -> None:
            nonlocal sequence
            event["sequence_number"] = sequence
            sequence += 1
            ordered = {k: event[k] for k in sorted(event)}  # the SDK events' field order
            await resp.write(_sse(ordered))

        initial = self._body(prepared, created_at, [], "in_progress", None)
        await send({"response": initial, "type": "response.created"})
        await send({"response": initial, "type": "response.in_progress"})

        item_id: str | None = None
        accumulated = ""
        output: list[dict[str, Any]] = []
        pending: list[int] = []
        finish: str | None = None

        async def flush(finish_as: str | None = None) -> None:
            """One engine output: the pending tokens (x-sim-chunk-tokens of them)."""
            nonlocal item_id, accumulated, finish
            indices = pending[:]
            pending.clear()
            if not indices and finish_as is None:
                return
            text = "".join(sim._token(choice, i)[1] for i in indices)
            done = indices[-1] + 1 if indices else choice.req.sent
            if done == choice.req.target_tokens:
                finish = choice.req.finish_reason
            finish = finish_as or finish
            if text:
                if item_id is None:
                    item_id = f"msg_{protocol.random_uuid()}"
                    await send(
                        {
                            "item": output_message(item_id, [], "in_progress"),
                            "output_index": 0,
                            "type": "response.output_item.added",
                        }
                    )
                    await send(
                        {
                            "content_index": 0,
                            "item_id": item_id,
                            "output_index": 0,
                            "part": output_text_part("", []),
                            "type": "response.content_part.added",
                        }
                    )
                accumulated += text
                await send(
                    {
                        "content_index": 0,
                        "delta": text,
                        "item_id": item_id,
                        "logprobs": [],
                        "output_index": 0,
                        "type": "response.output_text.delta",
                    }
                )
            choice.req.sent = done

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
                    # The engine died: vLLM's generator raises and the stream breaks off.
                    sim._cut_connection(request, [choice])
                    return resp
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
        status = "incomplete" if finish == "length" else "completed"
        if item_id is not None:
            part = output_text_part(accumulated, None)
            item = output_message(item_id, [part], status)
            await send(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "logprobs": [],
                    "output_index": 0,
                    "text": accumulated,
                    "type": "response.output_text.done",
                }
            )
            await send(
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": 0,
                    "part": part,
                    "type": "response.content_part.done",
                }
            )
            await send({"item": item, "output_index": 0, "type": "response.output_item.done"})
            output.append(item)
        usage = self._usage(choice, choice.req.sent)
        final = self._body(prepared, created_at, output, status, usage)
        terminal = "response.incomplete" if status == "incomplete" else "response.completed"
        await send({"response": final, "type": terminal})
        await resp.write_eof()
        return resp
