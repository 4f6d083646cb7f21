"""How many new tokens a request may generate, and whether it fits the model's context."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenPlan:
    ok: bool
    max_new_tokens: int
    detail: str = ""


def plan_new_tokens(
    prompt_tokens: int,
    requested_max_new: int | None,
    default_max_new: int,
    max_context: int,
) -> TokenPlan:
    """Decide max_new for a request, the way the serving engine will bound it.

    An explicit max_tokens is taken as asked and must fit the context with the prompt
    (vLLM rejects it otherwise). Without one, the model default is clamped to what the
    context leaves, so a long prompt still gets an answer.
    """
    room = max_context - prompt_tokens
    if requested_max_new is not None:
        if prompt_tokens + requested_max_new > max_context:
            return TokenPlan(
                ok=False,
                max_new_tokens=requested_max_new,
                detail=(
                    f"This model's maximum context length is {max_context} tokens. However, "
                    f"you requested {prompt_tokens + requested_max_new} tokens "
                    f"({prompt_tokens} in the messages, {requested_max_new} in the "
                    "completion). Please reduce the length of the messages or completion."
                ),
            )
        return TokenPlan(ok=True, max_new_tokens=requested_max_new)
    if room < 1:
        return TokenPlan(
            ok=False,
            max_new_tokens=0,
            detail=(
                f"This model's maximum context length is {max_context} tokens. However, "
                f"your messages resulted in {prompt_tokens} tokens, which leaves no room "
                "for a completion. Please reduce the length of the messages."
            ),
        )
    return TokenPlan(ok=True, max_new_tokens=min(default_max_new, room))
