"""`[tokens]`: token mode and KV events, per model.

Token mode is on for the models named in `models`; each maps to where its tokenizer and
chat template come from: a model directory (`tokenizer.json`, and `chat_template.jinja`
or `tokenizer_config.json`: what vLLM loads) or `sim`, the simulator's own ChatML template
and tokenizer. Every replica serving such a model is subscribed to its KV events, found
through `GET /kv_event_sources` or set per replica (`[[replicas]] kv_events_endpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SIM = "sim"  # models value: the simulator's renderer


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenSettings:
    # served model name -> model directory, or "sim"; empty: token mode off
    models: Mapping[str, str] = field(default_factory=dict)
    block_size: int = 16  # the replicas' --block-size (vLLM's default is 16)
    discover: bool = True  # ask each replica GET /kv_event_sources
    discover_interval_s: float = 30.0  # retry a replica that publishes nothing this often
    replay_timeout_s: float = 2.0  # catch-up from a replica's replay socket, at most
    predict_ttl_s: float = 2.0  # a routed prefix counts as held until events confirm it
    stale_after_s: float = 10.0  # sent requests with no event this long -> text mode
    stale_requests: int = 3  # ... once this many of them are overdue
    tokenizer_cache_pieces: int = 65536  # tokenized turns kept per model (LRU)
    parity_check: bool = True  # compare with each replica's /tokenize at start-up
    parity_required: bool = True  # a replica whose tokens differ stays in text mode

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.tokenizer_cache_pieces <= 0 or self.stale_requests < 1:
            raise ValueError("tokens.block_size, tokenizer_cache_pieces and stale_requests "
                             "must be positive")
        for name in ("discover_interval_s", "replay_timeout_s", "predict_ttl_s",
                     "stale_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"tokens.{name} must be positive")
        for model, where in self.models.items():
            if not model or not where:
                raise ValueError("tokens.models: every entry needs a model name and a "
                                 "directory (or 'sim')")

    @property
    def enabled(self) -> bool:
        return bool(self.models)
