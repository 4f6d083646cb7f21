"""The Responses API's answer meter: reads a ``response`` body or its event stream, for
the bill (``kvgate.lifecycle.protocol.AnswerMeter``)."""

from __future__ import annotations

from kvgate.lifecycle.meter import EventStreamMeter
from kvgate.policy import ActualUsage

from .answers import ResponseBodyScanner, ResponsesStreamReader, ResponsesUsage

__all__ = ["ResponsesMeter"]


def _billed(usage: ResponsesUsage) -> ActualUsage:
    return ActualUsage(
        prompt_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cached_tokens=usage.cached_tokens,
    )


class ResponsesMeter(EventStreamMeter[ResponsesUsage]):
    """One Responses answer: the event reader of a stream or the usage scanner of a JSON
    body. Nothing is injected into a Responses request (its streams always end with the
    usage), so every chunk passes unchanged."""

    def __init__(self, *, stream_requested: bool) -> None:
        super().__init__(
            stream_requested=stream_requested,
            reader=ResponsesStreamReader,
            scanner=ResponseBodyScanner,
            billed=_billed,
        )
