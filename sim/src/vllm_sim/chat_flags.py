"""The vLLM 0.34 server flags that change a rendered chat, and how vLLM applies them.

* ``--default-chat-template-kwargs JSON``: keywords under every request's own
  (``resolve_default_chat_template_kwargs`` in ``entrypoints/common/cli_args.py``, which also
  adds ``cohere_format`` from ``--cohere-format``, "cmd4" by default). ``preprocess_chat``
  (``renderers/online_renderer.py``) puts ``tools`` and ``tokenize`` over them, then
  ``ChatParams.with_defaults`` (``renderers/params.py``) puts the request's keywords over
  that, a ``None`` or ``"auto"`` value counting as unset (``merge_kwargs``).
* ``--reasoning-effort-map JSON``: the request's ``reasoning_effort`` rewritten before it
  reaches the keywords (``map_reasoning_effort``, called by ``build_chat_params``) and before
  harmony's system message (``_make_request_with_harmony``); checked at start-up as
  ``validate_reasoning_effort_map`` does.
* ``--chat-template``: a file, one of vLLM's bundled templates by name, or the template
  itself, read as ``load_chat_template`` (``renderers/chat_utils/chat_template.py``) reads
  it; it takes the model directory's place unless the request names its own.
* ``--chat-template-content-format``: "string" or "openai" wins over the detected format
  (``resolve_chat_template_content_format`` in ``renderers/hf.py``).
* ``--exclude-tools-when-tool-choice-none``: a chat completion whose ``tool_choice`` is
  "none" renders without its tools (``OnlineRenderer.render_chat``).

The templates under ``chat_templates/`` are vLLM 0.34.0's own
(``vllm/transformers_utils/chat_templates/*.jinja``), copied unchanged, so that a name such
as ``template_chatml.jinja`` loads as it does in vLLM.

Independent of kvgate: written from vLLM's source, sharing no code with its counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

ContentFormatOption = Literal["auto", "string", "openai"]
CONTENT_FORMAT_OPTIONS: Final = ("auto", "string", "openai")
# vLLM's ReasoningEffort literal (renderers/params.py): the keys a map may have.
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# vLLM's --cohere-format default: resolve_default_chat_template_kwargs adds it under the
# server's defaults whatever the model (templates that do not read it never see it).
COHERE_FORMAT_DEFAULT: Final = "cmd4"
BUILTIN_TEMPLATES_DIR: Final = Path(__file__).parent / "chat_templates"
# A --chat-template holding one of these is the template itself once no file opens.
_JINJA_CHARS: Final = "{}\n"
_UNSET: Final = (None, "auto")


def merge_kwargs(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``defaults | overrides`` without the overrides that are
    ``None`` or ``"auto"``."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if v not in _UNSET}}


def map_reasoning_effort(effort: str | None, effort_map: Mapping[str, str] | None) -> str | None:
    """vLLM's ``map_reasoning_effort``: a listed effort is rewritten, any other kept."""
    if effort is None or not effort_map:
        return effort
    return effort_map.get(effort, effort)


def validate_reasoning_effort_map(effort_map: Any) -> None:
    """vLLM's start-up check of ``--reasoning-effort-map`` (same messages)."""
    if effort_map is None:
        return
    if not isinstance(effort_map, dict) or not all(isinstance(v, str) for v in effort_map.values()):
        raise ValueError(
            "Error: --reasoning-effort-map must be a JSON object mapping "
            "reasoning efforts to strings."
        )
    if unknown := sorted(set(effort_map) - set(REASONING_EFFORTS)):
        raise ValueError(
            f"Error: --reasoning-effort-map has unknown efforts {unknown}; "
            f"keys must be one of {list(REASONING_EFFORTS)}."
        )


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` as vLLM 0.34 reads it (``validate_chat_template`` at start-up,
    then ``load_chat_template``): a file that opens is read; else a value without any of
    ``{``, ``}`` or a newline names one of vLLM's bundled templates (an error if there is
    none such); else the value is the template itself."""
    if value is None:
        return None
    looks_like_path = not any(c in value for c in _JINJA_CHARS)
    builtin = BUILTIN_TEMPLATES_DIR / value
    if looks_like_path and not Path(value).exists() and not builtin.exists():
        raise ValueError(
            f"The supplied chat template string ({value}) appears path-like, but doesn't "
            f"exist! Tried: {value} and {builtin}"
        )
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        if not looks_like_path:
            return value
        try:
            return builtin.read_text(encoding="utf-8")
        except OSError:
            raise ValueError(
                f"The supplied chat template ({value}) looks like a file path, but it failed "
                f"to be opened. Tried: {value} and {builtin}. Reason: {exc}"
            ) from exc


@dataclass(frozen=True)
class ChatFlags:
    """The server's settings for rendering chats (vLLM's defaults when not given)."""

    # --default-chat-template-kwargs, as given (cohere_format is added by template_defaults).
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_effort_map: Mapping[str, str] = field(default_factory=dict)
    # --chat-template, read (the template's text, not the path).
    chat_template: str | None = None
    chat_template_content_format: ContentFormatOption = "auto"
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.chat_template_content_format not in CONTENT_FORMAT_OPTIONS:
            raise ValueError(
                f"chat_template_content_format must be one of {list(CONTENT_FORMAT_OPTIONS)}"
            )
        if not isinstance(self.default_chat_template_kwargs, Mapping):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
        validate_reasoning_effort_map(dict(self.reasoning_effort_map))

    @property
    def template_defaults(self) -> dict[str, Any]:
        """vLLM's ``resolve_default_chat_template_kwargs``: the flag's keywords plus
        ``cohere_format`` unless they set it."""
        defaults = dict(self.default_chat_template_kwargs)
        defaults.setdefault("cohere_format", COHERE_FORMAT_DEFAULT)
        return defaults

    def tools_for(self, tools: Any, tool_choice: Any) -> Any:
        """The request's tools as ``render_chat`` hands them on (None: left out)."""
        if tools is None or (tool_choice == "none" and self.exclude_tools_when_tool_choice_none):
            return None
        return tools

    def content_format(self, detect: Any) -> str:
        """``resolve_chat_template_content_format``: a given format over the detected one
        (``detect()`` runs only for "auto")."""
        given = self.chat_template_content_format
        return detect() if given == "auto" else given


DEFAULT_FLAGS: Final = ChatFlags()


def chat_kwargs(
    client_kwargs: Mapping[str, Any] | None,
    *,
    tools: list[dict[str, Any]] | None,
    documents: Any = None,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    flags: ChatFlags = DEFAULT_FLAGS,
    tokenize: bool = False,
) -> dict[str, Any]:
    """The keywords a chat renders with: ``ChatParams.chat_template_kwargs`` once
    ``preprocess_chat`` has applied the server's defaults.

    The request's side is ``build_chat_params``: the client's ``chat_template_kwargs``
    under ``add_generation_prompt``, ``continue_final_message``, ``documents`` and the
    mapped ``reasoning_effort`` (plus ``enable_thinking = effort != "none"`` when the
    client did not set ``enable_thinking``). The server's side is its defaults under
    ``tools`` and ``tokenize``. The request's side wins; ``None`` and ``"auto"`` never do.
    /tokenize has no ``documents`` nor ``reasoning_effort`` field: both stay None there.
    """
    effort = map_reasoning_effort(reasoning_effort, flags.reasoning_effort_map)
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    client = dict(client_kwargs or {})
    if effort is not None and "enable_thinking" not in client:
        extra["enable_thinking"] = effort != "none"
    request_side = merge_kwargs(client, extra)
    server_side = merge_kwargs(flags.template_defaults, {"tools": tools, "tokenize": tokenize})
    return merge_kwargs(server_side, request_side)
