"""Driving a Router as the request path does: `decide` once, then fill the plan's outcome
and `report` once."""

from __future__ import annotations

from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router


def finish(
    router: Router, plan: RoutePlan, replica: str, prompt_tokens: int | None,
    cached_tokens: int | None, ok: bool, now: float, reply_text: str | None = None,
    completion_tokens: int | None = None,
) -> None:
    """The request went to `replica` (a retry, if it is not the decision's), got its first
    token and finished with this usage."""
    o = plan.outcome
    o.replica = replica
    if ok:
        o.first_token_at = now
    o.ok = ok
    o.prompt_tokens, o.cached_tokens = prompt_tokens, cached_tokens
    o.completion_tokens, o.reply_text = completion_tokens, reply_text
    router.report(plan, now)
