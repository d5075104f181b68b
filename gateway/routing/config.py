"""Routing knobs (`[routing]` in the TOML config, `GATEWAY_ROUTING_*` in the environment).

Units: sizes of the gateway's own index are in canonical *bytes* (`block_bytes`); sizes that
come from the engine are in *tokens*; costs are in *seconds* of estimated time to first
token, so load and cache terms add up on one scale (see `policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["prefix", "least_loaded", "round_robin", "session", "random"]


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    policy: PolicyName = "prefix"
    # Index granularity: about one vLLM block of 16 tokens at ~4 bytes/token.
    block_bytes: int = 64
    # vLLM's KV block size in tokens; the scrape of vllm:cache_config_info overrides it.
    engine_block_size: int = 16
    # Capacity assumed for a replica that does not report vllm:cache_config_info.
    default_capacity_tokens: int = 262_144
    # Token estimation: starting bytes/token before any usage was seen, EWMA weight of
    # each completed request, and how many block anchors (token positions) to remember.
    initial_bytes_per_token: float = 4.0
    ratio_ewma_alpha: float = 0.2
    anchor_capacity: int = 200_000
    # Cost model (seconds): prefill per uncached token (~33 us on an H100 for 8B), per
    # request the gateway has in flight on the replica (decode steps it shares), per
    # request the engine reports waiting that the gateway did not send itself.
    prefill_s_per_token: float = 33e-6
    in_flight_s: float = 0.004
    engine_waiting_s: float = 0.03
    # Session affinity prior, worth this many prefill tokens (~42 ms): a follow-up leaves
    # the replica holding its history only when the estimated TTFT elsewhere, re-prefill
    # of the lost history included, is lower by more than this. The estimate is made from
    # the gateway's own counts and does not see that the re-prefill also delays the
    # requests queued behind it there, nor that the history left behind is wasted cache.
    # On gateway-bench's default preset without session ids, side by side: at 64 tokens
    # 3-6% of follow-ups moved, at 640 2-5%, at 1280 2.4-2.7% with the TTFT tail ~30%
    # lower than at 640 (bench/RESULTS.md).
    session_prior_tokens: int = 1280
    # Placing a session (a new one, or one whose replica holds nothing of it that others
    # lack): its later turns will follow it, so each session bound to a replica (decayed
    # count, session_active_s time constant, sessions.py) costs session_s, and no replica
    # may take it above session_cap_factor x mean sessions, not rounded (bounded-load cap).
    session_s: float = 0.02
    session_cap_factor: float = 1.1
    session_active_s: float = 60.0
    # Placing, of replicas with equal session load the one whose index is emptier wins:
    # a full index costs fill_s more than an empty one.
    fill_s: float = 0.01
    # Implicit conversations remembered (requests without a session id, conversations.py),
    # prompt ends kept per conversation (a turn and its parallel siblings), and every how
    # many blocks a prompt is sampled to recognise forks (0: no forks).
    conversation_capacity: int = 65_536
    conversation_tips: int = 8
    conversation_sample_every: int = 16
    # Hot-spot guard: each request in flight above hot_spot_ratio x mean + hot_spot_slack
    # costs hot_spot_s more.
    hot_spot_ratio: float = 1.5
    hot_spot_slack: int = 2
    hot_spot_s: float = 0.05
    # Costs closer than this are a tie, broken at random so cold traffic spreads.
    tie_tolerance_s: float = 0.002
    seed: int = 0
    # Feedback (off with feedback = false): a replica that delivers less than predicted has
    # its index limit cut to feedback_shrink x what is indexed (floor: feedback_min_factor
    # x nominal); each accurate answer multiplies it back by feedback_recover (feedback.py).
    feedback: bool = True
    feedback_shrink: float = 0.8
    feedback_recover: float = 1.02
    feedback_min_factor: float = 0.001
    # Requests sent but never reported (lost callbacks) stop counting as queued work after
    # this long.
    pending_ttl_s: float = 300.0
    # Session -> replica bindings remembered (LRU).
    session_capacity: int = 65_536

    def __post_init__(self) -> None:
        if self.block_bytes < 8:
            raise ValueError("routing.block_bytes must be at least 8")
        if self.engine_block_size < 1:
            raise ValueError("routing.engine_block_size must be positive")
        if self.default_capacity_tokens < 0:
            raise ValueError("routing.default_capacity_tokens must not be negative")
        if self.initial_bytes_per_token <= 0:
            raise ValueError("routing.initial_bytes_per_token must be positive")
        if not 0 < self.ratio_ewma_alpha <= 1:
            raise ValueError("routing.ratio_ewma_alpha must be in (0, 1]")
        if self.session_cap_factor < 1:
            raise ValueError("routing.session_cap_factor must be at least 1")
        if self.session_active_s <= 0:
            raise ValueError("routing.session_active_s must be positive")
        if self.fill_s < 0:
            raise ValueError("routing.fill_s must not be negative")
        if self.conversation_capacity < 1 or self.conversation_tips < 1:
            raise ValueError("routing.conversation_capacity and conversation_tips must be positive")
        if self.conversation_sample_every < 0:
            raise ValueError("routing.conversation_sample_every must not be negative")
        if self.session_s < 0:
            raise ValueError("routing.session_s must not be negative")
        if not 0 < self.feedback_shrink <= 1 or self.feedback_recover < 1:
            raise ValueError("routing.feedback_shrink must be in (0, 1], feedback_recover >= 1")
