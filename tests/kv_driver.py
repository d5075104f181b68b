"""Driving a Router the way the request path does, for the token-mode tests: decide (and so
send), then finish with usage (tests/routing_driver.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.routing.decision import ReplicaState
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from tests import routing_driver


def decide(router: Router, body: Mapping[str, Any], model: str,
           candidates: Sequence[ReplicaState], now: float, pin: str | None = None
           ) -> RoutePlan:
    """Rank and send: to `pin` when given, else to the decision's replica."""
    return router.decide(body, "chat", model, None, candidates, now, pin=pin)


def finish(router: Router, plan: RoutePlan, replica: str, prompt_tokens: int,
           cached_tokens: int, now: float, reply_text: str | None = None,
           completion_tokens: int | None = None) -> None:
    routing_driver.finish(router, plan, replica, prompt_tokens, cached_tokens, True, now,
                          reply_text, completion_tokens)
