"""How far the index may trust a replica: its effective capacity, corrected by what it delivers.

Each replica has a nominal capacity (its KV tokens from `vllm:cache_config_info`, or the
configured default) converted to index blocks, and an effective limit the index is held to:

- delivered at least two engine blocks *less* than predicted: the replica evicted blocks the
  index still lists (smaller real cache, other traffic, a template we render differently), so
  the limit becomes `feedback_shrink` x min(limit, blocks indexed now), never below
  `feedback_min_factor` x nominal: the oldest entries go first, as they do in the engine;
- delivered *more* than predicted beyond what the index matched: the index evicted what the
  engine still holds: the limit grows by 25% (up to nominal);
- otherwise the limit recovers by `feedback_recover` per response (up to nominal), so a
  transient miss (a burst of other traffic) does not shrink the index for good.

Not judged (Ledger._arriving): a shortfall that begins at blocks another request in flight
on that replica, without a first token yet, had added to the index when this one was sent:
the engine had not computed them yet, or a P/D decode replica not pulled them yet.

The request's own chain is not dropped on a miss: the engine re-computed those blocks and
registered them at scheduling, so after this request it does hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["under", "over", "ok"]


@dataclass(frozen=True, slots=True)
class Limits:
    nominal: int  # index blocks the replica's KV capacity is worth
    limit: int  # index blocks the index may hold for it now


def verdict(predicted: int, delivered: int, engine_block: int) -> Verdict:
    if predicted - delivered >= 2 * engine_block:
        return "under"
    if delivered - predicted >= engine_block:
        return "over"
    return "ok"


def adjust(
    limits: Limits,
    outcome: Verdict,
    indexed_now: int,
    index_was_short: bool,
    shrink: float,
    recover: float,
    min_factor: float,
) -> Limits:
    """The replica's next limit after one response (see the module docstring)."""
    floor = max(1, int(limits.nominal * min_factor))
    if outcome == "under":
        limit = int(min(limits.limit, indexed_now) * shrink)
    elif outcome == "over" and index_was_short:
        limit = int(limits.limit * 1.25) + 1
    else:
        limit = int(limits.limit * recover) + 1
    return Limits(limits.nominal, max(floor, min(limits.nominal, limit)))
