"""Request fields that vLLM folds into a chat template's keyword arguments.

vLLM 0.34's ``ChatCompletionRequest.build_chat_params`` passes the request's
``reasoning_effort`` to the template as ``reasoning_effort`` (over the client's
``chat_template_kwargs``) and, unless the client set ``enable_thinking`` itself, as
``enable_thinking = reasoning_effort != "none"`` (so templates with an opt-in thinking
switch think when an effort is asked for). Its later merge with the server's defaults
(``merge_kwargs``) drops every keyword whose value is ``None`` or ``"auto"``. The template
only sees the keywords it reads.

The counting API takes one ``chat_template_kwargs`` argument, so the request's fields ride
along on it: :class:`ChatTemplateKwargs` is the client's mapping (or an empty one) with the
request's ``reasoning_effort`` attached, a record of whether the client sent any (the
Mistral mode refuses ``chat_template_kwargs`` only when the client sent it) and the server's
``--default-chat-template-kwargs`` (``engine_flags``), which go under all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: vLLM 0.34's ``ReasoningEffort`` literal.
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# vLLM's merge_kwargs treats these values as "not set".
_UNSET_VALUES: Final = (None, "auto")


class ChatTemplateKwargs(dict[str, Any]):
    """The client's ``chat_template_kwargs`` plus the request fields vLLM adds to them."""

    def __init__(
        self,
        client: Mapping[str, Any] | None,
        *,
        reasoning_effort: str | None,
        sent_by_client: bool | None = None,
    ):
        super().__init__(client or {})
        self.sent_by_client = client is not None if sent_by_client is None else sent_by_client
        self.reasoning_effort = reasoning_effort
        # The engine's --default-chat-template-kwargs (request keywords win over them).
        self.server_defaults: dict[str, Any] = {}


def with_request_fields(
    client: dict[str, Any] | None, *, reasoning_effort: str | None
) -> dict[str, Any] | None:
    """The client's kwargs as they are, or carrying the request's fields when it has any."""
    if reasoning_effort is None:
        return client
    return ChatTemplateKwargs(client, reasoning_effort=reasoning_effort)


def sent_by_client(kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the client's request had ``chat_template_kwargs`` at all."""
    if isinstance(kwargs, ChatTemplateKwargs):
        return kwargs.sent_by_client
    return kwargs is not None


def engine_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keywords vLLM hands ``apply_chat_template`` (before keeping those it reads):
    the server's defaults, then the request's set values over them."""
    merged = dict(kwargs or {})
    effort = kwargs.reasoning_effort if isinstance(kwargs, ChatTemplateKwargs) else None
    if effort is not None:
        merged["reasoning_effort"] = effort
        if "enable_thinking" not in (kwargs or {}):
            merged["enable_thinking"] = effort != "none"
    defaults = kwargs.server_defaults if isinstance(kwargs, ChatTemplateKwargs) else {}
    return defaults | {k: v for k, v in merged.items() if not _is_unset(v)}


def _is_unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value in _UNSET_VALUES)
