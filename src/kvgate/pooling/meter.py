"""The meter of a pooling answer: one JSON body whose top-level ``usage`` counts the
prompt tokens the engine encoded. Pooling generates nothing, so the bill's output is 0
whatever the answer's ``completion_tokens`` says."""

from __future__ import annotations

from dataclasses import replace

from kvgate.lifecycle.meter import ResponseMeter
from kvgate.policy import ActualUsage


class PoolingMeter(ResponseMeter):
    def __init__(self) -> None:
        # Pooling answers never stream: a JSON body (the SSE reader stays unused).
        super().__init__(strip_usage_event=False, stream_requested=False)

    def _usage(self) -> ActualUsage | None:
        usage = super()._usage()
        return None if usage is None else replace(usage, output_tokens=0)
