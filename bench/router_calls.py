"""The router's call protocol for the token-mode benchmarks: decide-and-send, then finish
with usage. Follows whichever protocol the router has (`route` + `sent` + `first_token` +
`completed`, or `decide` + `report`), like tests/kv_driver.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.routing.decision import ReplicaState
from gateway.routing.router import RoutePlan, Router


def decide(router: Router, body: Mapping[str, Any], model: str,
           candidates: Sequence[ReplicaState], now: float) -> RoutePlan:
    one_call = getattr(router, "decide", None)
    if one_call is not None:
        plan: RoutePlan = one_call(body, "chat", model, None, candidates, now)
        return plan
    plan = router.route(body, "chat", model, None, candidates, now)
    router.sent(plan, plan.decision.replica, now)
    return plan


def finish(router: Router, plan: RoutePlan, replica: str, prompt_tokens: int,
           cached_tokens: int, first_token_at: float, now: float, reply_text: str | None,
           completion_tokens: int | None) -> None:
    if hasattr(router, "report"):
        o: Any = getattr(plan, "outcome")  # noqa: B009
        o.replica, o.first_token_at, o.ok = replica, first_token_at, True
        o.prompt_tokens, o.cached_tokens = prompt_tokens, cached_tokens
        o.completion_tokens, o.reply_text = completion_tokens, reply_text
        router.report(plan, now)
        return
    router.first_token(plan, replica, first_token_at)
    router.completed(plan, replica, prompt_tokens, cached_tokens, True, now, reply_text,
                     completion_tokens)
