"""parse_engine_metrics: real-looking /metrics texts from both vLLM metric eras, data
parallel engines, llama.cpp, and garbage."""

# ruff: noqa: E501  (real exposition lines are long)
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.replicas.scrape import parse_engine_metrics
from gateway.usage.snapshot import EngineSnapshot

VLLM_CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.4217
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 120000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 1.76e9
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 96000.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 121000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 5400.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 40.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27264",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""

VLLM_DEPRECATED = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.91
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5000.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2500.0
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
"""

# Both names present (0.10 with --show-hidden-metrics-for-version): the current one wins.
VLLM_BOTH = VLLM_DEPRECATED + """\
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6000.0
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3000.0
"""

VLLM_DP2 = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.30
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.97
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="500"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="500"} 1.0
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2903.63
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens served from the cache.
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 14000
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""

LLAMACPP_OLD = """\
llamacpp:prompt_tokens_total 500
llamacpp:tokens_predicted_total 40
llamacpp:kv_cache_usage_ratio 0.25
llamacpp:kv_cache_tokens 512
llamacpp:requests_processing 0
llamacpp:requests_deferred 0
"""

GARBAGE = """\
this is not prometheus
vllm:num_requests_running{engine="0" 4
vllm:num_requests_running{engine="0"} not-a-number
vllm:num_requests_running
vllm:num_requests_waiting{engine="0",model_name="a \\"quoted\\", name"} 2
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:kv_cache_usage_perc 0.5 1761234567000
\x00\xff binary junk
vllm:prompt_tokens_total{engine="0"} 12 # not a timestamp: the line is skipped
vllm:generation_tokens_total{engine="0"} 12
"""


def snap(**kw: object) -> EngineSnapshot:
    base: dict[str, object] = dict(
        ts=100.0, kv_cache_usage=None, num_requests_running=None, num_requests_waiting=None,
        prefix_cache_queries_total=None, prefix_cache_hits_total=None, prompt_tokens_total=None,
        generation_tokens_total=None, num_gpu_blocks=None, block_size=None,
    )  # fmt: skip
    base.update(kw)
    return EngineSnapshot(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            VLLM_CURRENT,
            snap(kv_cache_usage=0.4217, num_requests_running=3.0, num_requests_waiting=1.0,
                 prefix_cache_queries_total=120000.0, prefix_cache_hits_total=96000.0,
                 prompt_tokens_total=121000.0, generation_tokens_total=5400.0,
                 num_gpu_blocks=27264, block_size=16),
            id="vllm-current",
        ),
        pytest.param(
            VLLM_DEPRECATED,
            snap(kv_cache_usage=0.91, num_requests_running=7.0, num_requests_waiting=0.0,
                 prefix_cache_queries_total=5000.0, prefix_cache_hits_total=2500.0,
                 num_gpu_blocks=1000, block_size=32),
            id="vllm-deprecated-gpu-names",
        ),
        pytest.param(
            VLLM_BOTH,
            snap(kv_cache_usage=0.5, num_requests_running=7.0, num_requests_waiting=0.0,
                 prefix_cache_queries_total=6000.0, prefix_cache_hits_total=3000.0,
                 num_gpu_blocks=1000, block_size=32),
            id="vllm-both-names-current-wins",
        ),
        pytest.param(
            VLLM_DP2,
            snap(kv_cache_usage=0.97, num_requests_running=7.0, num_requests_waiting=4.0,
                 prefix_cache_queries_total=400.0, prefix_cache_hits_total=40.0,
                 num_gpu_blocks=1000, block_size=16),
            id="vllm-data-parallel-2-engines",
        ),
        pytest.param(
            LLAMACPP,
            snap(num_requests_running=2.0, num_requests_waiting=1.0,
                 prefix_cache_queries_total=20886.0, prefix_cache_hits_total=14000.0,
                 prompt_tokens_total=20886.0, generation_tokens_total=3469.0),
            id="llamacpp",
        ),
        pytest.param(
            LLAMACPP_OLD,
            snap(kv_cache_usage=0.25, num_requests_running=0.0, num_requests_waiting=0.0,
                 prompt_tokens_total=500.0, generation_tokens_total=40.0),
            id="llamacpp-old-without-cached-counter",
        ),
        pytest.param(
            GARBAGE,
            snap(kv_cache_usage=0.5, num_requests_waiting=2.0, generation_tokens_total=12.0),
            id="garbage-tolerated",
        ),
        pytest.param("", snap(), id="empty"),
    ],
)
def test_parse_engine_metrics(text: str, expected: EngineSnapshot) -> None:
    assert parse_engine_metrics(text, now=100.0) == expected


def test_capacity_from_cache_config() -> None:
    assert parse_engine_metrics(VLLM_CURRENT, now=1.0).capacity_tokens == 27264 * 16
    assert parse_engine_metrics(LLAMACPP, now=1.0).capacity_tokens is None


def test_snapshot_carries_now() -> None:
    assert parse_engine_metrics(VLLM_CURRENT, now=1234.5).ts == 1234.5


DATA = Path(__file__).parent / "data"


def test_recorded_real_vllm_032() -> None:
    """`/metrics` of a real vLLM 0.32 CPU replica (tests/realvllm's tiny model, after two
    chat requests), recorded whole: 667 lines, histograms, the process collector."""
    text = (DATA / "vllm032_metrics.txt").read_text()
    assert parse_engine_metrics(text, now=100.0) == snap(
        kv_cache_usage=0.0, num_requests_running=0.0, num_requests_waiting=0.0,
        prefix_cache_queries_total=236.0, prefix_cache_hits_total=96.0,
        prompt_tokens_total=236.0, generation_tokens_total=16.0,
        num_gpu_blocks=32768, block_size=32, process_start_time_seconds=1.79553583429e9,
        # vllm:prompt_tokens_by_source_total{source}: 140 computed, 96 local hits, none
        # loaded from a peer (an aggregated replica)
        local_cache_hit_tokens_total=96.0, external_kv_tokens_total=0.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("process_start_time_seconds 1.7e+09\n", 1.7e9),
        ("# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 12.5\n", 12.5),
        ("process_start_time_seconds{pid=\"1\"} 3\nprocess_start_time_seconds{pid=\"2\"} 9\n", 9.0),
        ("process_start_time_seconds NaN\n", None),
        ("process_start_time_seconds\n", None),
        (LLAMACPP, None),
    ],
)
def test_process_start_time(text: str, start: float | None) -> None:
    assert parse_engine_metrics(text, now=1.0).process_start_time_seconds == start


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*VLLM_CURRENT.splitlines(), *GARBAGE.splitlines()])
                | st.text(max_size=60)))
def test_any_text_parses(lines: list[str]) -> None:
    """Whatever the lines, a scrape yields a snapshot (never an exception)."""
    assert parse_engine_metrics("\n".join(lines), now=1.0).ts == 1.0
