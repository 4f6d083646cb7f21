"""The billing rule, branch by branch, without a server."""

from __future__ import annotations

import pytest

from kvgate.lifecycle import CutRequestCharge, ResponseReading, charged_usage
from kvgate.policy import ActualUsage, AdmissionRequest, Reservation, SettleCause

# A reservation for 50 prompt tokens and up to 2 x 100 output tokens (n=2).
RESERVATION = Reservation(
    reservation_id="r1",
    request=AdmissionRequest(
        request_id="q1",
        tenant="acme",
        model="m",
        backend="b",
        prompt_tokens=50,
        max_new_tokens=100,
        choices=2,
    ),
    kv_tokens=256,
    started_at=0.0,
    expires_at=10.0,
)
REPORTED = ActualUsage(50, 7)
WORST = (50, 200)

DONE = SettleCause.COMPLETED
CUT = SettleCause.DISCONNECTED
STOP = SettleCause.SHUTDOWN
ERROR = SettleCause.UPSTREAM_ERROR


def reading(**fields: object) -> ResponseReading:
    return ResponseReading(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cause", "seen", "charged", "metered"),
    [
        # completed: the backend's usage, else the counted stream, else the worst case
        (DONE, reading(accepted=True, streamed=True, usage=REPORTED), (50, 7), True),
        (
            DONE,
            reading(
                accepted=True,
                streamed=True,
                counted_output_tokens=3,
                content_events=9,
                output_text_complete=True,
            ),
            (50, 9),
            True,
        ),
        (DONE, reading(accepted=True, streamed=True, content_events=9), WORST, False),
        (DONE, reading(accepted=True, streamed=False), WORST, False),
        # the backend refused: free
        (ERROR, reading(accepted=False, streamed=True, content_events=3), (0, 0), True),
        # cut streams: after 2xx headers the prompt and at least one token per event
        (CUT, reading(accepted=True, streamed=True), (50, 0), True),
        (CUT, reading(accepted=True, streamed=True, counted_output_tokens=4), (50, 4), True),
        (CUT, reading(accepted=True, streamed=True, content_events=6), (50, 6), True),
        (STOP, reading(accepted=True, streamed=True, usage=REPORTED), (50, 7), True),
        (CUT, reading(accepted=False, streamed=True), (0, 0), True),
        # cut non-streamed: the prefill was done; after its headers the answer was whole
        (CUT, reading(accepted=False, streamed=False), (50, 0), True),
        (CUT, reading(accepted=True, streamed=False), WORST, False),
        (CUT, reading(accepted=True, streamed=False, usage=REPORTED), (50, 7), True),
    ],
)
def test_backend_work_rule(
    cause: SettleCause, seen: ResponseReading, charged: tuple[int, int], metered: bool
) -> None:
    usage, was_metered = charged_usage(cause, seen, RESERVATION)
    assert (usage.prompt_tokens, usage.output_tokens) == charged
    assert was_metered is metered


@pytest.mark.parametrize(
    ("seen", "charged"),
    [
        (reading(accepted=True, streamed=True, content_events=5), (0, 0)),
        (
            reading(accepted=True, streamed=True, visible_text=True, counted_output_tokens=4),
            (50, 4),
        ),
        (reading(accepted=False, streamed=False), (0, 0)),
    ],
)
def test_visible_text_rule_is_the_older_option(
    seen: ResponseReading, charged: tuple[int, int]
) -> None:
    usage, _ = charged_usage(CUT, seen, RESERVATION, CutRequestCharge.VISIBLE_TEXT)
    assert (usage.prompt_tokens, usage.output_tokens) == charged
