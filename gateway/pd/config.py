"""Prefill/decode disaggregation knobs (`[pd]` in the TOML config, `GATEWAY_PD__*` in the
environment). They matter only when the fleet has a replica of role `prefill`
(`[[replicas]] role`, `gateway serve --prefill URL`); without one nothing reads them.

- `min_remote_prefill_tokens`: the decode replica is chosen first; when its predicted
  cached tokens leave fewer uncached prompt tokens than this, it computes the prompt itself
  (one leg): a transfer costs a second round trip and its own latency, which a short
  prefill does not repay.
- `reuse_decoder_kv`, `reuse_ttl_s`, `reuse_max_conversations`: turn two without
  re-prefill (issue 35): the decoder's returned `kv_transfer_params`, kept per conversation
  in a bounded map (`reuse_max_conversations` entries, least recently used first out) for
  `reuse_ttl_s`, which must stay below the engine's `decoder_kv_blocks_ttl` (480 s): an
  entry the gateway still holds must name blocks the decoder still keeps.
- `kv_recompute_threshold`: the engines' own (vLLM's default 64), for the accounting of
  what a prefill replica pulled back from a decoder (gateway.pd.accounting).
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's NIXL scheduler keeps a decoder's returned blocks about this long
# (`decoder_kv_blocks_ttl`): the gateway must forget them first.
ENGINE_DECODER_KV_TTL_S = 480.0


@dataclass(frozen=True, kw_only=True)
class PdConfig:
    # Fewer uncached prompt tokens than this on the chosen decode replica: it computes the
    # prompt itself (no prefill leg).
    min_remote_prefill_tokens: int = 256
    # Send the decoder's returned kv_transfer_params with the next turn's prefill leg when
    # the new prompt extends the last turn exactly (the prefill replica then pulls the
    # conversation back instead of recomputing it).
    reuse_decoder_kv: bool = False
    # How long a decoder's returned params are kept (below the engine's 480 s).
    reuse_ttl_s: float = 420.0
    # Conversations whose decoder params are kept at most (least recently used out first).
    reuse_max_conversations: int = 10_000
    # The engines' `kv_recompute_threshold` (vLLM's NIXL scheduler pulls a decoder's KV
    # only when at least this many tokens would come): how the gateway tells a prefill
    # leg's pulled tokens from its own cache hits (gateway.pd.accounting).
    kv_recompute_threshold: int = 64

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 0:
            raise ValueError("pd.min_remote_prefill_tokens must be >= 0")
        if not 0 < self.reuse_ttl_s < ENGINE_DECODER_KV_TTL_S:
            raise ValueError("pd.reuse_ttl_s must be above 0 and below the engine's "
                             f"decoder_kv_blocks_ttl ({ENGINE_DECODER_KV_TTL_S:g} s)")
        if self.kv_recompute_threshold < 0:
            raise ValueError("pd.kv_recompute_threshold must be >= 0")
        if self.reuse_max_conversations < 1:
            raise ValueError("pd.reuse_max_conversations must be >= 1")
