"""The vLLM server options that change a chat's prompt, mirrored per model.

vLLM 0.34 renders a chat with a few settings of the server's own, not of the request:
``--default-chat-template-kwargs`` (keywords under the request's own, ``ChatParams.with_defaults``),
``--reasoning-effort-map`` (the request's effort rewritten before it reaches the template),
``--chat-template`` (a template in place of the model directory's),
``--chat-template-content-format`` (a format in place of the detected one) and
``--exclude-tools-when-tool-choice-none`` (no tools in the prompt when ``tool_choice`` is
``"none"``). A model whose engine runs with any of them is counted with the same values
(``models[].engine_flags``); the defaults are vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

from kvgate.tokenize.request_fields import ChatTemplateKwargs

ContentFormatOption = Literal["auto", "string", "openai"]

# vLLM reads --chat-template as a file path unless it holds one of these (then it is the
# template itself).
_TEMPLATE_CHARS: Final = frozenset("{}\n")


def is_inline_template(value: str) -> bool:
    """Whether a ``--chat-template`` value is the template's text rather than a path."""
    return any(c in _TEMPLATE_CHARS for c in value)


@dataclass(frozen=True)
class EngineFlags:
    default_chat_template_kwargs: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({})
    )
    reasoning_effort_map: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # The template's text (a path is read when the model is loaded).
    chat_template: str | None = None
    chat_template_content_format: ContentFormatOption = "auto"
    exclude_tools_when_tool_choice_none: bool = False

    def tools_for(
        self, tools: list[dict[str, Any]] | None, tool_choice: Any
    ) -> list[dict[str, Any]] | None:
        """The request's tools as the engine renders them."""
        if self.exclude_tools_when_tool_choice_none and tool_choice == "none":
            return None
        return tools

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's template keywords with the server's defaults under them and its
        reasoning effort as the server rewrites it."""
        effort = getattr(kwargs, "reasoning_effort", None)
        mapped = self.reasoning_effort_map.get(effort, effort) if effort is not None else None
        if not self.default_chat_template_kwargs and mapped == effort:
            return kwargs
        shaped = ChatTemplateKwargs(
            kwargs,
            reasoning_effort=mapped,
            sent_by_client=getattr(kwargs, "sent_by_client", kwargs is not None),
        )
        shaped.server_defaults = dict(self.default_chat_template_kwargs)
        return shaped


NO_FLAGS: Final = EngineFlags()
