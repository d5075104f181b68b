"""The router's books: what it records of each request on a replica, pure (time is a
parameter, no I/O). The router (router.py) decides; this records what its decisions did.

Sent: the index records the whole prompt on that replica now, because vLLM registers a
request's blocks when it schedules it, not when it finishes, and the request's uncached
tokens count as queued prefill there (`pending`, summed in `queued`). The request is in
flight there (`live`) until it is reported, retried elsewhere or swept.

The plan carries an `Outcome` the request path fills in as it goes. Each decision first
settles the outcomes of requests still in flight (`settle`): a first token ends its queued
prefill. A non-streamed request's first byte is its last: its queued prefill ends once
its prefill has had time at the engine's rate since a scrape showed it begun
(`engine_began`: `prefilled_by`), or, without engine figures, at the cost model's prefill
time (`estimate_began`). A streamed one's ends at its first token only: begun is not
prefilled (vLLM prefills a begun prompt's chunks before any waiting one), and a replica
whose queued prefill dropped when a 114k-token prompt began there drew the requests that
then waited 10-15 s behind it (the Mooncake trace, issue 36).

A request that failed before its first token was never scheduled: the blocks it alone added
are dropped (`drop_own`: not those it found there, nor those another request in flight on
that replica shares with it). Once a first token came, vLLM has its blocks (an aborted
request's blocks stay cached): they are kept whatever happens next.

Completed: usage arrived (or the request failed). prompt_tokens teaches the bytes/token
ratio and sets an anchor; cached_tokens vs the prediction drives the feedback
(feedback.py), which moves the replica's index limit. With `reply_text` (the generated
answer, when the proxy has it) the reply's blocks are indexed too, as vLLM caches generated
tokens and the next turn of the conversation repeats them.

Bounds: `pending` and `live` hold the requests in flight, each removed at report, by a
retry, or by the sweep (`pending_ttl_s`), and `prefilled_by` those of `pending` begun;
every table has one entry per replica the router knows, removed with it (`forget`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gateway.routing.blocks import chain_hashes
from gateway.routing.config import RoutingConfig
from gateway.routing.estimate import TokenEstimator
from gateway.routing.facts import Dropped, Fact, Reply, Sent, Trust
from gateway.routing.feedback import Limits, Verdict, adjust, verdict
from gateway.routing.index import BlockIndex
from gateway.routing.normalize import END
from gateway.routing.plan import RoutePlan
from gateway.routing.sessions import ratio_key


class Ledger:
    def __init__(self, config: RoutingConfig,
                 publish: Callable[[Fact], None] | None = None) -> None:
        self.config = config
        # Shared state (gateway/shared/): every fact recorded here goes out through it.
        self.publish = publish
        self.estimator = TokenEstimator(
            config.initial_bytes_per_token, config.ratio_ewma_alpha,
            config.anchor_capacity, config.block_bytes,
        )
        self.index = BlockIndex(self.blocks_for(config.default_capacity_tokens))
        self.capacity_tokens: dict[str, int] = {}
        self.limits: dict[str, Limits] = {}
        self.engine_blocks: dict[str, int] = {}
        self.pending: dict[str, dict[RoutePlan, tuple[float, float]]] = {}
        # Requests in flight per replica (plan -> sent at), queued or past their first token;
        # bounded like `pending`: removed at report, by a retry, or by the sweep.
        self.live: dict[str, dict[RoutePlan, float]] = {}
        # the estimated prompt tokens the sweep took out of `live` per replica, summed:
        # Router.pinned_tokens counts them as still there (their end is never told)
        self.swept: dict[str, float] = {}
        self.queued: dict[str, float] = {}
        # when a non-streamed request in `pending` will have been prefilled (engine_began);
        # removed with its `pending` entry (unqueue)
        self.prefilled_by: dict[RoutePlan, float] = {}
        self._last_sweep = float("-inf")
        self.last_settle = 0.0

    def engine_block(self, replica: str) -> int:
        """The engine's KV block size on `replica` (its scrape's, else the configured)."""
        return self.engine_blocks.get(replica, self.config.engine_block_size)

    def forget(self, replica: str) -> None:
        """The replica left the fleet: its entry in every table goes."""
        for plan in self.pending.get(replica, ()):
            self.prefilled_by.pop(plan, None)
        for table in (self.limits, self.capacity_tokens, self.engine_blocks, self.pending,
                      self.queued, self.live, self.swept):
            table.pop(replica, None)

    # a request's life ---------------------------------------------------------------------
    def settle(self, now: float) -> None:
        """Apply what in-flight outcomes say since the last decision (O(requests in
        flight)): first tokens end queued prefill, and so does the time a begun
        non-streamed request's prefill takes (`prefilled_by`)."""
        self.last_settle = now
        done = self.prefilled_by
        for replica, pend in self.pending.items():
            for plan in [p for p in pend if p.outcome.first_token_at is not None
                         or done.get(p, math.inf) <= now]:
                self.unqueue(plan, replica)

    def sent(self, plan: RoutePlan, replica: str, now: float) -> None:
        """`plan` goes to `replica` (already known here) now."""
        uncached = max(0.0, plan.estimated_tokens - plan.predicted.get(replica, 0))
        self.unqueue(plan, replica)
        plan.outcome.arriving_from = self._arriving_from(plan, replica)
        self.pending.setdefault(replica, {})[plan] = (uncached, now)
        self.live.setdefault(replica, {})[plan] = now
        self.queued[replica] = self.queued.get(replica, 0.0) + uncached
        self.index.record(replica, plan.hashes, len(plan.hashes), plan.matched.get(replica, 0))
        if self.publish is not None:
            self.publish(Sent(replica, plan.hashes, plan.session, plan.conversation is not None,
                              plan.tenant))

    def moved(self, plan: RoutePlan, old: str) -> None:
        """`plan` leaves `old`, which never received it (a retry): nothing of it was
        scheduled there."""
        self.unqueue(plan, old)
        live = self.live.get(old)
        if live is not None:
            live.pop(plan, None)
        if old in self.limits:
            self.drop_own(plan, old)

    def reported(self, plan: RoutePlan) -> None:
        """The request is over: its outcome (replica, usage, reply) is final."""
        o = plan.outcome
        self.unqueue(plan, o.replica)
        self._completed(plan, o.replica, o.prompt_tokens, o.cached_tokens, o.ok,
                        o.reply_text, o.completion_tokens)
        live = self.live.get(o.replica)
        if live is not None:
            live.pop(plan, None)

    def engine_began(self, replica: str, asked_at: float, waiting: float | None,
                     s_per_token: float) -> None:
        """See Router.engine_began. O(n log n) in the requests queued there."""
        pend = self.pending.get(replica)
        if not pend:
            return
        before = sorted((item[1], i, plan) for i, (plan, item) in enumerate(pend.items())
                        if item[1] < asked_at)
        if not (math.isfinite(s_per_token) and s_per_token > 0):
            s_per_token = self.config.prefill_s_per_token  # no rate of the engine's
        # begun prompts are prefilled one after another (first come, first served, as
        # `estimate_began` sums them): each ends after those begun before it
        end = asked_at
        for _, _, plan in before[:began(len(before), waiting)]:
            if plan.outcome.first_token_at is not None:
                continue  # prefilled: its first token came (settled at the next read)
            known = self.prefilled_by.get(plan)
            if known is not None:  # a later scrape never pushes an end back
                end = max(end, known)
                continue
            end += pend[plan][0] * s_per_token
            if not plan.streamed:
                self.prefilled_by[plan] = end

    def estimate_began(self, replica: str, now: float) -> None:
        """See Router.estimate_began."""
        pend = self.pending.get(replica)
        if not pend:
            return
        per_token = self.config.prefill_s_per_token
        ahead = 0.0
        for plan, (tokens, at) in sorted(pend.items(), key=lambda kv: kv[1][1]):
            ahead += tokens
            if not plan.streamed and now - at >= ahead * per_token:
                self.unqueue(plan, replica)

    def _completed(
        self,
        plan: RoutePlan,
        replica: str,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        ok: bool,
        reply_text: str | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """Usage is known. `reply_text` / `completion_tokens` (optional) let the index
        follow the conversation into the generated answer, which vLLM caches too."""
        self.unqueue(plan, replica)
        if replica not in self.limits:
            return  # removed meanwhile
        est = self.estimator
        if not ok and prompt_tokens is None:
            if plan.outcome.first_token_at is None:
                # Never scheduled (rejected, cut before its first token): the blocks it
                # alone added at `sent` are not there.
                self.drop_own(plan, replica)
            return
        if prompt_tokens is not None and prompt_tokens > 0:
            key = ratio_key(plan.model, plan.tenant)
            est.observe(key, len(plan.data), prompt_tokens)
            est.set_anchor(plan.data, plan.hashes, prompt_tokens, est.ratio(key),
                           completion_tokens if ok else None)
            self.refresh_capacity(replica)
            if ok and reply_text:
                self._index_reply(plan, replica, prompt_tokens, reply_text, completion_tokens)
        if cached_tokens is not None and replica in plan.predicted and self.config.feedback:
            self.feedback(plan, replica, cached_tokens)

    # internals ----------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return int(tokens * self.estimator.mean_ratio() / self.config.block_bytes)

    def refresh_capacity(self, replica: str) -> None:
        tokens = self.capacity_tokens.get(replica, self.config.default_capacity_tokens)
        nominal = self.blocks_for(tokens)
        old = self.limits.get(replica, Limits(nominal, nominal))
        # Keep the feedback's trust fraction when the nominal size moves.
        fraction = old.limit / old.nominal if old.nominal else 1.0
        limits = Limits(nominal, max(1 if nominal else 0, int(nominal * fraction)))
        self.limits[replica] = limits
        self.index.set_capacity(replica, limits.limit)

    def unqueue(self, plan: RoutePlan, replica: str) -> None:
        pend = self.pending.get(replica)
        if pend is None:
            return
        item = pend.pop(plan, None)
        self.prefilled_by.pop(plan, None)
        if item is not None:
            left = self.queued.get(replica, 0.0) - item[0]
            self.queued[replica] = left if pend else 0.0  # no float drift when idle

    def sweep(self, now: float) -> None:
        """Forget queued work whose callbacks never came (at most once a second)."""
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        cutoff = now - self.config.pending_ttl_s
        for replica, pend in self.pending.items():
            for plan in [p for p, (_, at) in pend.items() if at < cutoff]:
                self.unqueue(plan, replica)
        for replica, live in self.live.items():
            for plan in [p for p, at in live.items() if at < cutoff]:
                del live[plan]
                self.swept[replica] = self.swept.get(replica, 0.0) + plan.estimated_tokens

    def feedback(self, plan: RoutePlan, replica: str, delivered: int,
                 outcome: Verdict | None = None) -> None:
        cfg = self.config
        if outcome is None:
            outcome = verdict(plan.predicted[replica], delivered, self.engine_block(replica))
        if outcome == "under" and self._arriving(plan, delivered):
            return  # not judged: the blocks it missed were on their way, not evicted
        short = False
        if outcome == "over":
            ratio = self.estimator.ratio(ratio_key(plan.model, plan.tenant))
            pos = self.estimator.bytes_for_tokens(plan.hashes, len(plan.hashes), delivered, ratio)
            held = min(len(plan.hashes), int(pos) // cfg.block_bytes)
            short = held > plan.matched.get(replica, 0)
        limits = adjust(self.limits[replica], outcome, self.index.size(replica), short,
                        cfg.feedback_shrink, cfg.feedback_recover, cfg.feedback_min_factor)
        self.limits[replica] = limits
        self.index.set_capacity(replica, limits.limit)
        if self.publish is not None and limits.nominal:
            self.publish(Trust(replica, min(1.0, limits.limit / limits.nominal)))

    def _arriving(self, plan: RoutePlan, delivered: int) -> bool:
        """Whether what `plan` was predicted but not delivered begins where blocks were
        still arriving when it was sent (`arriving_from`, set by `sent`), give or take
        one index block of estimate: the engine had not computed them yet (a queued
        prefill), or, on a P/D decode replica, not pulled them yet (the decode leg waits
        for its prefill leg on P, gateway.pd: seconds under load). No sign of eviction.
        Judging it cut the replica's limit to 0.8 x what it indexed then (little, early
        in a run), and on a P/D decode replica nothing restored it (two-leg answers do not
        judge its predictions): its index forgot the conversations it held and
        follow-ups moved between decode replicas (bench/results/pd.md)."""
        start = plan.outcome.arriving_from
        if start is None:
            return False
        ratio = self.estimator.ratio(ratio_key(plan.model, plan.tenant))
        pos = self.estimator.bytes_for_tokens(plan.hashes, len(plan.hashes), delivered, ratio)
        held = min(len(plan.hashes), int(pos) // self.config.block_bytes)
        return held + 1 >= start

    def _arriving_from(self, plan: RoutePlan, replica: str) -> int | None:
        """The first block of `plan`'s prompt that a request in flight on `replica` with
        no first token yet added to the index there (past what that request found there,
        up to what it shares with `plan`); None when none did. O(requests in flight
        there), each a bisection of the two chains."""
        first: int | None = None
        for other in self.live.get(replica, {}):
            if other is plan or other.outcome.first_token_at is not None:
                continue
            found = other.matched.get(replica, 0)
            if shared_prefix(plan.hashes, other.hashes) > found:
                first = found if first is None else min(first, found)
        return first

    def drop_own(self, plan: RoutePlan, replica: str) -> None:
        """Drop the blocks `plan` alone added on `replica`: past those it found there and
        past those any other request in flight there shares with it."""
        keep = plan.matched.get(replica, 0)
        hashes = plan.hashes
        for other in self.live.get(replica, {}):
            if other is not plan and keep < len(hashes):
                keep = max(keep, shared_prefix(hashes, other.hashes))
        if keep < len(hashes):
            self._drop(replica, hashes, keep)

    def _drop(self, replica: str, hashes: Sequence[int], keep: int) -> None:
        self.index.drop_from(replica, hashes, keep)
        if self.publish is not None:
            self.publish(Dropped(replica, hashes, keep))

    def _index_reply(self, plan: RoutePlan, replica: str, prompt_tokens: int,
                     reply_text: str, completion_tokens: int | None) -> None:
        """Extend the chain through the answer as the next turn will render it."""
        block = self.config.block_bytes
        full = len(plan.hashes)
        extended = plan.data + reply_text.encode("utf-8", "surrogatepass") + END.encode()
        parent = plan.hashes[-1] if full else plan.seed
        hashes = plan.hashes + chain_hashes(extended[full * block :], parent, block)
        self.index.record(replica, hashes, len(hashes), full)
        if self.publish is not None:
            self.publish(Reply(replica, hashes, full))
        ratio = self.estimator.ratio(ratio_key(plan.model, plan.tenant))
        generated = (completion_tokens if completion_tokens is not None
                     else (len(extended) - len(plan.data)) / ratio)
        # The reply's last generated token never had its KV computed: the engine holds
        # prompt + generated - 1 tokens of this conversation.
        self.estimator.set_anchor(extended, hashes, prompt_tokens + generated - 1, ratio)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chains share. Chained hashes: equal at i means equal up to i, so
    the matches form a prefix and bisection finds its end."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def began(sent_before: int, waiting: float | None) -> int:
    """Of `sent_before` requests sent to a replica before a scrape that shows `waiting`
    requests in its engine's queue, how many have left that queue: all but the `waiting`
    youngest (vLLM admits first come, first served; other clients' waiting requests only
    make the count lower, never wrongly higher). None or an odd value: none known."""
    if waiting is None or not math.isfinite(waiting) or waiting < 0:
        return 0
    return max(0, sent_before - int(min(waiting, sent_before)))
