"""Values that cross the seam between the request path and the router.

The app builds one `ReplicaState` per healthy candidate for each request; the router
answers with a `Decision`. Both are plain frozen values so the policy stays pure and
testable with tables.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a session or conversation left its replica (Decision.move):
# - unavailable: its replica is not among the candidates (unhealthy, removed, other model);
# - evicted: its replica no longer holds more of its history than another does, so it was
#   placed again like a new one;
# - load: its history is there, but the estimated time to first token elsewhere, the
#   re-prefill of that history included, is lower.
MOVE_REASONS = ("unavailable", "evicted", "load")


@dataclass(frozen=True, slots=True)
class ReplicaState:
    name: str
    in_flight: int  # requests this gateway has in flight on the replica
    engine_waiting: float = 0.0  # last scraped vllm:num_requests_waiting (0 when unknown)
    engine_running: float = 0.0  # last scraped vllm:num_requests_running (0 when unknown)


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str  # x-gateway-route: prefix | session | load | cold | round_robin | random | ...
    predicted_cached_tokens: int  # what the chosen replica should deliver
    best_available_tokens: int  # the most any candidate could have delivered
    estimated_prompt_tokens: int
    ranked: tuple[str, ...]  # every candidate, best first; ranked[0] == replica (retry order)
    # Set when a known session or conversation leaves the replica it was on: why
    # (MOVE_REASONS, a fixed set: it labels gateway_route_moves_total).
    move: str | None = None


class Outcome:
    """What happened to one routed request. The request path fills it in as it goes:
    `replica` on each attempt (a retry moves it), `first_token_at` when the first byte came
    back, usage and the reply at the end; then it reports the plan once (`Router.report`).
    Meanwhile the router reads it at each decision, so concurrent requests see where this one
    went and whether its prefill is still queued there."""

    __slots__ = ("arriving_from", "cached_tokens", "completion_tokens", "first_token_at", "ok",
                 "prompt_tokens", "replica", "reply_text")

    def __init__(self, replica: str = "") -> None:
        self.replica = replica
        self.first_token_at: float | None = None
        self.ok = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.reply_text: str | None = None  # a non-streamed answer's text, else None
        # Set by the router when it is sent: the first block of its prompt that the index
        # lists on its replica only because another request in flight there, without a
        # first token yet, added it (the engine may not hold it yet); None: no such block.
        self.arriving_from: int | None = None
