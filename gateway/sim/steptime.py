"""How long one engine step takes (simulated seconds), contract section 8.

    step = t_base + max(t_weights + t_kv * decode_context_tokens, t_prefill)
    t_prefill = t_prefill_token * prefill_tokens + t_attention * sum(end^2 - start^2)

For a prefill chunk covering positions [start, end) the attention work grows with the
context, and summing ``end^2 - start^2`` over chunks makes a prompt split across steps cost
the same quadratic total as one unsplit prefill. Decodes that share a step with a prefill
chunk wait for it (the max). The result is multiplied by a jitter factor in
[1 - jitter, 1 + jitter] drawn by the caller from the seeded RNG.

Defaults: an 8B BF16 model on one H100 (batch-1 ITL ~6.3 ms, TTFT of 1k uncached tokens
~35-40 ms).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    t_base_s: float = 1.5e-3
    t_weights_s: float = 4.8e-3
    t_kv_token_s: float = 0.039e-6
    t_prefill_token_s: float = 33e-6
    t_attention_s: float = 0.0005e-6
    jitter: float = 0.03

    def duration(
        self, decode_context_tokens: int, prefill_tokens: int, attention_pairs: int, noise: float
    ) -> float:
        """``noise`` is uniform in [0, 1); it becomes a factor around 1 of width ``jitter``."""
        decode = self.t_weights_s + self.t_kv_token_s * decode_context_tokens
        prefill = self.t_prefill_token_s * prefill_tokens + self.t_attention_s * attention_pairs
        base = self.t_base_s + max(decode, prefill)
        return base * (1.0 + self.jitter * (2.0 * noise - 1.0))
