"""Settings of the usage accounting (TOML section `[usage]`, env `GATEWAY_USAGE_*`).

Where records go (a JSON-lines file, stdout, a Redis stream), how much the sinks may
buffer before they drop, how often replicas are scraped, the thresholds the `/stats`
warnings use, and whether a replica is probed for `cached_tokens` reporting when it comes
up (`gateway.replicas.monitor`). Every field has a default, so `UsageConfig()` is a working
configuration (no sinks: records only feed the metrics and the stats windows).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageConfig:
    log_path: str | None = None  # JSON lines, appended; None = no file sink
    log_stdout: bool = False  # JSON lines on stdout
    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0; None = no Redis sink
    redis_stream: str = "gateway:usage"
    redis_maxlen: int = 1_000_000  # XADD MAXLEN ~ (approximate trim keeps XADD O(1))
    scrape_interval_s: float = 5.0  # how often the replica monitor reads each /metrics
    queue_size: int = 10_000  # records buffered per sink before new ones are dropped
    batch_size: int = 512  # records written per sink write
    sink_retry_s: float = 1.0  # pause after a failed write before the next attempt
    bucket_s: float = 10.0  # width of a stats time bucket (window granularity)
    kv_warn: float = 0.85  # replica KV usage that raises a warning in /stats
    kv_critical: float = 0.95  # ... and a critical flag
    ttft_target_ms: float = 1000.0  # P99 TTFT target reported in /stats
    tpot_target_ms: float = 100.0  # P99 time-per-output-token target
    # When a replica comes up (models known), send it two tiny completions (max_tokens 1)
    # to learn whether it reports cached_tokens before any client request does.
    startup_probe: bool = True
    # /stats warns when one kind of hygiene finding puts at least this share of the last
    # hour's prompt tokens at risk (warnings only), and lists this many latest findings.
    hygiene_warn_share: float = 0.05
    hygiene_latest: int = 10

    def __post_init__(self) -> None:
        if self.redis_maxlen <= 0:
            raise ValueError("usage.redis_maxlen must be positive")
        if self.queue_size <= 0 or self.batch_size <= 0:
            raise ValueError("usage.queue_size and usage.batch_size must be positive")
        if self.scrape_interval_s <= 0 or self.bucket_s <= 0 or self.sink_retry_s < 0:
            raise ValueError("usage intervals must be positive")
        if not 0 < self.hygiene_warn_share <= 1 or not 1 <= self.hygiene_latest <= 1000:
            raise ValueError("usage.hygiene_warn_share must be in (0, 1] and "
                             "usage.hygiene_latest in [1, 1000]")
        if not 0 < self.kv_warn <= self.kv_critical <= 1:
            raise ValueError("usage.kv_warn/kv_critical must satisfy 0 < warn <= critical <= 1")
