"""Parse one replica's Prometheus `/metrics` text into an `EngineSnapshot` (pure).

Algorithm: only the lines that start with one of the names below are handed to
`prometheus_client.parser` (a sample line stands alone: its name, labels and value need
no `# TYPE` line). The filter is what keeps a scrape cheap: real vLLM 0.32 exports ~670
lines, mostly histogram buckets, of which about a dozen are read, and the parser costs
~10 us a line. A scrape must never fail because of one odd line, and the parser stops at
the first line it cannot read, so a text it rejects is parsed again line by line and the
unreadable lines are skipped. At most `MAX_SAMPLE_LINES` wanted lines are read (the first
ones): the parse runs on the event loop.

Any value, read as nothing rather than raised on (tests/test_usage_scrape_values.py):
- a sample whose value is NaN, infinite, negative or above `MAX_VALUE` (1e15: no count,
  token counter or start time comes near) is skipped, as if the line were absent;
- KV usage is a fraction: a finite reading above 1 is taken as 1;
- a `cache_config_info` label (`block_size`, `num_gpu_blocks`) counts only as a whole
  number from 1 to `MAX_LABEL` (2**32); anything else (inf, nan, 1e308, -16, 16.5, a
  word) is absent, so capacity falls back to the configured figure;
- a start time counts only when it is a reading above 0 (0 is "unknown").

Reading (vLLM V1, see vllm-contract.md section 3):
- `vllm:kv_cache_usage_perc`, else the deprecated `vllm:gpu_cache_usage_perc` (<= 0.11).
- `vllm:num_requests_running`, `vllm:num_requests_waiting`.
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens), else the
  deprecated `vllm:gpu_prefix_cache_queries_total` / `..._hits_total`.
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`.
- `vllm:cache_config_info{block_size, num_gpu_blocks}` (info gauge: the labels are the data).
- `process_start_time_seconds` (prometheus_client's process collector, exported by vLLM's
  API server): a new value means the replica restarted.
- `vllm:prompt_tokens_by_source_total{source}` (vLLM >= 0.32): `local_cache_hit` and
  `external_kv_transfer` summed apart (the engine's split of its cached prompt tokens;
  `/stats` `pd` shows it for prefill replicas).

Data parallel: each engine exports its own series (label `engine`). Counts and counters
are summed over series; `num_gpu_blocks` is summed too (each engine has its own cache);
KV usage is the maximum over engines, because the fullest engine is the one that
preempts first and it is what the 85%/95% warnings are about.

llama.cpp (`llamacpp:` names, used only when no `vllm:` value exists):
`requests_processing` -> running, `requests_deferred` -> waiting, `kv_cache_usage_ratio`
-> KV usage (older builds only), `tokens_predicted_total` -> generation tokens,
`prompt_tokens_cached_total` -> prefix-cache hits. llama.cpp's `prompt_tokens_total`
counts only the prompt tokens it evaluated (cached ones are skipped), so vLLM's meaning
(all prompt tokens, cached included) and the prefix-cache queries are
`prompt_tokens_total + prompt_tokens_cached_total` when the cached counter exists.
llama.cpp reports no cache config, so capacity stays unknown (configured elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.usage.snapshot import EngineSnapshot

# Names whose samples are summed over series (engines, models).
_SUMMED = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:prompt_tokens_cached_total",
        "llamacpp:tokens_predicted_total",
    }
)
_START = "process_start_time_seconds"
_MAXED = frozenset(
    {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio",
     _START}
)  # fmt: skip
_INFO = "vllm:cache_config_info"
# vLLM's split of the prompt tokens, summed per `source` label (engines, models)
_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
_SOURCES = {"local_cache_hit": "by_source:local_cache_hit",
            "external_kv_transfer": "by_source:external_kv_transfer"}
_WANTED = _SUMMED | _MAXED | {_INFO, _BY_SOURCE}
_PREFIXES = tuple(sorted(_WANTED))  # for str.startswith; longer names are dropped by _WANTED
_KV = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "llamacpp:kv_cache_usage_ratio"})
MAX_VALUE = 1e15  # above any real count, counter (tokens) or unix time
MAX_LABEL = 1 << 32  # above any real block size or block count
# Lines with a wanted name read from one text (the rest skipped): real vLLM has about a
# dozen an engine; the bound keeps one page's parse to tens of milliseconds on the event
# loop, where 8 MiB of wanted lines took seconds (~10 us a line, twice when one is odd).
MAX_SAMPLE_LINES = 4096


def _samples(text: str) -> Iterator[Sample]:
    """Every readable sample of the text whose name is wanted."""
    lines = list(islice((line for line in text.splitlines() if line.startswith(_PREFIXES)),
                        MAX_SAMPLE_LINES))
    try:
        families = list(text_string_to_metric_families("\n".join(lines)))
    except Exception:
        families = [f for line in lines for f in _line_families(line)]
    for family in families:
        for sample in family.samples:
            if sample.name in _WANTED:
                yield sample


def _line_families(line: str) -> list[Metric]:
    try:
        return list(text_string_to_metric_families(line))
    except Exception:
        return []


def reading(raw: float) -> float | None:
    """A sample's value as a reading, or None (module docstring). The parser hands over
    an int for a value written without a point, of any length: float() may overflow."""
    try:
        value = float(raw)
    except (OverflowError, ValueError, TypeError):
        return None
    if not 0.0 <= value <= MAX_VALUE:  # NaN fails every comparison
        return None
    return value


def int_label(labels: dict[str, str], key: str) -> int | None:
    """A whole number from 1 to MAX_LABEL in label `key`, else None (module docstring)."""
    raw = labels.get(key)
    if raw is None or len(raw) > 32:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not 1.0 <= value <= MAX_LABEL or not value.is_integer():
        return None
    return int(value)


def parse_engine_metrics(text: str, now: float) -> EngineSnapshot:
    """The snapshot a replica's `/metrics` text describes, stamped `now`."""
    values: dict[str, float] = {}
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    for name, labels, raw_value, *_ in _samples(text):
        value = reading(raw_value)
        if value is None:
            continue
        if name in _KV:
            value = min(value, 1.0)
        if name == _INFO:
            bs = int_label(labels, "block_size")
            nb = int_label(labels, "num_gpu_blocks")
            if bs is not None:
                block_size = bs
            if nb is not None:
                num_gpu_blocks = nb if num_gpu_blocks is None else num_gpu_blocks + nb
        elif name == _BY_SOURCE:
            key = _SOURCES.get(labels.get("source", ""))
            if key is not None:
                values[key] = values.get(key, 0.0) + value
        elif name in _MAXED:
            values[name] = max(values.get(name, value), value)
        else:
            values[name] = values.get(name, 0.0) + value

    def first(*names: str) -> float | None:
        for n in names:
            if n in values:
                return values[n]
        return None

    lc_prompt = values.get("llamacpp:prompt_tokens_total")
    lc_cached = values.get("llamacpp:prompt_tokens_cached_total")
    lc_queries = None if lc_prompt is None or lc_cached is None else lc_prompt + lc_cached
    queries = first("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
    hits = first("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    prompt = first("vllm:prompt_tokens_total")
    if queries is None and hits is None and prompt is None:
        queries, hits = lc_queries, lc_cached
        prompt = lc_queries if lc_queries is not None else lc_prompt
    return EngineSnapshot(
        ts=now,
        kv_cache_usage=first(
            "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"
        ),
        num_requests_running=first("vllm:num_requests_running", "llamacpp:requests_processing"),
        num_requests_waiting=first("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
        prefix_cache_queries_total=queries,
        prefix_cache_hits_total=hits,
        prompt_tokens_total=prompt,
        generation_tokens_total=first(
            "vllm:generation_tokens_total", "llamacpp:tokens_predicted_total"
        ),
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        process_start_time_seconds=values.get(_START) or None,  # 0: unknown
        local_cache_hit_tokens_total=values.get(_SOURCES["local_cache_hit"]),
        external_kv_tokens_total=values.get(_SOURCES["external_kv_transfer"]),
    )
