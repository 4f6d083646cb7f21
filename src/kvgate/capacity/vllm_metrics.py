"""Reading a vLLM server's capacity and load from its Prometheus ``/metrics`` text.

Pure: no I/O, no clock. The names are those of vLLM's v1 engine
(``vllm/v1/metrics/loggers.py``):

- ``vllm:cache_config_info`` -- a gauge fixed at 1 whose labels are the CacheConfig
  (``num_gpu_blocks``, ``block_size``, ...) plus ``engine``; it has no ``model_name``.
- ``vllm:kv_cache_usage_perc`` -- 0..1 (``vllm:gpu_cache_usage_perc`` before v0.10).
- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` -- gauges.
- ``vllm:num_preemptions`` -- a counter, exposed as ``vllm:num_preemptions_total``.

Series carry ``model_name`` and ``engine`` labels. A data-parallel server exposes one
series per engine; each engine has its own cache, so capacities and queue lengths add
up while the KV usage reported is the fullest engine's (the one that preempts first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG_INFO = "vllm:cache_config_info"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
KV_CACHE_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions"
# The engine's own token counters (counters: exposed with _total), read to reconcile what
# kvgate booked with what the engine processed.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"

_WANTED = frozenset(
    {
        CACHE_CONFIG_INFO,
        KV_CACHE_USAGE,
        KV_CACHE_USAGE_LEGACY,
        REQUESTS_RUNNING,
        REQUESTS_WAITING,
        PREEMPTIONS,
        PREEMPTIONS + "_total",
        PROMPT_TOKENS,
        PROMPT_TOKENS + "_total",
        GENERATION_TOKENS,
        GENERATION_TOKENS + "_total",
    }
)


class VllmMetricsError(ValueError):
    """The text is not Prometheus exposition, or holds no vLLM series for the model."""


@dataclass(frozen=True, slots=True)
class VllmCapacity:
    """One scrape's view of a vLLM server. ``None`` means "not exposed"."""

    model_name: str | None
    num_gpu_blocks: int | None
    block_size: int | None
    # num_gpu_blocks * block_size summed over engines; None without cache_config_info.
    kv_capacity_tokens: int | None
    # Fraction 0..1 of the KV blocks in use.
    kv_cache_usage: float | None
    num_requests_running: int | None
    num_requests_waiting: int | None
    num_preemptions_total: int | None
    engines: int = 1
    # Prompt tokens the engine prefilled and tokens it generated, since it started (summed
    # over engines); None when not exposed.
    prompt_tokens_total: int | None = None
    generation_tokens_total: int | None = None

    @property
    def kv_used_tokens(self) -> int | None:
        if self.kv_capacity_tokens is None or self.kv_cache_usage is None:
            return None
        return round(self.kv_capacity_tokens * self.kv_cache_usage)

    @property
    def kv_free_tokens(self) -> int | None:
        used = self.kv_used_tokens
        if used is None or self.kv_capacity_tokens is None:
            return None
        return max(0, self.kv_capacity_tokens - used)


def parse_vllm_metrics(text: str, model_name: str | None = None) -> VllmCapacity:
    """The capacity and load in a vLLM ``/metrics`` body.

    With ``model_name``, series whose ``model_name`` label names another model are
    ignored (series without the label, like ``cache_config_info``, are kept). Raises
    :class:`VllmMetricsError` when the text cannot be parsed or carries none of the
    vLLM series we read -- most likely the URL does not point at a vLLM server.
    """
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    models_seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(_relevant_lines(text)):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue  # e.g. the _created sample of a counter
                labels = dict(sample.labels)
                if "model_name" in labels:
                    models_seen.add(labels["model_name"])
                if model_name is not None and labels.get("model_name", model_name) != model_name:
                    continue
                samples.setdefault(sample.name, []).append((labels, sample.value))
    except ValueError as exc:  # the parser's only error type for malformed input
        raise VllmMetricsError(f"malformed metrics text: {exc}") from exc
    if model_name is not None and models_seen and model_name not in models_seen:
        # Why an error, not an empty result: a misconfigured name must not look like
        # a healthy, idle server.
        found = ", ".join(sorted(models_seen))
        raise VllmMetricsError(f"no vLLM metrics for model {model_name!r} (found: {found})")
    if not samples:
        raise VllmMetricsError("no vLLM metrics in the scrape")

    blocks, block_size, capacity, engines = _cache_config(samples.get(CACHE_CONFIG_INFO, []))
    usage_series = samples.get(KV_CACHE_USAGE) or samples.get(KV_CACHE_USAGE_LEGACY) or []
    # NaN (an engine that has not reported yet) is "unknown", not a usage figure.
    usage = max((v for _, v in _per_engine(usage_series) if not math.isnan(v)), default=None)
    preempt = samples.get(PREEMPTIONS + "_total") or samples.get(PREEMPTIONS) or []
    running = _sum(samples.get(REQUESTS_RUNNING, []))
    waiting = _sum(samples.get(REQUESTS_WAITING, []))
    seen_engines = max(
        engines,
        *(len(_per_engine(samples.get(n, []))) for n in (REQUESTS_RUNNING, REQUESTS_WAITING)),
        1,
    )
    return VllmCapacity(
        model_name=model_name if model_name is not None else _only(models_seen),
        num_gpu_blocks=blocks,
        block_size=block_size,
        kv_capacity_tokens=capacity,
        kv_cache_usage=None if usage is None else min(max(usage, 0.0), 1.0),
        num_requests_running=running,
        num_requests_waiting=waiting,
        num_preemptions_total=_sum(preempt),
        engines=seen_engines,
        prompt_tokens_total=_sum(samples.get(PROMPT_TOKENS + "_total", [])),
        generation_tokens_total=_sum(samples.get(GENERATION_TOKENS + "_total", [])),
    )


# --- helpers -----------------------------------------------------------------------


def _relevant_lines(text: str) -> str:
    """Only the lines of the series we read.

    Why: a real vLLM scrape is mostly histogram buckets; dropping them first keeps the
    parse cheap enough to run on the event loop, and a malformed series we never
    read cannot fail the scrape.
    """
    keep: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in _WANTED:
                keep.append(line)
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if i != -1:
                end = min(end, i)
        if line[:end] in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def _per_engine(
    series: list[tuple[dict[str, str], float]],
) -> list[tuple[tuple[str, str], float]]:
    # One value per (model, engine), the last one winning: duplicates would only come
    # from a proxy that concatenates scrapes, and double counting is worse.
    by_engine: dict[tuple[str, str], float] = {}
    for labels, value in series:
        by_engine[(labels.get("model_name", ""), labels.get("engine", ""))] = value
    return list(by_engine.items())


def _sum(series: list[tuple[dict[str, str], float]]) -> int | None:
    values = _per_engine(series)
    if not values:
        return None
    return int(sum(v for _, v in values))


def _cache_config(
    series: list[tuple[dict[str, str], float]],
) -> tuple[int | None, int | None, int | None, int]:
    """(blocks, block_size, capacity tokens, engines) from cache_config_info."""
    per_engine: dict[str, tuple[int, int]] = {}
    for labels, _ in series:
        blocks = _label_int(labels, "num_gpu_blocks")
        size = _label_int(labels, "block_size")
        # Before profiling ends num_gpu_blocks is "None": no capacity known yet.
        if blocks is None or size is None:
            continue
        per_engine[labels.get("engine", "")] = (blocks, size)
    if not per_engine:
        return None, None, None, 0
    sizes = {size for _, size in per_engine.values()}
    total_blocks = sum(blocks for blocks, _ in per_engine.values())
    capacity = sum(blocks * size for blocks, size in per_engine.values())
    return total_blocks, (sizes.pop() if len(sizes) == 1 else None), capacity, len(per_engine)


def _label_int(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(labels[name])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def _only(names: set[str]) -> str | None:
    return next(iter(names)) if len(names) == 1 else None
