"""The router's bytes-per-token estimate is each tenant's own: what another tenant's
prompts tokenize to (dense code, sparse prose, another script) never moves the tokens the
gateway predicts or estimates for a key (pure: the Router driven as the request path
drives it, each tenant's view salted as proxy/tenancy.py salts it)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.proxy.tenancy import routing_salt, salted
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router

STATES = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
PREFIX = "You are the billing agent. Follow the billing rules exactly. " * 30


def view(tenant: str, text: str) -> dict[str, Any]:
    return salted({"messages": [{"role": "user", "content": text}]}, routing_salt(tenant, None))


def served(router: Router, tenant: str, text: str, tokens: int, now: float) -> None:
    plan = router.decide(view(tenant, text), "chat", "m", None, STATES, now, tenant=tenant)
    o = plan.outcome
    o.first_token_at, o.ok, o.prompt_tokens, o.cached_tokens = now, True, tokens, 0
    router.report(plan, now)


def bob_after(bytes_per_token: float) -> tuple[int, int]:
    """Bob's prediction and estimate for his prefix plus a new question, after alice sent
    30 prompts (far below the index's room) the engine counted at `bytes_per_token`."""
    # the index's room and its feedback are shared as the engines' caches are (another
    # tenant's traffic evicts a key's blocks in both): ample room, no feedback, so only
    # the estimate is compared here
    router = Router(RoutingConfig(seed=0, feedback=False))
    for i in range(30):
        text = f"Ticket {i}: " + "lorem ipsum dolor sit amet " * 40
        served(router, "alice", text, int(len(text) / bytes_per_token), float(i))
    served(router, "bob", PREFIX, 300, 40.0)
    plan = router.decide(view("bob", PREFIX + " Now: what is overdue this month?"), "chat",
                         "m", None, STATES, 41.0, tenant="bob")
    d = plan.decision
    return d.predicted_cached_tokens, d.estimated_prompt_tokens


@pytest.mark.parametrize("dense", [1.5, 2.5])
def test_another_tenants_tokenization_moves_nothing_a_key_is_told(dense: float) -> None:
    assert bob_after(dense) == bob_after(7.0)
    assert bob_after(dense)[0] > 0  # his own prefix is predicted
