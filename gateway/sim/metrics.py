"""Prometheus state of one simulated engine, rendered by hand in vLLM's exposition.

Names, types and labels follow vLLM V1's ``PrometheusStatLogger`` (contract section 3):
every series carries ``model_name`` and ``engine="0"``; counters are exposed with the
``_total`` suffix as prometheus_client does; histograms use vLLM's bucket boundaries.
``deprecated=True`` also exports the names hidden in 0.10/0.11 (``vllm:gpu_cache_usage_perc``,
``vllm:gpu_prefix_cache_queries/hits``) for gateways that still read them.
Hand rendering keeps a scrape cheap and avoids any global registry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


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

    def render(self, model: str, gauges: Gauges, deprecated: bool = False) -> str:
        labels = f'model_name="{_escape(model)}",engine="0"'
        c = self.counters
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            sample = name + ("_total" if kind == "counter" else "")
            out.append(f"{sample}{{{labels}{extra}}} {_num(value)}\n")

        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            gauges.running,
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            gauges.waiting,
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            gauges.kv_usage,
        )
        if deprecated:
            metric(
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                gauges.kv_usage,
            )
            metric(
                "vllm:gpu_prefix_cache_queries",
                "counter",
                "GPU prefix cache queries, in terms of number of queried tokens.",
                c.prefix_queries,
            )
            metric(
                "vllm:gpu_prefix_cache_hits",
                "counter",
                "GPU prefix cache hits, in terms of number of cached tokens.",
                c.prefix_hits,
            )
        metric(
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_queries,
        )
        metric(
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_hits,
        )
        metric(
            "vllm:num_preemptions",
            "counter",
            "Cumulative number of preemption from the engine.",
            c.preemptions,
        )
        metric(
            "vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", c.prompt_tokens
        )
        metric(
            "vllm:prompt_tokens_cached",
            "counter",
            "Number of cached prompt tokens (local + external).",
            c.prompt_tokens_cached,
        )
        metric(
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            c.generation_tokens,
        )
        out.append(
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
        )
        for reason, n in c.success.items():
            out.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {n}\n')
        for name, help_text, h in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                self.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                self.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                self.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                self.queue,
            ),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.prompt_len),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                self.generation_len,
            ),
        ):
            out.append(_histogram(name, help_text, labels, h))
        out.append(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{gauges.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
            f'num_cpu_blocks="None",num_gpu_blocks="{gauges.num_gpu_blocks}",'
            f'prefix_caching_hash_algo="xxhash"}} 1.0\n'
        )
        return "".join(out)


def _histogram(name: str, help_text: str, labels: str, h: Histogram) -> str:
    lines = [f"# HELP {name} {help_text}\n# TYPE {name} histogram\n"]
    cumulative = 0
    for bound, n in zip(h.buckets, h.counts, strict=False):
        cumulative += n
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}.0\n')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {h.count}.0\n')
    lines.append(f"{name}_count{{{labels}}} {h.count}.0\n")
    lines.append(f"{name}_sum{{{labels}}} {_num(h.total)}\n")
    return "".join(lines)


def _num(v: float) -> str:
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
