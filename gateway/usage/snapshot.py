"""What one scrape of a replica's `/metrics` tells the gateway (pure value).

Produced by the scraper from vLLM's Prometheus text (current names, with fallbacks to the
deprecated `vllm:gpu_*` ones) or from llama.cpp's; every field is `None` when the replica
does not export it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    ts: float  # when the scrape completed (unix seconds)
    kv_cache_usage: float | None  # 0..1 (vllm:kv_cache_usage_perc / vllm:gpu_cache_usage_perc)
    num_requests_running: float | None
    num_requests_waiting: float | None
    prefix_cache_queries_total: float | None  # tokens
    prefix_cache_hits_total: float | None  # tokens
    prompt_tokens_total: float | None
    generation_tokens_total: float | None
    num_gpu_blocks: int | None  # from vllm:cache_config_info
    block_size: int | None  # from vllm:cache_config_info
    # When the engine's server process started (unix seconds; prometheus_client's process
    # collector, which vLLM exports): a new value means the replica restarted.
    process_start_time_seconds: float | None = None
    # vLLM's own split of its prompt tokens (`vllm:prompt_tokens_by_source`, since the
    # engine started): cached in its local prefix cache, and loaded from a peer (a P/D
    # transfer; on a prefill replica, what it pulled back from a decoder)
    local_cache_hit_tokens_total: float | None = None
    external_kv_tokens_total: float | None = None

    @property
    def capacity_tokens(self) -> int | None:
        """KV capacity in tokens, when the replica reports its cache config."""
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size
