"""KV-cache capacity: sizing it from a model config, and reading it from a live vLLM.

Pure parts are exported here; the async poller lives in
:mod:`kvgate.capacity.discovery` (imported on its own so that pure users do not pull
in aiohttp), and the ``kv-budget`` command in :mod:`kvgate.capacity.cli`.
"""

from kvgate.capacity.backpressure import BackpressurePolicy, BackpressureVerdict
from kvgate.capacity.calculator import (
    KvBudget,
    KvBudgetError,
    KvLayout,
    compute_kv_budget,
    kv_layout,
    load_model_config,
)
from kvgate.capacity.units import format_bytes, parse_size
from kvgate.capacity.vllm_metrics import VllmCapacity, VllmMetricsError, parse_vllm_metrics

__all__ = [
    "BackpressurePolicy",
    "BackpressureVerdict",
    "KvBudget",
    "KvBudgetError",
    "KvLayout",
    "VllmCapacity",
    "VllmMetricsError",
    "compute_kv_budget",
    "format_bytes",
    "kv_layout",
    "load_model_config",
    "parse_size",
    "parse_vllm_metrics",
]
