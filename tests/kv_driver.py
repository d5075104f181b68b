"""Driving a Router the way the request path does, for the token-mode tests: decide and
send, then finish with usage. Written against the router's call protocol of the time
(`route` + `sent` + `first_token` + `completed`, or `decide` + `report` where the router
has them), so the tests follow the protocol without caring which one it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.routing.decision import ReplicaState
from gateway.routing.router import RoutePlan, Router


def decide(router: Router, body: Mapping[str, Any], model: str,
           candidates: Sequence[ReplicaState], now: float, pin: str | None = None
           ) -> RoutePlan:
    """Rank and send: to `pin` when given, else to the decision's replica."""
    one_call = getattr(router, "decide", None)
    if one_call is not None:
        plan: RoutePlan = one_call(body, "chat", model, None, candidates, now, pin=pin)
        return plan
    plan = router.route(body, "chat", model, None, candidates, now)
    router.sent(plan, pin or plan.decision.replica, now)
    return plan


def finish(router: Router, plan: RoutePlan, replica: str, prompt_tokens: int,
           cached_tokens: int, now: float, reply_text: str | None = None,
           completion_tokens: int | None = None) -> None:
    if hasattr(router, "report"):
        o: Any = getattr(plan, "outcome")  # noqa: B009
        o.replica, o.first_token_at, o.ok = replica, now, True
        o.prompt_tokens, o.cached_tokens = prompt_tokens, cached_tokens
        o.completion_tokens, o.reply_text = completion_tokens, reply_text
        router.report(plan, now)  # type: ignore[attr-defined]
        return
    router.first_token(plan, replica, now)
    router.completed(plan, replica, prompt_tokens, cached_tokens, True, now, reply_text,
                     completion_tokens)
