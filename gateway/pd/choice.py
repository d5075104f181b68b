"""Whether a request takes two legs, and to which prefill replicas (pure).

Decode first (llm-d's order): the decode replica D is the router's ordinary decision among
the `decode` and `both` replicas (prefix index, load, session affinity and implicit
conversations keep a conversation's D). Then:

    no healthy prefill replica serving the model       D alone   ("no_prefill")
    D's predicted cached tokens leave fewer than        D alone   ("cached")
      `min_remote_prefill_tokens` of the prompt uncached
    otherwise                                           P, then D ("remote")

P is ranked by the router's preview over the prefill replicas (their caches are what
saves the prefill, weighed against their load); the ranking is the order in which a
prefill leg that was not delivered tries the next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Why = Literal["no_prefill", "cached", "remote"]


@dataclass(frozen=True, slots=True)
class Legs:
    prefill: tuple[str, ...]  # prefill replicas, best first; empty: D serves alone
    why: Why
    uncached_tokens: int  # of the prompt, on D as predicted

    @property
    def two(self) -> bool:
        return bool(self.prefill)


def choose_legs(*, prompt_tokens: int, decode_cached: int, min_remote_prefill_tokens: int,
                prefill_ranked: Sequence[str]) -> Legs:
    """The legs of one request: `prompt_tokens` estimated, `decode_cached` predicted on the
    chosen D, `prefill_ranked` the healthy prefill replicas best first."""
    uncached = max(0, prompt_tokens - decode_cached)
    if not prefill_ranked:
        return Legs((), "no_prefill", uncached)
    if uncached < min_remote_prefill_tokens:
        return Legs((), "cached", uncached)
    return Legs(tuple(prefill_ranked), "remote", uncached)
