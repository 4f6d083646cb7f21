"""Answer meters: read an answer as it passes, in bounded memory, for the bill.

``ResponseMeter`` reads OpenAI's chat and completions answers (and strips the usage event
kvgate injected); ``EventStreamMeter`` reads an API whose answers always carry their usage
(Anthropic Messages, OpenAI Responses: a JSON body or named SSE events), given that API's
stream reader, body scanner and usage fields. Both end in the same ``ResponseReading``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from kvgate.lifecycle.billing import ResponseReading
from kvgate.openai import JsonUsageScanner, SseStreamFilter
from kvgate.policy import ActualUsage

# Counts the tokens of answer text (of the model that served the request).
OutputCounter = Callable[[str], Awaitable[int]]

U = TypeVar("U")
U_co = TypeVar("U_co", covariant=True)


class StreamText(Protocol):
    """What a stream reader kept of the generated text, for a stream cut before its usage."""

    @property
    def content_events(self) -> int: ...

    @property
    def output_text_truncated(self) -> bool: ...

    def output_text(self) -> str: ...


class _MeterBase(abc.ABC):
    """The status and the reading every meter gives the billing rule."""

    def __init__(self, *, stream_requested: bool) -> None:
        self._stream_requested = stream_requested
        self.status = 0

    @property
    def accepted(self) -> bool:
        """The backend answered 2xx."""
        return 200 <= self.status < 300

    @abc.abstractmethod
    def _usage(self) -> ActualUsage | None:
        """The backend's own usage, as the bill's, when it was read."""

    @abc.abstractmethod
    def _stream_text(self) -> StreamText | None:
        """The stream's reader, when the answer is a stream."""

    async def reading(self, count_output: OutputCounter) -> ResponseReading:
        """What was seen of the answer, for the billing rule; counts the streamed text
        only when the backend's usage is missing."""
        usage = self._usage() if self.accepted else None
        stream = self._stream_text()
        text = stream.output_text() if stream is not None else ""
        counted = 0
        if usage is None and text and self.accepted:
            counted = await count_output(text)
        return ResponseReading(
            accepted=self.accepted,
            streamed=self._stream_requested,
            usage=usage,
            counted_output_tokens=counted,
            content_events=stream.content_events if stream is not None else 0,
            output_text_complete=stream is not None and not stream.output_text_truncated,
            visible_text=bool(text),
            status=self.status,
        )


class ResponseMeter(_MeterBase):
    """Owns what kvgate keeps of one OpenAI answer: the status, the SSE filter of a stream
    (which may strip the usage event kvgate injected) or the usage scanner of a JSON body."""

    def __init__(self, *, strip_usage_event: bool, stream_requested: bool) -> None:
        super().__init__(stream_requested=stream_requested)
        self._strip_usage_event = strip_usage_event
        self._sse: SseStreamFilter | None = None
        self._json: JsonUsageScanner | None = None

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

    def _usage(self) -> ActualUsage | None:
        reported = (
            self._sse.usage
            if self._sse is not None
            else self._json.usage
            if self._json is not None
            else None
        )
        if reported is None:
            return None
        return ActualUsage(
            prompt_tokens=reported.prompt_tokens,
            output_tokens=reported.completion_tokens,
            cached_tokens=reported.cached_tokens,
        )

    def _stream_text(self) -> StreamText | None:
        return self._sse


class EventReader(StreamText, Protocol[U_co]):
    """An API's event-stream reader: fed chunk by chunk, it keeps the usage and the text."""

    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> None: ...

    @property
    def usage(self) -> U_co | None: ...


class BodyScanner(Protocol[U_co]):
    """An API's JSON body scanner: fed chunk by chunk, it finds the usage."""

    def feed(self, chunk: bytes) -> None: ...

    @property
    def usage(self) -> U_co | None: ...


class EventStreamMeter(_MeterBase, Generic[U]):
    """An API whose answers always carry their usage (nothing is injected, so every chunk
    passes unchanged): its reader for a stream, its scanner for a JSON body, and how its
    usage reads as the bill's."""

    def __init__(
        self,
        *,
        stream_requested: bool,
        reader: Callable[[], EventReader[U]],
        scanner: Callable[[], BodyScanner[U]],
        billed: Callable[[U], ActualUsage],
    ) -> None:
        super().__init__(stream_requested=stream_requested)
        self._new_reader = reader
        self._new_scanner = scanner
        self._billed = billed
        self._events: EventReader[U] | None = None
        self._json: BodyScanner[U] | None = None

    @property
    def events(self) -> EventReader[U] | None:
        return self._events

    def on_headers(self, status: int, content_type: str) -> None:
        self.status = status
        if content_type.startswith("text/event-stream"):
            self._events = self._new_reader()
        elif self.accepted:
            self._json = self._new_scanner()

    def on_chunk(self, chunk: bytes, *, end_of_stream: bool) -> bytes | None:
        if self._events is not None:
            self._events.feed(chunk)
            if end_of_stream:
                self._events.finish()
        elif self._json is not None:
            self._json.feed(chunk)
        return None

    def reported_usage(self) -> U | None:
        """The backend's own usage, when it was read."""
        if not self.accepted:
            return None
        if self._events is not None:
            return self._events.usage
        if self._json is not None:
            return self._json.usage
        return None

    def _usage(self) -> ActualUsage | None:
        reported = self.reported_usage()
        return None if reported is None else self._billed(reported)

    def _stream_text(self) -> StreamText | None:
        return self._events
