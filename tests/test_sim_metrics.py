"""The simulator's /metrics against the text recorded from real vLLM 0.32
(tests/data/vllm032_metrics.txt, tiny model, max_model_len 16384): every family the
simulator exports exists there with the same type, sample names, label names and
histogram buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.metrics import EngineMetrics, Gauges

REAL = Path(__file__).parent / "data" / "vllm032_metrics.txt"
GAUGES = Gauges(running=2, waiting=1, kv_usage=0.5, num_gpu_blocks=2048, block_size=32)
DEPRECATED = {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries",
              "vllm:gpu_prefix_cache_hits"}  # hidden since vLLM 0.10, gone in 0.32


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sim(deprecated: bool = False) -> dict[str, Metric]:
    metrics = EngineMetrics(16384)
    metrics.ttft.observe(0.3)
    metrics.counters.success["stop"] = 3
    return families(metrics.render("tiny-qwen2", GAUGES, deprecated))


def label_names(family: Metric) -> set[tuple[str, frozenset[str]]]:
    return {(s.name, frozenset(s.labels) - {"le"}) for s in family.samples}


def buckets(family: Metric) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]


REAL_FAMILIES = families(REAL.read_text())


@pytest.mark.parametrize("name", sorted(sim()))
def test_family_matches_real_vllm(name: str) -> None:
    ours, real = sim()[name], REAL_FAMILIES[name]
    assert ours.type == real.type
    assert buckets(ours) == buckets(real)
    if name == "vllm:cache_config_info":  # an info gauge: vLLM 0.32 has more config labels
        ((_, ours_labels),), ((_, real_labels),) = label_names(ours), label_names(real)
        assert ours_labels < real_labels
    else:
        assert label_names(ours) <= label_names(real)


def test_deprecated_names_only_on_request() -> None:
    assert set(sim(deprecated=True)) - set(sim()) == DEPRECATED
    assert not DEPRECATED & set(REAL_FAMILIES)


def test_values_and_label_values() -> None:
    text = EngineMetrics(16384).render('a "quoted"\nmodel', GAUGES)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    labels = (("engine", "0"), ("model_name", 'a "quoted"\nmodel'))
    assert samples[("vllm:kv_cache_usage_perc", labels)] == 0.5
    assert samples[("vllm:num_requests_waiting", labels)] == 1.0
    assert samples[("vllm:time_to_first_token_seconds_count", labels)] == 0.0
