"""Prometheus state of one simulated engine, exposed as vLLM exposes it.

Names, types and labels follow vLLM V1's ``PrometheusStatLogger`` (contract section 3):
every series carries ``model_name`` and ``engine="0"``; counters are exposed with the
``_total`` suffix as prometheus_client does; histograms use vLLM's bucket boundaries.
``deprecated=True`` also exports the names hidden in 0.10/0.11 (``vllm:gpu_cache_usage_perc``,
``vllm:gpu_prefix_cache_queries/hits``) for gateways that still read them.
A scrape is rendered by prometheus_client from a private `CollectorRegistry` holding
one collector that builds the families from the engine's counters, histograms and gauges
at that moment (the global registry is never touched); the engine's own bookkeeping stays
plain counters and bucket lists, updated on its hot path without locks.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class Histogram:
    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += n
        self.total += value * n
        self.count += n


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    external_tokens: int = 0  # of the cached, loaded from a peer (KV transfer)
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


# vLLM's NixlPromMetrics: the xfer-time buckets (its list less the first, 0.001).
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)


@dataclass(slots=True)
class NixlStats:
    """The NixlConnector's metrics (only an engine with the connector has them): transfers
    timed on the engine that pulls, failed pulls there, leases expired on the holder."""

    xfer_time: Histogram = field(default_factory=lambda: Histogram(NIXL_XFER_BUCKETS))
    failed: int = 0
    expired: int = 0


@dataclass(frozen=True, kw_only=True)
class Gauges:
    running: int
    waiting: int
    kv_usage: float
    num_gpu_blocks: int
    block_size: int


class EngineMetrics:
    def __init__(self, max_model_len: int) -> None:
        self.counters = EngineCounters()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_len = Histogram(tokens)
        self.generation_len = Histogram(tokens)
        self.nixl: NixlStats | None = None

    def render(self, model: str, gauges: Gauges, deprecated: bool = False,
               started: float | None = None) -> str:
        """The exposition text of one scrape, from a private registry (never the global).
        `started`: the process start time (unix seconds), exported as vLLM's process
        collector does, so a gateway sees a restarted replica."""
        registry = CollectorRegistry(auto_describe=False)
        families = self._families(model, gauges, deprecated)
        if started is not None:
            families.append(GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.", value=started))
        registry.register(_Scrape(families))
        return generate_latest(registry).decode()

    def _families(self, model: str, gauges: Gauges, deprecated: bool) -> list[Metric]:
        values = [model, "0"]
        c = self.counters
        out: list[Metric] = []

        def gauge(name: str, help_text: str, value: float) -> None:
            family = GaugeMetricFamily(name, help_text, labels=_LABELS)
            family.add_metric(values, value)
            out.append(family)

        def counter(name: str, help_text: str, value: float) -> None:
            family = CounterMetricFamily(name, help_text, labels=_LABELS)
            family.add_metric(values, value)
            out.append(family)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              gauges.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              gauges.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              gauges.kv_usage)
        if deprecated:
            gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                  gauges.kv_usage)
            counter("vllm:gpu_prefix_cache_queries",
                    "GPU prefix cache queries, in terms of number of queried tokens.",
                    c.prefix_queries)
            counter("vllm:gpu_prefix_cache_hits",
                    "GPU prefix cache hits, in terms of number of cached tokens.", c.prefix_hits)
        counter("vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.", c.prefix_queries)
        counter("vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits)
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                c.preemptions)
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        counter("vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).", c.prompt_tokens_cached)
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                c.generation_tokens)
        # vLLM 0.32's own split of the prompt tokens (v1/metrics/stats.py PromptTokenStats):
        # computed + local cache hits + external KV transfer = all prompt tokens
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source",
                                        "Number of prompt tokens by source.",
                                        labels=[*_LABELS, "source"])
        for source, n in (("local_compute", c.prompt_tokens - c.prompt_tokens_cached),
                          ("local_cache_hit", c.prompt_tokens_cached - c.external_tokens),
                          ("external_kv_transfer", c.external_tokens)):
            by_source.add_metric([*values, source], n)
        out.append(by_source)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*_LABELS, "finished_reason"])
        for reason, n in c.success.items():
            success.add_metric([*values, reason], n)
        out.append(success)
        for name, help_text, h in (
            ("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", self.e2e),
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", self.queue),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
             self.prompt_len),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.",
             self.generation_len),
        ):
            family = HistogramMetricFamily(name, help_text, labels=_LABELS)
            family.add_metric(values, _buckets(h), h.total)
            out.append(family)
        if self.nixl is not None:
            family = HistogramMetricFamily(
                "vllm:nixl_xfer_time_seconds",
                "Histogram of transfer duration for NIXL KV Cache transfers.", labels=_LABELS)
            family.add_metric(values, _buckets(self.nixl.xfer_time), self.nixl.xfer_time.total)
            out.append(family)
            counter("vllm:nixl_num_failed_transfers",
                    "Number of failed NIXL KV Cache transfers.", self.nixl.failed)
            counter("vllm:nixl_num_kv_expired_reqs",
                    "Number of requests that had their KV expire.", self.nixl.expired)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "engine",
                    "gpu_memory_utilization", "num_cpu_blocks", "num_gpu_blocks",
                    "prefix_caching_hash_algo"])
        info.add_metric([str(gauges.block_size), "auto", "True", "0", "0.9", "None",
                         str(gauges.num_gpu_blocks), "xxhash"], 1.0)
        out.append(info)
        return out


_LABELS = ["model_name", "engine"]


class _Scrape(Collector):
    """The families of one scrape, built from the engine's state when it is asked."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, `+Inf` last, as prometheus_client's Histogram."""
    out: list[tuple[str, float]] = []
    cumulative = 0
    for bound, n in zip(h.buckets, h.counts, strict=False):
        cumulative += n
        out.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
    out.append(("+Inf", h.count))
    return out
