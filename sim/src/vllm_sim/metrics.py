"""vLLM's Prometheus metrics (v1 engine names and labels), in a private registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import choose_encoder

from vllm_sim.config import SimConfig
from vllm_sim.engine import EngineListener, KVEngine

# vLLM's FinishReason values; every one gets a series at start-up, as in vLLM.
FINISH_REASONS = ("stop", "length", "abort")
ENGINE_INDEX = "0"


def cache_config_labels(config: SimConfig) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (vLLM: ``str()`` of every CacheConfig
    attribute, in declaration order, plus ``engine``)."""
    override = str(config.num_gpu_blocks) if config.num_gpu_blocks is not None else "None"
    return {
        "block_size": str(config.block_size),
        "gpu_memory_utilization": "0.9",
        "swap_space": "4",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": override,
        "sliding_window": "None",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "prefix_caching_hash_algo": "builtin",
        "cpu_offload_gb": "0",
        "calculate_kv_scales": "False",
        "kv_sharing_fast_prefill": "False",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "swap_space_bytes": str(4 * 1024**3),
        "num_gpu_blocks": str(config.gpu_blocks),
        "num_cpu_blocks": "0",
        "engine": ENGINE_INDEX,
    }


class SimMetrics(EngineListener):
    """Feeds the engine's events into counters; gauges read the engine on scrape."""

    def __init__(self, config: SimConfig, engine: KVEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labelnames = ["model_name", "engine"]
        labels = (config.served_model_name, ENGINE_INDEX)
        reg = self.registry

        running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labelnames,
            registry=reg,
        )
        running.labels(*labels).set_function(lambda: len(engine.running))
        waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labelnames,
            registry=reg,
        )
        waiting.labels(*labels).set_function(lambda: len(engine.waiting))
        kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labelnames,
            registry=reg,
        )
        kv_usage.labels(*labels).set_function(lambda: engine.kv_usage)
        # Registered (at 0) with prefix caching off too, as in vLLM.
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labelnames,
            registry=reg,
        ).labels(*labels)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labelnames,
            registry=reg,
        ).labels(*labels)

        self._preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labelnames,
            registry=reg,
        ).labels(*labels)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            labelnames,
            registry=reg,
        ).labels(*labels)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labelnames,
            registry=reg,
        ).labels(*labels)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labelnames, "finished_reason"],
            registry=reg,
        )
        self._success = {r: success.labels(*labels, r) for r in FINISH_REASONS}

        info = cache_config_labels(config)
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=reg,
        ).labels(**info).set(1)

    # --- EngineListener ------------------------------------------------------------

    def on_preemption(self) -> None:
        self._preemptions.inc()

    def on_prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def on_generation_token(self) -> None:
        self._generation_tokens.inc()

    def on_request_done(self, reason: str) -> None:
        self._success[reason].inc()

    def on_prefix_cache_lookup(self, queries: int, hits: int) -> None:
        self._prefix_queries.inc(queries)
        self._prefix_hits.inc(hits)

    def render(self, accept_header: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept_header)
        return encoder(self.registry), content_type
