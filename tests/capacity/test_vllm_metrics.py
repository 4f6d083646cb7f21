"""Reading capacity and load out of vLLM's /metrics text."""

from __future__ import annotations

import pytest

from kvgate.capacity.vllm_metrics import VllmCapacity, VllmMetricsError, parse_vllm_metrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# A trimmed scrape of a vLLM 0.10 server (v1 engine), in the classic text format that
# prometheus_client writes: HELP/TYPE lines, counters with _total and _created samples,
# histogram buckets, and the CacheConfig info gauge with no model_name label.
VLLM_SCRAPE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12034.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4375
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90112.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.234567e+06
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 89012.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.1415
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27910",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""  # noqa: E501


def test_realistic_scrape() -> None:
    cap = parse_vllm_metrics(VLLM_SCRAPE, MODEL)
    assert cap == VllmCapacity(
        model_name=MODEL,
        num_gpu_blocks=27910,
        block_size=16,
        kv_capacity_tokens=27910 * 16,  # 446,560
        kv_cache_usage=0.4375,
        num_requests_running=12,
        num_requests_waiting=3,
        num_preemptions_total=7,
        engines=1,
        prompt_tokens_total=1_234_567,
        generation_tokens_total=89_012,
    )
    # 446,560 x 0.4375 = 195,370 tokens in use.
    assert cap.kv_used_tokens == 195370
    assert cap.kv_free_tokens == 446560 - 195370


def test_without_model_filter_the_single_model_is_named() -> None:
    cap = parse_vllm_metrics(VLLM_SCRAPE)
    assert cap.model_name == MODEL
    assert cap.kv_capacity_tokens == 446560


def test_counter_declared_without_total_suffix() -> None:
    # prometheus_client itself writes "# TYPE vllm:num_preemptions counter" with a
    # vllm:num_preemptions_total sample (the vLLM simulator does); both forms parse.
    text = VLLM_SCRAPE.replace(
        "# TYPE vllm:num_preemptions_total counter", "# TYPE vllm:num_preemptions counter"
    ).replace("# HELP vllm:num_preemptions_total", "# HELP vllm:num_preemptions")
    assert parse_vllm_metrics(text, MODEL).num_preemptions_total == 7


def test_legacy_gpu_cache_usage_name() -> None:
    text = VLLM_SCRAPE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_vllm_metrics(text, MODEL).kv_cache_usage == 0.4375


def test_new_name_wins_when_both_are_exposed() -> None:
    legacy = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        f'vllm:gpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.99\n'
    )
    assert parse_vllm_metrics(VLLM_SCRAPE + legacy, MODEL).kv_cache_usage == 0.4375


def test_missing_cache_config_info_means_unknown_capacity() -> None:
    text = "\n".join(line for line in VLLM_SCRAPE.splitlines() if "cache_config_info" not in line)
    cap = parse_vllm_metrics(text, MODEL)
    assert cap.kv_capacity_tokens is None
    assert cap.num_gpu_blocks is None
    assert cap.kv_used_tokens is None
    assert cap.kv_cache_usage == 0.4375
    assert cap.num_requests_running == 12


def test_num_gpu_blocks_none_means_unknown_capacity() -> None:
    text = VLLM_SCRAPE.replace('num_gpu_blocks="27910"', 'num_gpu_blocks="None"')
    assert parse_vllm_metrics(text, MODEL).kv_capacity_tokens is None


def test_other_models_series_are_ignored() -> None:
    other = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="other"} 50.0\n'
    )
    # Appending a second family of the same name is what a proxy merging scrapes
    # would produce; the filter keeps only our model's series.
    cap = parse_vllm_metrics(VLLM_SCRAPE + other, MODEL)
    assert cap.num_requests_waiting == 3
    # Unfiltered, two models are summed and no single name is reported.
    both = parse_vllm_metrics(VLLM_SCRAPE + other)
    assert both.num_requests_waiting == 53
    assert both.model_name is None


def test_wrong_model_name_is_an_error() -> None:
    with pytest.raises(VllmMetricsError, match=r"no vLLM metrics for model 'qwen'.*found: meta"):
        parse_vllm_metrics(VLLM_SCRAPE, "qwen")


def test_no_vllm_series_is_an_error() -> None:
    text = '# TYPE up gauge\nup{job="x"} 1.0\n'
    with pytest.raises(VllmMetricsError, match="no vLLM metrics"):
        parse_vllm_metrics(text)
    with pytest.raises(VllmMetricsError):
        parse_vllm_metrics("")


def test_malformed_text_is_an_error() -> None:
    text = 'vllm:num_requests_running{engine="0" 3\n'
    with pytest.raises(VllmMetricsError, match="malformed"):
        parse_vllm_metrics(text)


def test_malformed_unrelated_series_do_not_fail_the_scrape() -> None:
    text = "some_other_metric{oops 1\n" + VLLM_SCRAPE
    assert parse_vllm_metrics(text, MODEL).num_requests_running == 12


def test_data_parallel_engines_add_up() -> None:
    # Two engines (DP=2), each with its own cache: capacities and queues add, usage is
    # the fuller engine's.
    lines = []
    for engine, blocks, usage, running, waiting in (
        ("0", 1000, 0.25, 4, 0),
        ("1", 1000, 0.9, 6, 2),
    ):
        labels = f'engine="{engine}",model_name="m"'
        lines += [
            f"vllm:num_requests_running{{{labels}}} {running}",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            f"vllm:num_preemptions_total{{{labels}}} 1.0",
            "vllm:cache_config_info"
            f'{{block_size="16",engine="{engine}",num_gpu_blocks="{blocks}"}} 1.0',
        ]
    cap = parse_vllm_metrics("\n".join(lines) + "\n", "m")
    assert cap.engines == 2
    assert cap.num_gpu_blocks == 2000
    assert cap.kv_capacity_tokens == 32000
    assert cap.kv_cache_usage == 0.9
    assert cap.num_requests_running == 10
    assert cap.num_requests_waiting == 2
    assert cap.num_preemptions_total == 2


def test_usage_is_clamped_to_0_1() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.0000001\n'
    assert parse_vllm_metrics(text, "m").kv_cache_usage == 1.0


def test_nan_usage_is_unknown() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'
    assert parse_vllm_metrics(text, "m").kv_cache_usage is None
