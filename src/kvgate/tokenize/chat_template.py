"""Loading, compiling and rendering Hugging Face chat templates, as transformers does.

vLLM renders chat prompts with ``tokenizer.apply_chat_template(..., tokenize=False)``
from transformers, so to count what vLLM counts we reproduce transformers' renderer:
the same sandboxed Jinja environment and helpers, the same message normalisation
(drop None-valued keys, alias reasoning fields), the same template selection and the
same ``continue_final_message`` trimming. transformers itself is not imported.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvgate.tokenize.errors import PromptRenderError

ContentFormat = Literal["string", "openai"]

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"

# Names apply_chat_template binds itself; request kwargs may not replace them.
_RESERVED_VARS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)
# vLLM refuses these in chat_template_kwargs outright.
_FORBIDDEN_KWARGS = frozenset({"chat_template", "tokenize"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers).

    transformers registers such a tag; templates that use it must parse here too. We
    never need the mask, so the block just renders its body.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; transformers' does neither.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """``dict(...)`` for templates without exposing the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore names (no route to CPython internals)."""

    # No named ``self``: like Jinja's Namespace, so ``namespace(self=...)`` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace: {name!r}"
            )


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env


# --- content-format detection (what vLLM calls "auto") ----------------------------------
#
# vLLM 0.34 (``vllm/renderers/hf.py``, ``_detect_content_format``) walks the template's AST:
# the template wants OpenAI-style part lists ("openai") when some loop iterates over a
# message's content, else the text parts are joined into one string ("string"). Our own
# walk with the same rules:
#
# * names bound to ``messages``: ``messages`` itself, ``{% set x = messages... %}`` (through
#   filters, tests and slices, transitively), ``namespace(rest=messages)`` and
#   ``{% set ns.rest = messages %}`` (the dotted name ``ns.rest``);
# * message names: targets of loops over any of those;
# * a content loop: ``{% for p in m.content %}`` / ``m['content']`` for a message name ``m``;
#   a loop inside a macro over one of its parameters that some call of the macro passes
#   a message's content; or a loop over a bare ``content`` outside any macro.


class _UnsupportedLoop(Exception):
    """A loop vLLM's walk cannot read (a tuple target): vLLM then falls back to "string"."""


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_field(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
            and _is_var(node.node, name)
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _is_var(node.node, name)
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or its field ``key``), possibly under filters, tests and slices."""
    while True:
        if isinstance(node, jinja2.nodes.Filter):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, jinja2.nodes.Test) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            node = node.node
        else:
            return _is_field(node, name, key) if key else _is_var(node, name)


def _dotted(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    attrs = []
    while isinstance(node, jinja2.nodes.Getattr):
        attrs.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        return ".".join([node.name, *reversed(attrs)])
    return None


def _aliases_of(root: jinja2.nodes.Template, name: str) -> list[str]:
    found = [name]
    seen = {name}
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            target, value = assign.target, assign.node
            aliases: list[str] = []
            if isinstance(target, jinja2.nodes.Name) and _reads(value, current):
                aliases.append(target.name)
            if (
                isinstance(target, jinja2.nodes.Name)
                and isinstance(value, jinja2.nodes.Call)
                and isinstance(value.node, jinja2.nodes.Name)
                and value.node.name == "namespace"
            ):
                aliases += [
                    f"{target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, current)
                ]
            elif isinstance(target, jinja2.nodes.Getattr | jinja2.nodes.NSRef) and _reads(
                value, current
            ):
                dotted = _dotted(target)
                aliases += [dotted] if dotted is not None else []
            for alias in aliases:
                found.append(alias)
                if alias not in seen:
                    seen.add(alias)
                    pending.append(alias)
    return found


def _target_name(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise _UnsupportedLoop
    return loop.target.name


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    iterables = _aliases_of(root, "messages")
    return [
        _target_name(loop)
        for loop in root.find_all(jinja2.nodes.For)
        if any(_reads(loop.iter, name) for name in iterables)
    ]


def _macro_content_params(
    root: jinja2.nodes.Template, message_names: list[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro: the macro parameters some call passes a message's content;
    and the ids of all loops inside macros."""

    def passes_content(arg: jinja2.nodes.Node) -> bool:
        return any(_reads(arg, name, "content") for name in message_names)

    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and passes_content(arg):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and passes_content(kw.value):
                    content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    return params_by_loop, loops_in_macros


def _has_content_loop(root: jinja2.nodes.Template) -> bool:
    message_names = _message_names(root)
    params_by_loop, loops_in_macros = _macro_content_params(root, message_names)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, "content") for name in message_names):
            _target_name(loop)
            return True
        if isinstance(loop.iter, jinja2.nodes.Name) and (
            loop.iter.name in params_by_loop.get(id(loop), ())
            or (id(loop) not in loops_in_macros and loop.iter.name == "content")
        ):
            _target_name(loop)
            return True
    return False


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    try:
        root = env.parse(source)
        return "openai" if _has_content_loop(root) else "string"
    except (jinja2.TemplateError, _UnsupportedLoop):
        return "string"


# --- templates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledTemplate:
    name: str
    source: str
    template: jinja2.Template
    content_format: ContentFormat
    variables: frozenset[str]  # undeclared names the template reads


def load_template_sources(model_dir: Path) -> dict[str, str] | str | None:
    """The model's chat template(s), resolved as transformers 5 does.

    ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``) beside the
    tokenizer take precedence over ``chat_template`` in tokenizer_config.json, which may
    be a string or a list of ``{"name", "template"}``.
    """
    files: dict[str, str] = {}
    main = model_dir / TEMPLATE_FILE
    if main.is_file():
        files["default"] = main.read_text(encoding="utf-8")
    extra_dir = model_dir / TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files

    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    raw = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(raw, list):
        return {item["name"]: item["template"] for item in raw}
    if isinstance(raw, str):
        return raw
    return None


class ChatTemplate:
    """A model's compiled chat template(s) plus the special-token variables it sees."""

    def __init__(
        self,
        sources: dict[str, str] | str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        content_format: ContentFormat | Literal["auto"] = "auto",
    ) -> None:
        """``content_format``: the engine's --chat-template-content-format (auto: detected)."""
        self._env = make_environment()
        self._given_format = content_format
        named = {"default": sources} if isinstance(sources, str) else dict(sources)
        self._single = isinstance(sources, str)
        self._templates = {name: self._compile(name, src) for name, src in named.items()}
        # Passed to every render, like transformers' special_tokens_map (request kwargs
        # may override them).
        self._special_tokens = dict(special_tokens or {})

    def _compile(self, name: str, source: str) -> CompiledTemplate:
        try:
            template = self._env.from_string(source)
            variables = frozenset(jinja2.meta.find_undeclared_variables(self._env.parse(source)))
        except jinja2.TemplateError as exc:
            # A broken template is a deployment error, not a client error: fail at load.
            raise ValueError(f"chat template {name!r} does not compile: {exc}") from exc
        return CompiledTemplate(
            name=name,
            source=source,
            template=template,
            content_format=(
                detect_content_format(self._env, source)
                if self._given_format == "auto"
                else self._given_format
            ),
            variables=variables,
        )

    @property
    def names(self) -> list[str]:
        return list(self._templates)

    def select(self, tools: list[Any] | None) -> CompiledTemplate:
        """Pick the template transformers would: "tool_use" when tools are passed."""
        if self._single:
            return self._templates["default"]
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise PromptRenderError("the model has several chat templates and none is named 'default'")

    def render(
        self,
        template: CompiledTemplate,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """Render an already-preprocessed conversation (see ``messages.parse_messages``).

        ``chat_template_kwargs`` are the keywords vLLM passes (``request_fields.engine_kwargs``):
        the template sees those it reads, and ``documents`` among them.
        """
        if not conversation:
            raise PromptRenderError("messages must contain at least one message")
        if continue_final_message and add_generation_prompt:
            raise PromptRenderError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        kwargs = self._template_kwargs(template, chat_template_kwargs)
        chat = _alias_reasoning(_drop_none(conversation))

        final_text: str | None = None
        if continue_final_message:
            final_text = _tag_final_message(chat, template.source)

        try:
            rendered = template.template.render(
                messages=chat,
                tools=tools,
                documents=_documents(chat_template_kwargs),
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            # raise_exception() messages are written for users ("roles must alternate").
            raise PromptRenderError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # Templates indexing into shapes they did not expect.
            raise PromptRenderError(
                f"the messages do not fit the model's chat template ({type(exc).__name__})"
            ) from exc

        if final_text is not None:
            rendered = _trim_after_final(rendered, final_text)
        return rendered

    def _template_kwargs(
        self, template: CompiledTemplate, chat_template_kwargs: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self._special_tokens)
        if not chat_template_kwargs:
            return kwargs
        if not isinstance(chat_template_kwargs, Mapping):
            raise PromptRenderError("chat_template_kwargs must be an object")
        forbidden = _FORBIDDEN_KWARGS & set(chat_template_kwargs)
        if forbidden:
            raise PromptRenderError(
                f"chat_template_kwargs may not set {', '.join(sorted(forbidden))}"
            )
        for key, value in chat_template_kwargs.items():
            # vLLM forwards only variables the template reads, and its own request
            # fields (add_generation_prompt, ...) win over same-named kwargs.
            if key in template.variables and key not in _RESERVED_VARS:
                kwargs[key] = value
        return kwargs


def _documents(kwargs: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    # vLLM forwards chat_template_kwargs["documents"] to apply_chat_template's own argument.
    documents = (kwargs or {}).get("documents")
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise PromptRenderError("chat_template_kwargs.documents must be a list of objects")
    return documents


def _drop_none(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # transformers 5 drops None-valued keys: many templates render literal "None" else.
    return [{k: v for k, v in message.items() if v is not None} for message in conversation]


def _alias_reasoning(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # transformers copies a message's reasoning under "thinking" and "reasoning_content"
    # so templates written for either name find it.
    out = []
    for message in conversation:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the final message so the rendered prompt can be cut there."""
    if "content" not in source:
        raise PromptRenderError(
            "continue_final_message is set but the chat template has no content field"
        )
    last = dict(chat[-1])
    content = last.get("content")
    if content is None:
        raise PromptRenderError("continue_final_message is set but the final message is empty")
    if isinstance(content, list):
        blocks = [dict(b) if isinstance(b, dict) else b for b in content]
        for block in reversed(blocks):
            if isinstance(block, dict) and "text" in block:
                final_text = str(block["text"])
                block["text"] = final_text + _CONTINUE_TAG
                break
        else:
            raise PromptRenderError(
                "continue_final_message is set but the final message has no text to continue"
            )
        last["content"] = blocks
    else:
        final_text = str(content)
        last["content"] = final_text + _CONTINUE_TAG
    chat[-1] = last
    return final_text


def _trim_after_final(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise PromptRenderError(
            "continue_final_message is set but the chat template drops the final message"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the trailing space after the tag: trim the same way.
    return rendered[:at].rstrip()
