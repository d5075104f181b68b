"""What one routing decision worked out (`RoutePlan`), carried from `Router.decide` to
`Router.report`, and vLLM's rule for how much of a matched prefix it serves (`engine_cap`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.routing.decision import Decision, Outcome

if TYPE_CHECKING:
    from gateway.events.tokenmode import TokenLookup


@dataclass(frozen=True, eq=False, slots=True)
class RoutePlan:
    """Everything a decision worked out; the request path fills in `outcome` and hands
    the plan back once, to `Router.report`."""

    decision: Decision
    model: str
    session: str | None
    conversation: int | None  # implicit conversation (no session id), conversations.py
    data: bytes  # canonical stream
    seed: int  # chain seed
    hashes: list[int]  # chained hashes of the full blocks of `data`
    matched: Mapping[str, int]  # leading blocks held, per candidate
    predicted: Mapping[str, int]  # predicted cached tokens, per candidate
    estimated_tokens: float  # prompt tokens (unrounded)
    tokens: TokenLookup | None = None  # token mode: exact tokens and blocks held, if live
    tenant: str | None = None  # the API key's tenant: its sessions and conversations
    # the body asks for a stream: its first byte is its first token, which ends its queued
    # prefill (ledger.py); a non-streamed answer's first byte is its last
    streamed: bool = False
    outcome: Outcome = field(default_factory=Outcome)  # filled in by the request path


def engine_cap(matched_tokens: float, prompt_tokens: float, block: int) -> int:
    """vLLM's hit: whole blocks, and at least the last prompt token recomputed."""
    hit = int(matched_tokens) // block * block
    cap = (max(1, round(prompt_tokens)) - 1) // block * block
    return max(0, min(hit, cap))
