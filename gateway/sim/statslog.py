"""vLLM's periodic engine stats line (``LoggingStatLogger``), as a pure formatter.

    Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
    Running: R reqs, Waiting: W reqs, GPU KV cache usage: U%, Prefix cache hit rate: P%

Prompt throughput counts computed (non-cached) prompt tokens, as vLLM 0.33 does.
Throughputs are per simulated second over the interval; the hit rate comes from the
sliding ``HitRateWindow``. The replica's name is prefixed so N replicas in one log can be
told apart.
"""

from __future__ import annotations


def stats_line(
    name: str,
    prompt_tokens: int,
    generation_tokens: int,
    elapsed_s: float,
    running: int,
    waiting: int,
    kv_usage: float,
    hit_rate: float,
) -> str:
    elapsed = max(elapsed_s, 1e-9)
    return (
        f"{name} Engine 000: Avg prompt throughput: {prompt_tokens / elapsed:.1f} tokens/s, "
        f"Avg generation throughput: {generation_tokens / elapsed:.1f} tokens/s, "
        f"Running: {running} reqs, Waiting: {waiting} reqs, "
        f"GPU KV cache usage: {kv_usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%"
    )
