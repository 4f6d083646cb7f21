"""Prompt counting and output-token generation with the model's own tokenizer.

This is deliberately independent of kvgate's counter: it goes through
``transformers.AutoTokenizer`` and ``apply_chat_template`` the way vLLM's chat path
does (render to text, then encode without special tokens), and preprocesses the
messages the way vLLM's ``parse_chat_messages`` does.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from vllm_sim.chat_flags import DEFAULT_FLAGS, ChatFlags, chat_kwargs
from vllm_sim.vision import SimVision, VisionError, image_part_url, is_image_part

ContentFormat = Literal["string", "openai"]

# Common English words; each one that the vocabulary holds as a single token (with
# its leading space) becomes a candidate output token. Concatenations of such
# " word" pieces re-tokenize to exactly one token per piece under byte-level BPE,
# because the pre-tokenizer splits before every space+letters run.
_WORDS: tuple[str, ...] = (
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "dog",
    "ran",
    "to",
    "park",
    "while",
    "it",
    "was",
    "sunny",
    "out",
    "there",
    "people",
    "like",
    "walk",
    "in",
    "evening",
    "when",
    "water",
    "is",
    "calm",
    "near",
    "old",
    "town",
    "each",
    "day",
    "we",
    "find",
    "more",
    "time",
    "for",
    "good",
    "work",
    "with",
    "friends",
    "who",
    "make",
    "things",
    "better",
)
# Public: tools that build prompts of known token counts use the same words.
SINGLE_TOKEN_WORDS = _WORDS

_BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# The request model's reasoning_effort literal (vLLM 0.34).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class PromptError(ValueError):
    """A request's prompt could not be rendered (bad template input, bad arguments)."""


class ChatMessages(list):  # type: ignore[type-arg]
    """A request's messages plus the request fields vLLM hands the chat template with them
    (``reasoning_effort``), so they reach the renderer along with the messages."""

    reasoning_effort: str | None = None


# --- content format ("auto"): vLLM 0.34's AST walk, written for the simulator ---------


def _unwrap(node: Any) -> Any:
    """The expression under any filters, tests and slices (``messages[1:] | list``)."""
    from jinja2 import nodes

    while (
        (isinstance(node, nodes.Filter) and node.node is not None)
        or isinstance(node, nodes.Test)
        or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice))
    ):
        node = node.node
    return node


def _dotted_name(node: Any) -> str | None:
    """``x`` or ``ns.attr`` as read (not assigned); else None."""
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return node.name if node.ctx == "load" else None
    if isinstance(node, nodes.Getattr):
        base = _dotted_name(node.node)
        return f"{base}.{node.attr}" if base else None
    return None


def _accessed_name(node: Any) -> str | None:
    return _dotted_name(_unwrap(node))


def _accessed_content_of(node: Any) -> str | None:
    """The name ``m`` when ``node`` is ``m.content`` / ``m['content']`` (maybe filtered)."""
    from jinja2 import nodes

    node = _unwrap(node)
    is_content = (isinstance(node, nodes.Getattr) and node.attr == "content") or (
        isinstance(node, nodes.Getitem)
        and isinstance(node.arg, nodes.Const)
        and node.arg.value == "content"
    )
    return _dotted_name(node.node) if is_content else None


def _content_format_of(ast: Any) -> ContentFormat:
    from jinja2 import nodes

    # Everything bound to messages, transitively (plain and namespace attributes).
    bound = {"messages"}
    changed = True
    while changed:
        changed = False
        for assign in ast.find_all(nodes.Assign):
            new: list[str] = []
            source = _accessed_name(assign.node)
            target = assign.target
            if isinstance(target, nodes.Name):
                if source in bound:
                    new.append(target.name)
                if (
                    isinstance(assign.node, nodes.Call)
                    and isinstance(assign.node.node, nodes.Name)
                    and assign.node.node.name == "namespace"
                ):
                    new += [
                        f"{target.name}.{kw.key}"
                        for kw in assign.node.kwargs
                        if _accessed_name(kw.value) in bound
                    ]
            elif isinstance(target, nodes.NSRef) and source in bound:
                new.append(f"{target.name}.{target.attr}")
            for name in new:
                if name not in bound:
                    bound.add(name)
                    changed = True

    loops = list(ast.find_all(nodes.For))
    message_vars: set[str] = set()
    for loop in loops:
        if _accessed_name(loop.iter) in bound:
            if not isinstance(loop.target, nodes.Name):
                return "string"  # vLLM's walk fails on such a loop and falls back
            message_vars.add(loop.target.name)

    in_macro: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in ast.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        fed: set[str] = set()
        for call in ast.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(params)]):
                if _accessed_content_of(arg) in message_vars:
                    fed.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and _accessed_content_of(kw.value) in message_vars:
                    fed.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if fed:
                macro_params[id(loop)] = fed

    for loop in loops:
        over_content = _accessed_content_of(loop.iter) in message_vars
        if not over_content and isinstance(loop.iter, nodes.Name):
            name = loop.iter.name
            over_content = name in macro_params.get(id(loop), ()) or (
                id(loop) not in in_macro and name == "content"
            )
        if over_content:
            return "openai" if isinstance(loop.target, nodes.Name) else "string"
    return "string"


def detect_content_format(chat_template: str | None) -> ContentFormat:
    """vLLM's "auto" content format: "openai" when the template loops over a message's
    content parts (also through a macro parameter or a bare ``content``), else "string"."""
    if not chat_template:
        return "string"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except Exception:
        return "string"
    return _content_format_of(ast)


# --- messages -------------------------------------------------------------------------


def _without_billing_header(parts: list[Any]) -> list[Any]:
    kept: list[Any] = []
    for part in parts:
        is_text_dict = isinstance(part, dict) and part.get("type") == "text"
        text = part if isinstance(part, str) else part.get("text") if is_text_dict else None
        if isinstance(text, str) and text.startswith(_BILLING_HEADER):
            rest = text.split("\n", 1)[1] if "\n" in text else ""
            if rest:
                kept.append(rest if isinstance(part, str) else dict(part, text=rest))
        else:
            kept.append(part)
    return kept


# Keys of vLLM's own content-part types (chat_utils/types.py), beside OpenAI's.
_VLLM_PART_KEYS = frozenset(
    {"audio_url", "video_url", "image_pil", "image_url", "uuid", "image_embeds"}
    | {"audio_embeds", "video_embeds", "data", "thinking", "closed", "name", "type"}
)


@functools.cache
def _declared_part_keys() -> frozenset[str]:
    """Every key a content-part type of vLLM's request model declares: what vLLM's
    ``_collect_extra_fields`` leaves out of a wrapped text part."""
    import types
    import typing

    keys: set[str] = set(_VLLM_PART_KEYS)
    try:
        from openai.types.chat import (
            ChatCompletionContentPartParam,
            ChatCompletionContentPartRefusalParam,
        )
    except ImportError:  # the simulator does not need the openai package otherwise
        return frozenset(keys | {"text", "image_url", "input_audio", "file", "refusal"})
    pending: list[Any] = [ChatCompletionContentPartParam, ChatCompletionContentPartRefusalParam]
    while pending:
        node = pending.pop()
        if typing.get_origin(node) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(node))
        elif hasattr(node, "__required_keys__"):
            keys |= node.__required_keys__ | node.__optional_keys__
    return frozenset(keys)


def _part(part: Any, content_format: ContentFormat, images: list[str] | None = None) -> Any:
    """One content part as vLLM keeps it (None: skipped). ``images``: a vision model's
    collector of image URLs (None: images are refused)."""
    if images is not None and is_image_part(part):
        try:
            url = image_part_url(part)
        except VisionError as exc:
            raise PromptError(str(exc)) from exc
        if not url:
            raise PromptError("Failed to load image: no image URL")
        images.append(url)
        if content_format != "openai":
            return None  # its placeholder goes before the message's text
        extras = {k: v for k, v in part.items() if k not in _declared_part_keys()}
        return {"type": "image", **extras}
    if isinstance(part, str):
        return {"type": "text", "text": part} if content_format == "openai" else part
    if not isinstance(part, dict):
        raise PromptError(f"Unsupported content part: {part!r}")
    kind = part.get("type")
    if kind in _TEXT_PART_KEYS:
        text = part.get(_TEXT_PART_KEYS[kind])
        if text is None and kind in ("text", "refusal"):
            return None
        if not isinstance(text, str):
            raise PromptError(f"Unsupported content part: {part!r}")
        if content_format != "openai":
            return text
        extras = {k: v for k, v in part.items() if k not in _declared_part_keys()}
        return {"type": "text", "text": text, **extras}
    if kind == "tool_reference" or (kind is None and "tool_reference" in part):
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if content_format == "openai" else name
    raise PromptError(f"Unsupported content part: {part!r} (vllm-sim serves text only)")


def _tool_call_arguments(value: Any) -> dict[str, Any]:
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def preprocess_messages(
    messages: Sequence[dict[str, Any]],
    content_format: ContentFormat,
    images: list[str] | None = None,
    placeholder: str = "",
) -> list[dict[str, Any]]:
    """Turn OpenAI-style messages into the conversation vLLM hands to the template.

    ``images``: a vision model's collector (image URLs in order; ``placeholder`` stands for
    each in a "string"-format message); None refuses image parts."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = list(content)
        else:
            raise PromptError(f"Unsupported content type for role {role!r}")
        if role == "system":
            parts = _without_billing_header(parts)
        # Falsy results (a skipped part, or an empty string once joined) are dropped;
        # an empty text wrapped as a dict is not falsy, so "openai" keeps it.
        before = len(images) if images is not None else 0
        kept = [p for p in (_part(part, content_format, images) for part in parts) if p]

        out: dict[str, Any] = {"role": role}
        out["content"] = kept if content_format == "openai" else "\n".join(kept)
        added = len(images) - before if images is not None else 0
        if added and content_format != "openai":
            # get_full_multimodal_text_prompt: placeholders the text lacks go first.
            text = out["content"]
            missing = added - text.count(placeholder)
            if missing < 0:
                raise PromptError(
                    f"Found more '{placeholder}' placeholders in input prompt than actual "
                    "multimodal data items."
                )
            out["content"] = "\n".join([placeholder] * missing + ([text] if text else []))
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            if isinstance(out["content"], list) and not any(
                isinstance(p, dict) and p.get("type") != "text" for p in out["content"]
            ):
                out["content"] = "\n".join(p.get("text", "") for p in out["content"])
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        if isinstance(message.get("task"), str):
            out["task"] = message["task"]
        if role == "developer":
            out["tools"] = message.get("tools")
        conversation.append(out)

    # Templates expect tool-call arguments as objects, not the JSON strings the OpenAI
    # API carries; whatever is not a JSON object becomes {}.
    for out in conversation:
        if out["role"] != "assistant" or not isinstance(out.get("tool_calls"), list):
            continue
        if not out["tool_calls"]:
            del out["tool_calls"]
            continue
        for call in out["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or call.get("type", "function") != "function":
                raise PromptError(
                    "chat completions only support assistant tool_calls of type 'function'."
                )
            function["arguments"] = _tool_call_arguments(function.get("arguments"))
    return conversation


def developer_to_system(
    conversation: list[dict[str, Any]], chat_template: str
) -> list[dict[str, Any]]:
    """vLLM's handling of ``developer`` messages for a template that never names the role:
    they become system messages, and all system texts merge into one leading message when
    one ends up anywhere but first."""
    if not any(m["role"] == "developer" for m in conversation) or any(
        quoted in chat_template for quoted in ('"developer"', "'developer'")
    ):
        return conversation
    conversation = [
        {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
        if m["role"] == "developer"
        else m
        for m in conversation
    ]
    system_at = [i for i, m in enumerate(conversation) if m["role"] == "system"]
    if not system_at or system_at == [0]:
        return conversation
    texts = []
    for i in system_at:
        content = conversation[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p if isinstance(p, str) else p["text"]
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    rest = [m for m in conversation if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def normalize_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool dicts vLLM passes to the template: its pydantic ``model_dump``, which keeps
    the declared keys only (``strict`` and ``defer_loading`` only when set)."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise PromptError("each tool needs a 'function' object")
        if not isinstance(function.get("name"), str):
            raise PromptError("each tool function needs a 'name'")
        if tool.get("type", "function") != "function":
            raise PromptError("tools must be of type 'function'")
        fn = {key: function.get(key) for key in ("name", "description", "parameters")}
        for flag in ("strict", "defer_loading"):
            if function.get(flag) is not None:
                fn[flag] = _lax_bool(function[flag])
        item: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            item["defer_loading"] = _lax_bool(tool["defer_loading"])
            fn.setdefault("defer_loading", item["defer_loading"])
        out.append(item)
    return out


def _lax_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("1", "on", "t", "true", "y", "yes"):
        return True
    if isinstance(value, str) and value.lower() in ("0", "off", "f", "false", "n", "no"):
        return False
    raise PromptError(f"Input should be a valid boolean: {value!r}")


def template_kwargs(
    chat_template_kwargs: dict[str, Any] | None,
    *,
    tools: list[dict[str, Any]] | None,
    documents: Any,
    reasoning_effort: str | None,
    flags: ChatFlags = DEFAULT_FLAGS,
) -> dict[str, Any]:
    """vLLM 0.34's ``build_chat_params(...).with_defaults(...)``: the request's own fields
    over the client's kwargs, those over the server's defaults (its
    --default-chat-template-kwargs, then the tools), every ``None``/``"auto"`` value
    counting as unset; the effort as --reasoning-effort-map rewrites it. Without
    ``add_generation_prompt``, ``continue_final_message`` and ``tokenize``, which the
    renderer passes itself."""
    kwargs = chat_kwargs(
        chat_template_kwargs,
        tools=tools,
        documents=documents,
        reasoning_effort=reasoning_effort,
        flags=flags,
    )
    for own in ("add_generation_prompt", "continue_final_message", "tokenize"):
        kwargs.pop(own, None)
    return kwargs


# apply_chat_template's own named parameters: vLLM forwards them whatever the template reads.
_APPLY_PARAMS = frozenset(
    {
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
    }
)


@functools.lru_cache(maxsize=32)
def _cached_content_format(template: str) -> ContentFormat:
    return detect_content_format(template)


@functools.lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment
    return frozenset(meta.find_undeclared_variables(env.parse(template)))


class SimTokenizer:
    """The served model's tokenizer plus the simulator's output vocabulary."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a server starts

        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)
        # The default template's format (requests resolve their own template's).
        default = self.chat_template
        if isinstance(default, dict):
            default = default.get("default")
        self.content_format = detect_content_format(default)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.word_ids, self.word_texts = self._pick_word_tokens()
        # A vision model's image side (None: image parts are refused, as text-only vLLM does).
        self.vision = SimVision.for_model_dir(self.model_dir, self._tok)

    def _pick_word_tokens(self) -> tuple[list[int], list[str]]:
        ids: list[int] = []
        texts: list[str] = []
        seen: set[int] = set()
        for word in _WORDS:
            piece = " " + word
            encoded = self._tok.encode(piece, add_special_tokens=False)
            if len(encoded) != 1:
                # A SentencePiece vocabulary (Llama-2's) writes the word's space itself.
                encoded = self._tok.encode(word, add_special_tokens=False)
                if len(encoded) != 1 or self._tok.convert_ids_to_tokens(encoded[0]) != (
                    "\u2581" + word
                ):
                    continue
            elif self._tok.decode(encoded) != piece:
                continue
            if encoded[0] in seen:
                continue
            seen.add(encoded[0])
            ids.append(encoded[0])
            texts.append(piece)
        if len(ids) < 4:
            raise RuntimeError(
                f"vocabulary of {self.model_dir} has too few single-token words for output"
            )
        return ids, texts

    # --- prompt side -------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        flags: ChatFlags | None = None,
        images: list[str] | None = None,
    ) -> str:
        """Render like vLLM 0.34's ``safe_apply_chat_template`` on its preprocessed chat,
        with the server's chat flags (vLLM's defaults when None). ``images`` receives the
        image URLs of a vision model's chat, in order."""
        flags = flags or DEFAULT_FLAGS
        if chat_template_kwargs and (
            "chat_template" in chat_template_kwargs or "tokenize" in chat_template_kwargs
        ):
            raise PromptError("Found unexpected chat template kwargs from request")
        kwargs = template_kwargs(
            chat_template_kwargs,
            tools=normalize_tools(tools) if tools is not None else None,
            documents=documents,
            reasoning_effort=getattr(messages, "reasoning_effort", None),
            flags=flags,
        )
        tool_dicts = kwargs.pop("tools", None)
        # ChatParams.chat_template: the request's template, else --chat-template.
        # get_apply_chat_template_kwargs puts it over the keywords; only when neither is
        # set does a chat_template among the server's default keywords reach the renderer.
        params_template = chat_template or flags.chat_template
        default_template = kwargs.pop("chat_template", None)

        def resolve(name_or_text: str | None) -> str:
            try:
                return str(self._tok.get_chat_template(name_or_text, tools=tool_dicts))
            except Exception as exc:
                raise PromptError(str(exc)) from exc

        if params_template is None and default_template is not None:
            template = resolve(default_template)

            def detect() -> str:
                # The format is resolved from ChatParams.chat_template alone: the model's.
                try:
                    return _cached_content_format(resolve(None))
                except PromptError:
                    return "string"
        else:
            template = resolve(params_template)

            def detect() -> str:
                return _cached_content_format(template)

        content_format: Any = flags.content_format(detect)
        vision = self.vision
        collected = (images if images is not None else []) if vision is not None else None
        conversation = preprocess_messages(
            messages, content_format, collected, vision.placeholder if vision else ""
        )
        conversation = developer_to_system(conversation, template)
        accepted = _template_variables(template) | _APPLY_PARAMS
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        kwargs.update(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        try:
            rendered = self._tok.apply_chat_template(
                conversation, tools=tool_dicts, chat_template=template, tokenize=False, **kwargs
            )
        except Exception as exc:
            # vLLM re-raises template failures as ValueError(str(e)) from e.
            raise PromptError(str(exc)) from exc
        if not isinstance(rendered, str):
            raise PromptError("chat template did not render to text")
        return rendered

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        add_special_tokens = bool(kwargs.pop("add_special_tokens", False))
        images: list[str] = []
        text = self.render_chat(messages, images=images, **kwargs)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        if self.vision is None:
            return ids
        try:
            # vLLM's multimodal processor: each image's placeholder token becomes its grid.
            return self.vision.expand(ids, images)
        except VisionError as exc:
            raise PromptError(str(exc)) from exc

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        """vLLM's /detokenize: the renderer's ``tokenizer.decode(ids)``, special tokens kept
        (ids outside the vocabulary are skipped, as ``tokenizers`` does)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_token(self, token_id: int) -> str:
        """One token as vLLM's logprobs show it: ``decode([id])``, special tokens kept."""
        return self._tok.decode([token_id])

    @property
    def special_ids(self) -> list[int]:
        return list(self._tok.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def count_text(self, text: str) -> int:
        """Tokens in plain text, as a gateway counting streamed output would."""
        return len(self._tok.encode(text, add_special_tokens=False))

    # --- output side -------------------------------------------------------------

    def output_token(self, index: int) -> tuple[int, str]:
        """The i-th visible output token (id, text) of every simulated generation."""
        k = index % len(self.word_ids)
        return self.word_ids[k], self.word_texts[k]
