"""Counting prompt tokens the way vLLM's OpenAI server does.

* Chat: messages are preprocessed like vLLM (``messages.parse_messages``), rendered with
  the model's chat template (``chat_template.ChatTemplate``), and the prompt string is
  encoded with ``add_special_tokens=False`` (vLLM's default for chat requests: the
  template already wrote BOS and friends).
* Completions: a string prompt is encoded with ``add_special_tokens=True``; a list of
  token ids is counted as given.
* Output text: encoded without special tokens.

Only ``tokenizers`` is used (the same Rust tokenizer transformers wraps); kvgate does
not depend on transformers. Counting cuts the text at added tokens and counts each segment
between them once (``segments``), with the fastest engine that counts exactly like the
model's tokenizer (``engines``: tiktoken's compiled BPE when it passes its checks).
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from tokenizers import Tokenizer

from kvgate.tokenize.chat_template import ChatTemplate, load_template_sources
from kvgate.tokenize.engine_flags import NO_FLAGS, EngineFlags
from kvgate.tokenize.engines import CountingEngine, ReferenceEngine, choose_engine
from kvgate.tokenize.errors import PromptRenderError, TokenizerLoadError
from kvgate.tokenize.messages import (
    developer_as_system,
    kwargs_tools,
    normalize_tools,
    parse_messages,
)
from kvgate.tokenize.request_fields import engine_kwargs
from kvgate.tokenize.segments import (
    MIN_CACHED_CHARS,
    AddedTokenSplitter,
    SegmentCountCache,
    segment_key,
)
from kvgate.tokenize.vision import ImageRef, VisionRule, image_tokens, load_vision_spec

# Named special tokens transformers passes to chat templates (its special_tokens_map).
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


class CountingApi(abc.ABC):
    """What every model's counter offers; subclasses say how text and chats are counted.

    A count is planned (``plan_*``: rendering, cutting, cache look-ups, cheap enough for the
    event loop) and then finished (``finish``: the tokenizing, on a worker when large).
    """

    name: str = ""
    # Why the fastest engine was not taken.
    engine_reason: str = ""
    # The engine's own server options that shape a chat's prompt (set at load).
    engine_flags: EngineFlags = NO_FLAGS

    @property
    def engine(self) -> str:
        """The engine that counts (a metric label)."""
        return ""

    @property
    @abc.abstractmethod
    def max_token_chars(self) -> int:
        """No token covers more characters of text than this (a bound without tokenizing)."""

    @abc.abstractmethod
    def use_cache(self, cache: SegmentCountCache | None) -> None:
        """Share a segment-count cache (the service's); None counts everything afresh."""

    @abc.abstractmethod
    def plan_text(self, text: str, *, add_special_tokens: bool, cache: bool = True) -> CountPlan:
        """How to count `text` (cheap: rendering, cutting, cache look-ups)."""

    @abc.abstractmethod
    def finish(self, plan: CountPlan) -> int:
        """The count a plan stands for (the tokenizing: on a worker when large)."""

    @abc.abstractmethod
    def plan_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> CountPlan:
        """How to count a chat request's prompt as the engine renders it."""

    def count_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> int:
        """Prompt tokens of a chat request (vLLM: render, then encode without specials).

        ``add_special_tokens`` mirrors the request field of the same name (default False).
        """
        return self.finish(
            self.plan_chat(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
            )
        )

    def count_completion(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        *,
        add_special_tokens: bool = True,
    ) -> int:
        """Prompt tokens of a completions request.

        A string is encoded with special tokens (vLLM's default for completions); a list
        of ints is already tokenized and counts as its length. A list of strings or of
        id lists is a batch: vLLM runs one generation per prompt, so this returns the
        SUM over the batch (what the request will occupy in total).
        """
        return self.finish(self.plan_completion(prompt, add_special_tokens=add_special_tokens))

    def plan_completion(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        *,
        add_special_tokens: bool = True,
    ) -> CountPlan:
        """``count_completion`` up to the segments that still need tokenizing."""
        if isinstance(prompt, str):
            return self.plan_text(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, Sequence) or not prompt:
            raise PromptRenderError("prompt must be a string, a list of token ids, or a batch")
        if all(_is_token_id(t) for t in prompt):
            return CountPlan(len(prompt), [], 0)
        plan = CountPlan(0, [], 0)
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                plan = plan.merged(self.plan_text(item, add_special_tokens=add_special_tokens))
            elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
                plan = plan.merged(CountPlan(len(item), [], 0))
            else:
                raise PromptRenderError(
                    f"prompt[{i}] must be a string or a non-empty list of token ids"
                )
        return plan

    def count_text(self, text: str) -> int:
        """Tokens in generated text (no special tokens added)."""
        return self.finish(self.plan_output(text))

    def plan_output(self, text: str) -> CountPlan:
        """``count_text`` up to the segments that still need tokenizing."""
        if not isinstance(text, str):
            raise PromptRenderError("text must be a string")
        # Generated text is new every time: caching it would only evict prompts.
        return self.plan_text(text, add_special_tokens=False, cache=False)


class PromptCounter(CountingApi):
    """Counts tokens for one model. Thread-safe: holds no per-call state."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_config: Mapping[str, Any],
        chat_template: ChatTemplate | None,
        *,
        name: str = "",
        counting_engine: str = "auto",
        spec_source: bytes | None = None,
    ) -> None:
        """``spec_source``: the tokenizer.json bytes, when the caller has them."""
        self.name = name
        self._tokenizer = tokenizer
        self._reference = ReferenceEngine(tokenizer)
        self._chat_template = chat_template
        self._prefix, self._suffix = self._special_affixes(tokenizer, tokenizer_config)
        self._splitter = AddedTokenSplitter.from_added_tokens(
            tokenizer.get_added_tokens_decoder().values(),
            has_normalizer=tokenizer.normalizer is not None,
        )
        # Segments need the splitter; without it only the reference counts whole texts.
        self._engine: CountingEngine = self._reference
        self.engine_reason = "added tokens match in a way plain splitting cannot reproduce"
        if self._splitter is not None:
            source = spec_source if spec_source is not None else tokenizer.to_str().encode()
            choice = choose_engine(
                tokenizer,
                lambda: json.loads(source),
                prefer=counting_engine,
                fingerprint=hashlib.sha256(source).hexdigest(),
            )
            self._engine, self.engine_reason = choice.engine, choice.reason
        self._cache: SegmentCountCache | None = None
        # A vision model's image rule (None: image parts are refused).
        self.vision: VisionRule | None = None
        # Keys the segment digests: this tokenizer's counts are never read by another one.
        self._cache_scope = os.urandom(16)

    @property
    def engine(self) -> str:
        """The engine that counts segments: "compiled-bpe" or "reference"."""
        return "reference" if self._splitter is None else self._engine.name

    def use_cache(self, cache: SegmentCountCache | None) -> None:
        """Share a segment-count cache (the service's); None counts everything afresh."""
        self._cache = cache

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters of its vocabulary form.

        A byte-level BPE entry has one character per byte, and a text character is at least
        one byte, so a text of C characters needs at least ceil(C / max_token_chars) tokens:
        a lower bound found without tokenizing (special tokens are longer than any text
        they stand for, which only makes the bound weaker, never wrong).
        """
        return max(1, max(map(len, self._tokenizer.get_vocab(with_added_tokens=True))))

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path | str,
        *,
        name: str = "",
        counting_engine: str = "auto",
        engine_flags: EngineFlags = NO_FLAGS,
    ) -> Self:
        """``engine_flags``: the engine's --chat-template (in place of the directory's) and
        --chat-template-content-format apply to the template; the rest to each request."""
        path = Path(model_dir)
        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            sources = engine_flags.chat_template or load_template_sources(path)
            specials = {
                key: text
                for key in _SPECIAL_TOKEN_NAMES
                if (text := _token_text(config.get(key))) is not None
            }
            template = (
                ChatTemplate(
                    sources, specials, content_format=engine_flags.chat_template_content_format
                )
                if sources is not None
                else None
            )
            spec_source = (path / "tokenizer.json").read_bytes()
            vision = load_vision_spec(path)
            added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
            if vision is not None and vision.image_token not in added:
                # Counted as one token before expansion, the placeholder must be one: else
                # images are refused rather than counted low.
                vision = None
        except Exception as exc:  # any unreadable file or bad JSON/template is fatal
            raise TokenizerLoadError(str(path), str(exc)) from exc
        counter = cls(
            tokenizer,
            config,
            template,
            name=name or path.name,
            counting_engine=counting_engine,
            spec_source=spec_source,
        )
        counter.engine_flags = engine_flags
        counter.vision = vision
        return counter

    # -- special tokens added by encode(add_special_tokens=True) ---------------------------

    @staticmethod
    def _special_affixes(
        tokenizer: Tokenizer, config: Mapping[str, Any]
    ) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens=True`` puts before and after a single text.

        Mirrors transformers 5's TokenizersBackend: when tokenizer_config sets
        ``add_bos_token`` / ``add_eos_token`` (or tokenizer.json has no post-processor)
        the post-processor becomes ``[bos] $A [eos]`` per those flags; otherwise the one
        in tokenizer.json (e.g. Llama 3's TemplateProcessing adding <|begin_of_text|>)
        decides. For single sequences post-processors add fixed ids, so we measure
        them once instead of re-running them per request.
        """
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or tokenizer.post_processor is None:
            prefix: list[int] = []
            suffix: list[int] = []
            bos = _token_text(config.get("bos_token"))
            eos = _token_text(config.get("eos_token"))
            if config.get("add_bos_token") and bos is not None:
                bos_id = tokenizer.token_to_id(bos)
                if bos_id is not None:
                    prefix.append(bos_id)
            if config.get("add_eos_token") and eos is not None:
                eos_id = tokenizer.token_to_id(eos)
                if eos_id is not None:
                    suffix.append(eos_id)
            return prefix, suffix

        probe = "hello"
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        # A post-processor that rewrites content ids would be exotic; count it as is.
        raise TokenizerLoadError(
            "tokenizer.json", "cannot tell which special tokens its post-processor adds"
        )

    @property
    def special_tokens_added(self) -> int:
        """How many ids ``add_special_tokens=True`` adds to one prompt."""
        return len(self._prefix) + len(self._suffix)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids = self._reference.ids(text)
        if add_special_tokens and (self._prefix or self._suffix):
            return [*self._prefix, *ids, *self._suffix]
        return ids

    # -- counting in two steps: what is known now, and what still has to be tokenized ----

    def plan_text(self, text: str, *, add_special_tokens: bool, cache: bool = True) -> CountPlan:
        """Cut ``text`` at added tokens; count what is cached or short, list the rest."""
        affixes = self.special_tokens_added if add_special_tokens else 0
        if self._splitter is None:
            return CountPlan(affixes, [(None, text)], len(text))
        added, segments = self._splitter.split(text)
        store = self._cache if cache else None
        known = affixes + added
        pending: list[tuple[bytes | None, str]] = []
        pending_chars = 0
        for segment in segments:
            if len(segment) < MIN_CACHED_CHARS:
                known += self._engine.count(segment)
                continue
            key = segment_key(self._cache_scope, segment) if store is not None else None
            cached = store.get(key) if store is not None and key is not None else None
            if cached is not None:
                known += cached
            else:
                pending.append((key, segment))
                pending_chars += len(segment)
        return CountPlan(known, pending, pending_chars)

    def finish(self, plan: CountPlan) -> int:
        """Tokenize what the plan left pending (caching each segment's count): the total."""
        deferred = sum(job() for job in plan.deferred)
        if self._splitter is None:
            return (
                plan.known + deferred + sum(self._reference.count(text) for _, text in plan.pending)
            )
        total = plan.known + deferred
        store = self._cache
        for key, segment in plan.pending:
            n = self._engine.count(segment)
            if key is not None and store is not None:
                store.put(key, n)
            total += n
        return total

    # -- public counting API ----------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt string vLLM would build for this chat request (before the engine
        expands each image's placeholder)."""
        return self._render_chat(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )[0]

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[ImageRef]]:
        """The prompt string and the images it holds, in order."""
        if self._chat_template is None:
            raise PromptRenderError("this model has no chat template; use completions")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise PromptRenderError("chat_template_kwargs must be an object")
        kwargs = engine_kwargs(chat_template_kwargs)
        shaped_tools = normalize_tools(tools)
        if "tools" in kwargs:
            # vLLM lets chat_template_kwargs["tools"] replace the request's tools, as sent.
            shaped_tools = kwargs_tools(kwargs["tools"])
        template = self._chat_template.select(shaped_tools)
        vision = self.vision
        images: list[ImageRef] | None = [] if vision is not None else None
        conversation = parse_messages(
            messages,
            template.content_format,
            images,
            vision.placeholder if vision is not None else "",
        )
        if vision is not None and images and len(images) > vision.limits.max_images:
            raise PromptRenderError(
                f"{images[vision.limits.max_images].where}: more than "
                f"{vision.limits.max_images} images in one request"
            )
        conversation = developer_as_system(conversation, template.source)
        prompt = self._chat_template.render(
            template,
            conversation,
            shaped_tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=kwargs,
        )
        if vision is not None:
            _check_media_tokens(prompt, vision, len(images or ()))
        return prompt, images or []

    def plan_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> CountPlan:
        """``count_chat`` up to the segments that still need tokenizing."""
        prompt, images = self._render_chat(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        plan = self.plan_text(prompt, add_special_tokens=add_special_tokens)
        if not images or self.vision is None:
            return plan
        vision = self.vision

        def expanded_images() -> int:
            # Each image's one placeholder token (counted in the text) becomes its grid.
            return sum(image_tokens(vision, image) - 1 for image in images)

        # Decoding an image is never done on the event loop: the plan goes to a worker.
        return plan.merged(CountPlan(0, [], _IMAGE_DECODE_COST, (expanded_images,)))


# Counted as this many characters still to tokenize: more than any inline budget.
_IMAGE_DECODE_COST = 1 << 40


def _check_media_tokens(prompt: str, vision: VisionRule, images: int) -> None:
    """The engine matches each image to one placeholder token in the rendered prompt: a
    message text that types one, or a template that drops an image, is refused (the engine
    would refuse it, or take typed text for an image)."""
    for token in vision.reserved_tokens:
        expected = images if token == vision.image_token else 0
        if prompt.count(token) != expected:
            raise PromptRenderError(
                f"messages: the prompt holds {prompt.count(token)} {token} tokens for "
                f"{expected} images; message text may not contain {token}"
            )


@dataclass(frozen=True)
class CountPlan:
    """A count in parts: ``known`` tokens (added tokens, cached and short segments),
    ``pending`` segments still to tokenize, each with its cache key (None: not cached), and
    ``deferred`` counts a library makes in one call (a whole Mistral or harmony prompt)."""

    known: int
    pending: list[tuple[bytes | None, str]]
    pending_chars: int
    deferred: tuple[Callable[[], int], ...] = ()

    def merged(self, other: CountPlan) -> CountPlan:
        return CountPlan(
            self.known + other.known,
            [*self.pending, *other.pending],
            self.pending_chars + other.pending_chars,
            (*self.deferred, *other.deferred),
        )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
