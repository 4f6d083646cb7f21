"""The billing rule: what a tenant pays for a forwarded request, by how it ended.

One rule, in one place. Its inputs are what kvgate saw of the answer (a
:class:`ResponseReading`); its output is the usage that is booked and priced.

- completed (2xx, end of stream): the backend's own usage. A stream without a usage event
  (the split layout does not inject one): the prompt and the counted output text, at least
  one token per content event. Otherwise, when the answer carried no usage kvgate could
  read, the reservation's worst case (prompt + every token it was allowed to generate): an
  answer kvgate cannot meter is never free.
- upstream error (non-2xx): nothing; the engine produced no answer.
- cut before its end (client gone, Envoy timeout, shutdown), ``backend_work`` (default): the
  backend's usage if it arrived. A stream the backend accepted (2xx headers, sent before the
  prefill) pays the prompt plus the counted output text, at least one token per content
  event (special tokens make no visible text); a stream cut before its headers pays
  nothing. A non-streamed request cut while the engine worked on it pays its prompt (the
  prefill was done); one cut after its headers (sent only once the answer is generated
  whole) without readable usage pays the worst case.
- cut, ``visible_text`` (the older rule, an option): nothing unless answer text reached the
  client, then the prompt and the counted output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvgate.policy import ActualUsage, Reservation, SettleCause


class CutRequestCharge(enum.StrEnum):
    BACKEND_WORK = "backend_work"
    VISIBLE_TEXT = "visible_text"


@dataclass(frozen=True, slots=True)
class ResponseReading:
    """What kvgate saw of one answer by the time it settles."""

    # The backend answered with 2xx headers.
    accepted: bool = False
    # The client asked for a stream of SSE events (else one JSON body).
    streamed: bool = False
    # The backend's own usage, when kvgate could read it.
    usage: ActualUsage | None = None
    # Output tokens counted from the answer text kvgate saw (cut streams).
    counted_output_tokens: int = 0
    # SSE events that carried generated content for some choice.
    content_events: int = 0
    # kvgate kept all of the streamed answer text (it keeps a bounded amount).
    output_text_complete: bool = False
    # Some answer text reached the client.
    visible_text: bool = False
    # The answer's HTTP status (0: no answer head arrived); the usage record's.
    status: int = 0


ZERO = ActualUsage(prompt_tokens=0, output_tokens=0)


def worst_case(reservation: Reservation) -> ActualUsage:
    request = reservation.request
    return ActualUsage(
        prompt_tokens=request.prompt_tokens,
        output_tokens=request.reserved_output_tokens,
    )


def charged_usage(
    cause: SettleCause,
    reading: ResponseReading,
    reservation: Reservation,
    rule: CutRequestCharge = CutRequestCharge.BACKEND_WORK,
) -> tuple[ActualUsage, bool]:
    """The usage to book, and whether it was metered (False: the worst case was charged
    because the answer's usage could not be read)."""
    if cause is SettleCause.UPSTREAM_ERROR:
        return ZERO, True
    prompt = reservation.request.prompt_tokens
    if cause is SettleCause.COMPLETED:
        if reading.usage is not None:
            return reading.usage, True
        if reading.streamed and reading.output_text_complete:
            # A stream without a usage event (the split layout cannot ask for one): count
            # the text it carried, at least one token per content event.
            output = max(reading.counted_output_tokens, reading.content_events)
            return ActualUsage(prompt_tokens=prompt, output_tokens=output), True
        return worst_case(reservation), False
    # Cut before the end.
    if rule is CutRequestCharge.VISIBLE_TEXT:
        if not reading.visible_text:
            return ZERO, True
        if reading.usage is not None:
            return reading.usage, True
        return ActualUsage(prompt_tokens=prompt, output_tokens=reading.counted_output_tokens), True
    if reading.usage is not None:
        return reading.usage, True
    if not reading.streamed:
        if reading.accepted:
            # vLLM sends a non-streamed answer's headers only once it is generated whole.
            return worst_case(reservation), False
        # Cut while the engine was working on it: the prefill at least was done.
        return ActualUsage(prompt_tokens=prompt, output_tokens=0), True
    if not reading.accepted:
        # A stream's headers come before its prefill: no headers, no work to bill.
        return ZERO, True
    output = max(reading.counted_output_tokens, reading.content_events)
    return ActualUsage(prompt_tokens=prompt, output_tokens=output), True
