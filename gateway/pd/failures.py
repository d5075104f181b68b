"""What a failed leg allows (pure), beside the single-replica table
(gateway.upstream.failure), whose classes it reads. A request reaches each engine at most
once per leg, and nothing is sent again once a byte reached the client.

    leg      what happened                               next
    prefill  not delivered (refused, DNS, connect        the next prefill replica; none
               timeout)                                    left: D alone
    prefill  pool busy, timeout, broken, 4xx, 5xx,       D alone: it computes the prompt
               an answer without kv_transfer_params        itself (nothing was sent to it)
    decode   not delivered                               the next decode replica, with the
                                                           same params (the ordinary retry)
    decode   5xx, or broken before any answer: the pull  P alone, a whole request: it holds
               failed or D gave up, no byte reached the    the prompt's KV (vLLM's
               client                                      kv_load_failure_policy "fail")
    decode   4xx, timeout, pool busy                     as for one replica (relayed, 504,
                                                           503)

After a decode leg's first byte reached the client nothing changes: a stream cut there
ends with an error event, as for one replica.
"""

from __future__ import annotations

from typing import Literal

from gateway.upstream.failure import Happened

AfterPrefill = Literal["next_prefill", "decode_alone"]


def after_prefill(what: Happened | Literal["no_params"]) -> AfterPrefill:
    """The prefill leg failed with `what`: try the next P, or let D compute alone."""
    return "next_prefill" if what == "not_delivered" else "decode_alone"


def prefill_instead(what: Happened) -> bool:
    """The decode leg failed with `what` before anything reached the client: P, which
    holds the prompt's KV, answers the whole request instead."""
    return what in ("server_error", "broken")


class PullFailed(Exception):
    """The decode leg failed as `prefill_instead` says, before anything reached the client
    (raised by the request path's try on D, caught by gateway.pd.path)."""

    def __init__(self, replica: str, what: Happened) -> None:
        super().__init__(f"decode leg on {replica} failed: {what}")
        self.replica = replica
        self.what = what
