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
