"""The Responses API's answer meter: reads a ``response`` body or its event stream, for
the bill (``kvgate.lifecycle.protocol.AnswerMeter``)."""

from __future__ import annotations

from kvgate.lifecycle.billing import ResponseReading
from kvgate.lifecycle.meter import OutputCounter
from kvgate.policy import ActualUsage

from .answers import ResponseBodyScanner, ResponsesStreamReader, ResponsesUsage

__all__ = ["ResponsesMeter"]


class ResponsesMeter:
    """What kvgate keeps of one Responses answer: the status, and the event reader of a
    stream or the usage scanner of a JSON body. Nothing is injected into a Responses
    request (its streams always end with the usage), so every chunk passes unchanged."""

    def __init__(self, *, stream_requested: bool) -> None:
        self._stream_requested = stream_requested
        self.status = 0
        self._events: ResponsesStreamReader | None = None
        self._json: ResponseBodyScanner | None = None

    @property
    def accepted(self) -> bool:
        """The backend answered 2xx."""
        return 200 <= self.status < 300

    @property
    def events(self) -> ResponsesStreamReader | None:
        return self._events

    def on_headers(self, status: int, content_type: str) -> None:
        self.status = status
        if content_type.startswith("text/event-stream"):
            self._events = ResponsesStreamReader()
        elif self.accepted:
            self._json = ResponseBodyScanner()

    def on_chunk(self, chunk: bytes, *, end_of_stream: bool) -> bytes | None:
        if self._events is not None:
            self._events.feed(chunk)
            if end_of_stream:
                self._events.finish()
        elif self._json is not None:
            self._json.feed(chunk)
        return None

    def reported_usage(self) -> ResponsesUsage | None:
        """The backend's own usage, when it was read."""
        if not self.accepted:
            return None
        if self._events is not None:
            return self._events.usage
        if self._json is not None:
            return self._json.usage
        return None

    async def reading(self, count_output: OutputCounter) -> ResponseReading:
        """What was seen of the answer, for the billing rule; counts the streamed text
        only when the backend's usage is missing."""
        reported = self.reported_usage()
        usage = (
            None
            if reported is None
            else ActualUsage(
                prompt_tokens=reported.input_tokens,
                output_tokens=reported.output_tokens,
                cached_tokens=reported.cached_tokens,
            )
        )
        events = self._events
        text = events.output_text() if events is not None else ""
        counted = 0
        if usage is None and text and self.accepted:
            counted = await count_output(text)
        return ResponseReading(
            accepted=self.accepted,
            streamed=self._stream_requested,
            usage=usage,
            counted_output_tokens=counted,
            content_events=events.content_events if events is not None else 0,
            output_text_complete=events is not None and not events.output_text_truncated,
            visible_text=bool(text),
        )
