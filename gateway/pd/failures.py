"""What a failed leg allows (pure), beside the single-replica table
(gateway.upstream.failure), whose classes it reads. A request reaches each engine at most
once per leg, and nothing is sent again once a byte reached the client.

    leg      what happened                               next
    prefill  not delivered (refused, DNS, connect        the next prefill replica; none
               timeout)                                    left: D alone
    prefill  pool busy, timeout, broken, 4xx, 5xx,       D alone: it computes the prompt
               an answer without kv_transfer_params        itself (nothing was sent to it)
    decode   not delivered                               the next decode replica, with the
                                                           same params (the ordinary retry);
                                                           none left: P alone, as below
    decode   5xx, or broken before any answer: the pull  P alone, a whole request: it holds
               failed or D gave up, no byte reached the    the prompt's KV (vLLM's
               client (before its head, or a JSON answer   kv_load_failure_policy "fail")
               cut short: the relay reads it whole first)
    decode   4xx, timeout, pool busy                     as for one replica (relayed, 504,
                                                           503)

After a decode leg's first byte reached the client nothing changes: a stream cut there
ends with an error event, as for one replica.

Why P may answer the whole request after its prefill leg ("a request reaches each engine
at most once; retry elsewhere only what provably never arrived"): the prefill leg is a
different request that P finished (one token, `max_tokens` 1, its answer read whole and
never relayed); the client's request, which generates the answer, reached no engine:
every decode leg provably never arrived (not delivered), or D failed before generating
anything the client saw (5xx, broken before its head). So the whole request is P's first
delivery of it, and it is sent to P once. A decode leg that may have reached D and still
be running (timeout, pool busy) is never piled onto P.
"""

from __future__ import annotations

from typing import Literal

from gateway.upstream.failure import Happened

AfterPrefill = Literal["next_prefill", "decode_alone"]


def after_prefill(what: Happened | Literal["no_params"]) -> AfterPrefill:
    """The prefill leg failed with `what`: try the next P, or let D compute alone."""
    return "next_prefill" if what == "not_delivered" else "decode_alone"


def prefill_instead(what: Happened, *, last: bool = False) -> bool:
    """The decode leg failed with `what` before anything reached the client: P, which
    holds the prompt's KV, answers the whole request instead. `last`: no other decode
    replica is left to try; a leg not delivered anywhere is then P's too (below)."""
    return what in ("server_error", "broken") or (last and what == "not_delivered")


class PullFailed(Exception):
    """The decode leg failed as `prefill_instead` says, before anything reached the client
    (raised by the request path's try on D, caught by gateway.proxy.pd_path)."""

    def __init__(self, replica: str, what: Happened) -> None:
        super().__init__(f"decode leg on {replica} failed: {what}")
        self.replica = replica
        self.what = what
