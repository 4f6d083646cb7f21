"""Errors raised by the tokenize layer."""

from __future__ import annotations


class TokenizerLoadError(RuntimeError):
    """A model's tokenizer could not be found, fetched or loaded (a start-up failure)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"cannot load the tokenizer for {source!r}: {reason}")
        self.source = source
        self.reason = reason


class PromptRenderError(ValueError):
    """The request cannot be turned into a prompt: bad message shape or a template error.

    ``client_message`` is safe to return to the caller (the gRPC layer answers 400 with
    it); it never contains server paths or stack traces. A ValueError, like vLLM's own
    errors for the same inputs. ``param``: the request field it names, when it is not the
    prompt's own (the refusal's ``param`` then).
    """

    def __init__(self, client_message: str, param: str | None = None) -> None:
        super().__init__(client_message)
        self.client_message = client_message
        self.param = param
