"""Backpressure thresholds: shed only on fresh, positive evidence."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.capacity.backpressure import (
    REASON_KV_CACHE_FULL,
    REASON_NO_DATA,
    REASON_OK,
    REASON_QUEUE_FULL,
    BackpressurePolicy,
)
from kvgate.capacity.vllm_metrics import VllmCapacity

IDLE = VllmCapacity(
    model_name="m",
    num_gpu_blocks=3000,
    block_size=16,
    kv_capacity_tokens=48000,
    kv_cache_usage=0.10,
    num_requests_running=2,
    num_requests_waiting=0,
    num_preemptions_total=0,
)
POLICY = BackpressurePolicy(max_kv_cache_usage=0.95, max_requests_waiting=8)


def test_idle_backend_is_admitted() -> None:
    verdict = POLICY.evaluate(IDLE)
    assert not verdict.shed
    assert verdict.reason == REASON_OK


def test_no_data_never_sheds() -> None:
    # None is what the monitor returns for "never scraped" and for "stale".
    verdict = POLICY.evaluate(None)
    assert not verdict.shed
    assert verdict.reason == REASON_NO_DATA


@pytest.mark.parametrize(
    ("usage", "shed"), [(0.9, False), (0.95, False), (0.9501, True), (1.0, True)]
)
def test_kv_usage_threshold_is_strict(usage: float, shed: bool) -> None:
    verdict = POLICY.evaluate(replace(IDLE, kv_cache_usage=usage))
    assert verdict.shed is shed
    if shed:
        assert verdict.reason == REASON_KV_CACHE_FULL
        assert "limit 95.0%" in verdict.detail


@pytest.mark.parametrize(("waiting", "shed"), [(0, False), (8, False), (9, True), (30, True)])
def test_waiting_threshold_is_strict(waiting: int, shed: bool) -> None:
    verdict = POLICY.evaluate(replace(IDLE, num_requests_waiting=waiting))
    assert verdict.shed is shed
    if shed:
        assert verdict.reason == REASON_QUEUE_FULL
        assert f"{waiting} requests waiting (limit 8)" in verdict.detail


def test_both_full_reports_kv_first_and_both_details() -> None:
    verdict = POLICY.evaluate(replace(IDLE, kv_cache_usage=0.97, num_requests_waiting=9))
    assert verdict.shed
    assert verdict.reason == REASON_KV_CACHE_FULL
    assert "97.0% used" in verdict.detail
    assert "9 requests waiting" in verdict.detail


def test_unexposed_metrics_do_not_shed() -> None:
    verdict = POLICY.evaluate(replace(IDLE, kv_cache_usage=None, num_requests_waiting=None))
    assert not verdict.shed
    assert verdict.reason == REASON_OK


def test_checks_can_be_turned_off() -> None:
    full = replace(IDLE, kv_cache_usage=1.0, num_requests_waiting=100)
    assert (
        not BackpressurePolicy(max_kv_cache_usage=None, max_requests_waiting=None)
        .evaluate(full)
        .shed
    )
    only_queue = BackpressurePolicy(max_kv_cache_usage=None, max_requests_waiting=8)
    assert only_queue.evaluate(full).reason == REASON_QUEUE_FULL


def test_zero_waiting_limit_sheds_on_any_queue() -> None:
    policy = BackpressurePolicy(max_requests_waiting=0)
    assert not policy.evaluate(IDLE).shed
    assert policy.evaluate(replace(IDLE, num_requests_waiting=1)).shed


@pytest.mark.parametrize(
    "kw", [{"max_kv_cache_usage": 0.0}, {"max_kv_cache_usage": 1.2}, {"max_requests_waiting": -1}]
)
def test_bad_thresholds(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackpressurePolicy(**kw)  # type: ignore[arg-type]
