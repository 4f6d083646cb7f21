"""Counting with the engine's own ``/tokenize``: exact by construction.

For a model whose rendering kvgate cannot reproduce (or by the operator's choice), every
count is asked of the vLLM that serves it. vLLM's ``/tokenize`` takes a chat (``messages``,
``tools``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``)
or a completion ``prompt`` (with ``add_special_tokens``) and renders and tokenizes it on the
same path its generation routes take; its answer is ``{count, max_model_len, tokens,
token_strs}``. A count is one HTTP round trip, so:

* every call has a deadline (``timeout_s``, its wait for a free connection included);
  past it, or when the engine cannot answer, ``EngineCountUnavailable`` says whether the
  model refuses (503 + Retry-After) or admits at its upper bound (the whole context);
* the calls in flight to one URL are bounded, and handed out to tenants in the counting
  service's fair order under its per-tenant bound (``service.TokenizerService``);
* one HTTP client (connection pool) per URL and key, reused by every call;
* identical requests are counted once (``EngineCountCache``): the key is a digest of the
  exact body sent, the URL and the model's ``cache_generation``. The same body sent to the
  same engine renders the same prompt, with one exception that keeps chats out of the
  cache by default: a template that reads the clock.

A 400 from the engine is the engine refusing the prompt (roles out of order, a template
error): the request it would generate from is refused the same way, so it is answered as
an unrenderable prompt with the engine's message.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aiohttp

from kvgate.tokenize.engine_flags import NO_FLAGS, EngineFlags, is_inline_template
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError

if TYPE_CHECKING:
    from kvgate.config.model import BackendConfig, ModelConfig
    from kvgate.tokenize.counter import CountingApi

log = logging.getLogger("kvgate.tokenize")

# vLLM's JSONResponse writes TokenizeResponse's fields in declaration order without spaces:
# the count is read from the answer's first bytes, not by parsing a list of every token id.
_ANSWER_PREFIX = re.compile(rb'^\{"count":(\d+),"max_model_len":(\d+),')
# An id takes at most ~8 bytes of JSON and a prompt has at most one token per byte (plus
# what a template adds): a larger answer is not a /tokenize answer.
_ANSWER_BYTES_PER_INPUT_BYTE = 16
_ANSWER_BASE_BYTES = 1024 * 1024
# About what one cache entry takes (a 16-byte key, its count and time, the LRU's node).
CACHE_ENTRY_BYTES = 160


class EngineCountUnavailable(Exception):
    """The engine could not count in time (slow, down, an unusable answer).

    ``reserve_upper_bound``: the model admits at its upper bound instead of refusing.
    """

    def __init__(
        self, model: str, detail: str, *, retry_after_s: float, reserve_upper_bound: bool
    ) -> None:
        super().__init__(f"the engine could not count a prompt of model '{model}': {detail}")
        self.model = model
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.reserve_upper_bound = reserve_upper_bound


class _EngineFailure(Exception):
    """One /tokenize call failed; the counter turns it into EngineCountUnavailable."""


class EngineCountCache:
    """A thread-safe LRU of request digest -> count, bounded in bytes, entries aged out."""

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.capacity = max_bytes // CACHE_ENTRY_BYTES
        self.ttl_s = ttl_s
        self._data: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> int | None:
        now = time.monotonic()
        with self._lock:
            entry = self._data.get(key)
            if entry is None or now - entry[1] > self.ttl_s:
                if entry is not None:
                    del self._data[key]
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: bytes, count: int) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = (count, time.monotonic())
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


@dataclass(eq=False)
class EngineEndpoint:
    """One engine's /tokenize and the HTTP client (connection pool) every call reuses."""

    url: str
    api_key: str | None = None
    _session: aiohttp.ClientSession | None = field(default=None, init=False, repr=False)

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.url, self.api_key)

    def _client(self) -> aiohttp.ClientSession:
        # Made on the event loop at first use (counters may be built on a reload's thread).
        if self._session is None or self._session.closed:
            headers = {"Content-Type": "application/json"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            # The concurrency bound is the service's fair lane; the pool only reuses.
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            )
        return self._session

    async def tokenize(self, body: bytes) -> tuple[int, int]:
        """(count, max_model_len) of one /tokenize call; the caller holds the deadline."""
        limit = _ANSWER_BASE_BYTES + _ANSWER_BYTES_PER_INPUT_BYTE * len(body)
        try:
            async with self._client().post(self.url, data=body) as resp:
                raw = await _read_capped(resp, limit)
                status = resp.status
        except (aiohttp.ClientError, OSError) as exc:
            raise _EngineFailure(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if status == 400:
            # The engine refuses this prompt: so would its generation route.
            raise PromptRenderError(_error_message(raw) or "the engine refused the prompt")
        if status != 200:
            raise _EngineFailure(f"{self.url}: HTTP {status}: {_error_message(raw)}")
        return _parse_answer(raw, self.url)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise _EngineFailure(f"an answer of {resp.content_length} bytes, over {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _EngineFailure(f"an answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_answer(raw: bytes, url: str) -> tuple[int, int]:
    match = _ANSWER_PREFIX.match(raw)
    if match is not None:
        return int(match.group(1)), int(match.group(2))
    try:  # another serializer's spacing or order: read it whole
        answer = json.loads(raw)
        count, max_model_len = answer["count"], answer.get("max_model_len", 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"count {count!r}")
        return count, int(max_model_len or 0)
    except (ValueError, KeyError, TypeError) as exc:
        raise _EngineFailure(f"{url}: not a /tokenize answer: {exc}") from exc


def _error_message(raw: bytes) -> str:
    try:
        answer = json.loads(raw)
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else answer.get("message")
        if isinstance(message, str):
            return message[:500]
    except (ValueError, AttributeError):
        pass
    return raw[:200].decode("utf-8", "replace")


def _canonical(body: dict[str, Any]) -> bytes:
    # Key order is kept, never sorted: templates dump tools and arguments with `tojson` in
    # the order the client wrote them, so a reordered body can render another prompt.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class EngineCall:
    """One /tokenize body, and its cache key when its count may be cached."""

    body: bytes
    cache_key: bytes | None


class EngineCounter:
    """Builds one model's /tokenize bodies and remembers their counts; the service sends
    them (``TokenizerService`` schedules the calls fairly, under the deadline)."""

    engine = "engine-tokenize"
    engine_reason = "counted by the engine's /tokenize"
    # Its defaults and template are the engine's own at /tokenize; kvgate applies the
    # effort map and the tool exclusion, which /tokenize cannot see.
    engine_flags: EngineFlags = NO_FLAGS

    def __init__(
        self,
        endpoint: EngineEndpoint,
        *,
        name: str,
        timeout_s: float,
        max_concurrency: int,
        reserve_upper_bound: bool,
        retry_after_s: float = 1.0,
        cache_max_bytes: int = 0,
        cache_ttl_s: float = 600.0,
        cache_chats: bool = False,
        cache_generation: str = "",
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.reserve_upper_bound = reserve_upper_bound
        self.retry_after_s = retry_after_s
        self.cache = EngineCountCache(cache_max_bytes, cache_ttl_s)
        self.cache_chats = cache_chats
        # Digests are scoped to this engine and model generation: an engine serving other
        # weights under the same name (a new cache_generation) never reads old counts.
        scope = _canonical({"url": endpoint.url, "model": name, "generation": cache_generation})
        self._cache_key = hashlib.sha256(scope).digest()
        self.max_model_len: int | None = None
        # Logged once per outage, not once per refused request.
        self._failing = False

    def _call(self, body: dict[str, Any], cacheable: bool) -> EngineCall:
        encoded = _canonical(body)
        key = None
        if cacheable and self.cache.capacity > 0:
            key = hashlib.blake2b(encoded, key=self._cache_key, digest_size=16).digest()
        return EngineCall(encoded, key)

    def chat_call(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool,
        response_format: Any = None,
    ) -> EngineCall:
        """TokenizeChatRequest: the chat fields as the client sent them for generation.

        ``response_format`` goes along as sent: vLLM's renderers read it on both routes
        (Mistral, Cohere and Kimi models write it into the prompt)."""
        _refuse_images(messages)
        body: dict[str, Any] = {
            "model": self.name,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": add_special_tokens,
        }
        if tools is not None:
            body["tools"] = tools
        kwargs = _generation_template_kwargs(chat_template_kwargs)
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        if response_format is not None:
            body["response_format"] = response_format
        return self._call(body, self.cache_chats)

    def text_call(self, text: str, *, add_special_tokens: bool) -> EngineCall:
        """TokenizeCompletionRequest: a tokenizer's function of the text and the flag."""
        body = {"model": self.name, "prompt": text, "add_special_tokens": add_special_tokens}
        return self._call(body, True)

    def completion_calls(
        self, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> tuple[int, list[EngineCall]]:
        """A completions prompt as (tokens known without asking, calls to make): token ids
        count as given, each text of a batch is one call (the engine's one prompt each)."""
        if isinstance(prompt, str):
            return 0, [self.text_call(prompt, add_special_tokens=True)]
        if not isinstance(prompt, Sequence) or not prompt:
            raise PromptRenderError("prompt must be a string, a list of token ids, or a batch")
        if all(_is_token_id(t) for t in prompt):
            return len(prompt), []
        known = 0
        calls: list[EngineCall] = []
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                calls.append(self.text_call(item, add_special_tokens=True))
            elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
                known += len(item)
            else:
                raise PromptRenderError(
                    f"prompt[{i}] must be a string or a non-empty list of token ids"
                )
        return known, calls

    def unavailable(self, detail: str) -> EngineCountUnavailable:
        """The refusal (or bound) for a count the engine did not give; the first of an
        outage is logged."""
        if not self._failing:
            self._failing = True
            log.warning(
                "the engine cannot count this model's prompts",
                extra={"model": self.name, "url": self.endpoint.url, "error": detail},
            )
        return EngineCountUnavailable(
            self.name,
            detail,
            retry_after_s=self.retry_after_s,
            reserve_upper_bound=self.reserve_upper_bound,
        )

    async def send(self, call: EngineCall) -> int:
        """One /tokenize call (no deadline of its own: the service holds it)."""
        try:
            count, max_model_len = await self.endpoint.tokenize(call.body)
        except _EngineFailure as exc:
            raise self.unavailable(str(exc)) from None
        if max_model_len and max_model_len != self.max_model_len:
            if self.max_model_len is None:
                log.info(
                    "the engine counts this model's prompts",
                    extra={
                        "model": self.name,
                        "url": self.endpoint.url,
                        "max_model_len": max_model_len,
                    },
                )
            self.max_model_len = max_model_len
        if self._failing:
            self._failing = False
            log.info("the engine counts again", extra={"model": self.name})
        if call.cache_key is not None:
            self.cache.put(call.cache_key, count)
        return count


def _generation_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The template keywords vLLM's chat route renders a request with, for /tokenize.

    The chat route adds the request's ``reasoning_effort`` to the client's
    ``chat_template_kwargs`` (over the client's own) and, unless the client set it,
    ``enable_thinking = reasoning_effort != "none"``. /tokenize has no reasoning_effort
    field, so both go in as keywords. The request parser carries the effort on the kwargs
    mapping itself (a ``reasoning_effort`` attribute)."""
    effort = getattr(kwargs, "reasoning_effort", None)
    if effort is None:
        return None if kwargs is None else dict(kwargs)
    merged = dict(kwargs or {})
    merged["reasoning_effort"] = effort
    merged.setdefault("enable_thinking", effort != "none")
    return merged


def _refuse_images(messages: list[dict[str, Any]]) -> None:
    """Image parts are not sent to a counting engine: its /tokenize would fetch their URLs
    with none of kvgate's checks (docs/counting.md, "Images"), and the generation request
    after it too."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_image"):
                raise PromptRenderError(
                    f"messages[{i}].content[{j}]: images are not counted for a model counted "
                    "by its engine (counting: engine)"
                )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_model_counter(
    model: ModelConfig, backend: BackendConfig, cache_dir: Path
) -> CountingApi | EngineCounter:
    """The model's counter as configured: its engine's, or its local tokenizer's (loaded
    now; ``TokenizerLoadError`` when it cannot be)."""
    flags = engine_flags_of(model)
    if model.counting == "engine":
        # The local tokenizer is not read: the engine's answer is the count.
        engine = engine_counter_for(model, backend)
        engine.engine_flags = flags
        return engine
    from kvgate.tokenize.counter import PromptCounter
    from kvgate.tokenize.loader import resolve_tokenizer_dir
    from kvgate.tokenize.modes import load_counter
    from kvgate.tokenize.vision import VisionLimits

    assert model.tokenizer is not None  # the config requires it for local counting
    counter = load_counter(
        resolve_tokenizer_dir(model.tokenizer, cache_dir),
        name=model.name,
        counting_engine=model.counting_engine,
        tokenizer_mode=model.tokenizer_mode,
        harmony_system_instructions=model.harmony_system_instructions,
        engine_flags=flags,
    )
    if isinstance(counter, PromptCounter) and counter.vision is not None:
        settings = model.vision
        try:
            spec = counter.vision.with_processor_kwargs(settings.mm_processor_kwargs)
        except ValueError as exc:
            raise TokenizerLoadError(model.name, f"vision.mm_processor_kwargs: {exc}") from None
        counter.vision = spec.with_limits(
            VisionLimits(
                max_images=settings.max_images_per_request,
                max_image_bytes=settings.max_image_bytes,
                max_image_pixels=settings.max_image_pixels,
                remote_images=settings.remote_images,
                allowed_hosts=frozenset(h.lower().rstrip(".") for h in settings.allowed_url_hosts),
            )
        )
    return counter


def engine_flags_of(model: ModelConfig) -> EngineFlags:
    """The model's ``engine_flags`` as counting applies them (a template path read now;
    ``TokenizerLoadError`` when it cannot be)."""
    settings = model.engine_flags
    template = settings.chat_template
    if template is not None and not is_inline_template(template):
        try:
            template = Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(settings.chat_template or "", str(exc)) from exc
    return EngineFlags(
        default_chat_template_kwargs=MappingProxyType(dict(settings.default_chat_template_kwargs)),
        reasoning_effort_map=MappingProxyType(
            {str(k): v for k, v in settings.reasoning_effort_map.items()}
        ),
        chat_template=template,
        chat_template_content_format=settings.chat_template_content_format,
        exclude_tools_when_tool_choice_none=settings.exclude_tools_when_tool_choice_none,
    )


def engine_counter_for(model: ModelConfig, backend: BackendConfig) -> EngineCounter:
    """The counter of a `counting: engine` model (the config validated its URL)."""
    from kvgate.config.model import engine_tokenize_url

    url = engine_tokenize_url(model, backend)
    if url is None:  # the config's validation refuses this first
        raise ValueError(f"model '{model.name}' has no engine /tokenize URL")
    settings = model.engine_counting
    return EngineCounter(
        EngineEndpoint(url, backend.upstream_api_key),
        name=model.name,
        timeout_s=settings.timeout_s,
        max_concurrency=settings.max_concurrency,
        reserve_upper_bound=settings.on_unavailable == "reserve_max_context",
        retry_after_s=settings.retry_after_s,
        cache_max_bytes=settings.cache_max_bytes,
        cache_ttl_s=settings.cache_ttl_s,
        cache_chats=settings.cache_chats,
        cache_generation=model.cache_generation,
    )
