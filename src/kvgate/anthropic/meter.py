"""The Messages API's answer meter: reads a ``message`` body or its event stream, for
the bill (``kvgate.lifecycle.protocol.AnswerMeter``)."""

from __future__ import annotations

from kvgate.lifecycle.meter import EventStreamMeter
from kvgate.policy import ActualUsage

from .answers import MessagesStreamReader, MessageUsage, MessageUsageScanner

__all__ = ["MessagesMeter"]


def _billed(usage: MessageUsage) -> ActualUsage:
    return ActualUsage(
        prompt_tokens=usage.prompt_tokens,
        output_tokens=usage.output_tokens,
        cached_tokens=usage.cache_read_input_tokens,
    )


class MessagesMeter(EventStreamMeter[MessageUsage]):
    """One Messages answer: the event reader of a stream or the usage scanner of a JSON
    body. Nothing is injected into a Messages request, so every chunk passes unchanged."""

    def __init__(self, *, stream_requested: bool) -> None:
        super().__init__(
            stream_requested=stream_requested,
            reader=MessagesStreamReader,
            scanner=MessageUsageScanner,
            billed=_billed,
        )
