"""The response meter: reads an answer as it passes, in bounded memory, for the bill."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvgate.lifecycle.billing import ResponseReading
from kvgate.openai import JsonUsageScanner, SseStreamFilter, Usage
from kvgate.policy import ActualUsage

# Counts the tokens of answer text (of the model that served the request).
OutputCounter = Callable[[str], Awaitable[int]]


class ResponseMeter:
    """Owns what kvgate keeps of one answer: the status, the SSE filter of a stream (which
    may strip the usage event kvgate injected) or the usage scanner of a JSON body."""

    def __init__(self, *, strip_usage_event: bool, stream_requested: bool) -> None:
        self._strip_usage_event = strip_usage_event
        self._stream_requested = stream_requested
        self.status = 0
        self._sse: SseStreamFilter | None = None
        self._json: JsonUsageScanner | None = None

    @property
    def accepted(self) -> bool:
        """The backend answered 2xx."""
        return 200 <= self.status < 300

    def on_headers(self, status: int, content_type: str) -> None:
        self.status = status
        if content_type.startswith("text/event-stream"):
            self._sse = SseStreamFilter(strip_usage_event=self._strip_usage_event)
        elif self.accepted:
            self._json = JsonUsageScanner()

    def on_chunk(self, chunk: bytes, *, end_of_stream: bool) -> bytes | None:
        """Read one chunk; returns its replacement when the client must see other bytes
        (an injected usage event stripped), else None."""
        if self._sse is not None:
            forwarded = self._sse.feed(chunk)
            if end_of_stream:
                forwarded += self._sse.finish()
            if forwarded is not chunk and forwarded != chunk:
                return forwarded
        elif self._json is not None:
            self._json.feed(chunk)
        return None

    def reported_usage(self) -> Usage | None:
        """The backend's own usage, when it was read."""
        if not self.accepted:
            return None
        if self._sse is not None:
            return self._sse.usage
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
                prompt_tokens=reported.prompt_tokens,
                output_tokens=reported.completion_tokens,
                cached_tokens=reported.cached_tokens,
            )
        )
        sse = self._sse
        text = sse.output_text() if sse is not None else ""
        counted = 0
        if usage is None and text and self.accepted:
            counted = await count_output(text)
        return ResponseReading(
            accepted=self.accepted,
            streamed=self._stream_requested,
            usage=usage,
            counted_output_tokens=counted,
            content_events=sse.content_events if sse is not None else 0,
            output_text_complete=sse is not None and not sse.output_text_truncated,
            visible_text=bool(text),
        )
