"""The router's call protocol for the token-mode benchmarks: decide (and so send), then
report the outcome with usage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.routing.decision import ReplicaState
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router


def decide(router: Router, body: Mapping[str, Any], model: str,
           candidates: Sequence[ReplicaState], now: float) -> RoutePlan:
    return router.decide(body, "chat", model, None, candidates, now)


def finish(router: Router, plan: RoutePlan, replica: str, prompt_tokens: int,
           cached_tokens: int, first_token_at: float, now: float, reply_text: str | None,
           completion_tokens: int | None) -> None:
    o = plan.outcome
    o.replica, o.first_token_at, o.ok = replica, first_token_at, True
    o.prompt_tokens, o.cached_tokens = prompt_tokens, cached_tokens
    o.completion_tokens, o.reply_text = completion_tokens, reply_text
    router.report(plan, now)
