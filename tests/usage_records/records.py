"""Records for tests: distinct, with every field set as a settlement would."""

from __future__ import annotations

from kvgate.usage_records import AnswerSource, UsageRecord


def make_record(n: int, *, tenant: str = "acme", at: float = 1_796_000_000.0) -> UsageRecord:
    hit = n % 5 == 0
    return UsageRecord(
        record_id=f"rec-{n:06d}",
        request_id=f"req-{n}",
        occurred_at=at + n * 0.5,
        ledger_day="2026-12-01",
        ledger_month="2026-12",
        tenant=tenant,
        api="chat_completions",
        path="/v1/chat/completions",
        requested_model="m-a" if n % 2 else "m-b",
        served_model="m-a" if n % 2 else "m-b",
        backend=None if hit else "vllm-local",
        endpoint=None,
        prompt_tokens=10 + n,
        cached_tokens=n % 3,
        output_tokens=7 * n,
        reasoning_tokens=None,
        cost_pico=123_456_789 * n + 1,
        pricing_version="abcd",
        answer_source=AnswerSource.EXACT_CACHE if hit else AnswerSource.BACKEND,
        status=200,
        settle_cause="completed",
        booked_request=n % 10 != 0,
        cache_hit=hit,
        saved_tokens=17 if hit else 0,
        decision_ms=1.25,
        ttft_ms=None if hit else 30.5,
        duration_ms=90.0,
    )
