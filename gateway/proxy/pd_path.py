"""The P/D request path (I/O): it sequences the pure parts (choice.py, legs.py,
failures.py in gateway.pd) around the request path's own tries (gateway.proxy.handler); it lives
in gateway.proxy because it drives the proxy's relay and flow (gateway.pd stays pure of them).

    D = the router's decision (already made, among `decode`/`both` replicas)
    legs = choose_legs(...)                  one leg: the caller goes on as today
    prefill leg on P (ranked; not delivered or at admission's cap: the next P), read
        whole, never relayed
        failed, or no kv_transfer_params: D alone (the caller goes on as today)
    the router learns the prompt's blocks on P too (both hold the prefix afterwards)
    decode leg on D with P's params, relayed to the client as a single replica's answer
        failed before a byte (PullFailed): P answers the whole request instead
    `[pd] reuse_decoder_kv`: the conversation's last decoder params go with the prefill
    leg when its prompt extends that turn exactly (pullback.py); an answer's own params
    (whole, or a stream's final chunk: answer.py) are kept for the next turn (`answered`);
    in token mode the decode leg asks D's token ids (`return_token_ids`, stripped from
    the client's answer unless it asked itself: gateway.pd.tokenids), the check's input

Accounting (on the request's Exchange, into its usage record): `prefill_replica`,
`transferred_tokens` (what P offered D), `cached_from` ("prefill": vLLM >= 0.32 reports
P's cached tokens as D's, so the prediction recorded is P's; "decoder_kv": P was sent the
decoder's params of the last turn, so those tokens were pulled back from D). The decode leg's cached
count does not judge D's prediction (RequestFlow.finish leaves it out of the feedback); P's
own report judges P's (`_account`, gateway.pd.accounting: `prefill_cached_tokens`, and on
decoder_kv turns `pulled_tokens`, which are neither P's hits nor misses).

Endpoints: chat, completions, Responses and Messages (vLLM 0.32 takes kv_transfer_params on
each: gateway.pd.legs says how each prefill leg differs); a Responses request naming a
`previous_response_id` stays one leg. `[pd] reuse_decoder_kv` keeps and sends a decoder's
params on chat and completions only (`REUSE_ENDPOINTS`).

`gateway epp` has no P/D: llm-d runs the decode leg's sidecar on the decode pod instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.pd.accounting import prefill_verdict, pull_level, read_prefill, reported_cached
from gateway.pd.choice import Legs, choose_legs
from gateway.pd.config import PdConfig
from gateway.pd.failures import PullFailed, after_prefill
from gateway.pd.legs import (
    ENDPOINTS,
    answer_params,
    decode_body,
    prefill_body,
    transferred_tokens,
)
from gateway.pd.metrics import PdMetrics
from gateway.pd.pullback import PullBack
from gateway.pd.stats import Alone, LegFailure, PdStats
from gateway.pd.tokenids import asks_ids
from gateway.proxy.asgi import Headers
from gateway.proxy.exchange import Exchange
from gateway.proxy.flow import Prepared, RequestFlow, Turn
from gateway.proxy.headers import repredicted
from gateway.proxy.relay import upstream_request_headers
from gateway.replicas.fleet import Fleet, Replica
from gateway.replicas.monitor import FleetMonitor
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.upstream.counters import UpstreamCounters
from gateway.upstream.errors import UpstreamError
from gateway.upstream.failure import answered, happened, verdict
from gateway.upstream.seam import Timeouts, Upstream, UpstreamResponse
from gateway.usage.extract import parse_answer

# `[pd] reuse_decoder_kv` keeps and sends a decoder's params on these only: a Messages
# stream carries none (vLLM 0.32), and the gateway cannot check that a Responses or
# Messages turn's rendering of the last answer is the bytes D's KV holds
REUSE_ENDPOINTS = ("chat", "completions")

# The request path's tries on a ranked list of replicas with a body (pull: a decode leg,
# whose failure before a byte raises PullFailed instead of answering the client).
Attempts = Callable[[bytes, tuple[str, ...], bool], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Prefilled:
    replica: str
    params: dict[str, Any]  # P's kv_transfer_params, verbatim
    prompt_tokens: int | None
    cached_tokens: int | None  # P's own report: its cache hits plus any pulled
    # the server the leg ran on: a new address under the same name while it ran is another
    # server (Fleet.current), which holds none of this prompt
    instance: Replica


class PdPath:
    def __init__(self, *, config: PdConfig, fleet: Fleet, router: Router, flow: RequestFlow,
                 upstream: Upstream, monitor: FleetMonitor, counters: UpstreamCounters,
                 timeouts: Timeouts, clock: Callable[[], float],
                 metrics: PdMetrics | None = None, prefill_cap: int = 0) -> None:
        self.config = config
        self.fleet = fleet
        self.router = router
        self.flow = flow
        self.upstream = upstream
        self.monitor = monitor
        self.counters = counters
        self.timeouts = timeouts
        self.clock = clock
        # admission's `replica_max_in_flight` (0: none) on prefill replicas too: the gate
        # admits and waits on decode replicas only, so a P at the cap is passed over here
        # (the next P, or D computes alone) rather than given one leg more
        self.prefill_cap = prefill_cap
        self.stats = PdStats(metrics)
        self.pullback = PullBack(config, fleet, router)

    def legs(self, turn: Turn, prep: Prepared) -> tuple[Legs, RoutePlan | None] | None:
        """The request's legs and the router's preview that ranked the prefill replicas
        (P's predicted cached tokens; None on one leg); None
        when P/D does not apply (no prefill replica in the fleet, another endpoint, a
        request pinned to its replica)."""
        plan = turn.plan
        if (plan is None or prep.endpoint not in ENDPOINTS or plan.decision.reason == "response"
                or prep.body.get("previous_response_id") is not None
                or not self.fleet.has_prefill()):
            # a request continuing a stored response stays one leg even when the gateway
            # does not know its creator: P holds no stored response (its legs are sent
            # with store false), and the router saw only the new items of its prompt
            return None
        decision = plan.decision
        prefill = self.fleet.prefill_candidates(prep.inbound.model)
        legs = choose_legs(prompt_tokens=decision.estimated_prompt_tokens,
                           decode_cached=decision.predicted_cached_tokens,
                           min_remote_prefill_tokens=self.config.min_remote_prefill_tokens,
                           prefill_ranked=[r.name for r in prefill])
        if not legs.two:
            return legs, None
        # P by its prefix and load: the router's ranking of the prefill replicas, counted
        # as sent nowhere (`holds` records the prompt on the P that computed it)
        ranked = self.router.preview(prep.view, prep.kind, prep.inbound.model, None,
                                     [r.state() for r in prefill], self.clock(),
                                     tenant=turn.ex.tenant, answers=False)
        return Legs(ranked.decision.ranked, legs.why, legs.uncached_tokens), ranked

    async def serve(self, turn: Turn, prep: Prepared, payload: bytes, headers: Headers,
                    attempts: Attempts) -> bool:
        """Serve the request in two legs when its choice says so; False when it is one
        leg (the caller sends it to D as today, prefill failures included). `payload`:
        the request as one replica gets it (for P alone)."""
        found = self.legs(turn, prep)
        if found is None:
            return False
        legs, preview = found
        self.stats.chose(legs.why)
        if not legs.two:
            return False
        ex, plan = turn.ex, turn.plan
        assert plan is not None
        # D pulls the prompt rather than computing it: not D's queued prefill
        self.router.prefilled_elsewhere(plan)
        pulled = None
        if prep.endpoint in REUSE_ENDPOINTS:  # docs/deployment/pd.md says why only these
            pulled = self.pullback.take(plan, self.clock(), prep.body, prep.kind)
            if self.pullback.enabled:
                self.stats.reused(pulled is not None)
        pre = await self._prefill(ex, legs.prefill,
                                  orjson.dumps(prefill_body(prep.body, pulled, prep.endpoint)))
        if not isinstance(pre, Prefilled):
            self.stats.decode_alone(pre)
            return False
        moved = transferred_tokens(pre.params, pre.prompt_tokens)
        self.stats.transferred(moved)
        ex.prefill_replica, ex.transferred_tokens, ex.cached_from = (
            pre.replica, moved, "prefill" if pulled is None else "decoder_kv")
        if preview is not None:
            ex.predicted = preview.predicted.get(pre.replica, ex.predicted)
        self._account(ex, pre, preview, pulled)
        if self.fleet.current(pre.instance):
            self.router.holds(pre.replica, plan, self.clock())
        if not ex.withheld:
            headers[:] = repredicted(headers, ex.route or "", ex.predicted, ex.findings)
            headers.append((b"x-gateway-prefill", pre.replica.encode()))
        decode = decode_body(prep.body, pre.params)
        if (prep.endpoint in REUSE_ENDPOINTS and self.pullback.token_mode(plan)
                and asks_ids(prep.body)):
            # token mode checks the next turn by D's ids: asked here, hidden from the client
            decode["return_token_ids"] = turn.ids_added = True
        try:
            await attempts(orjson.dumps(decode), plan.decision.ranked, True)
            self.stats.decoded()
        except PullFailed as failed:
            turn.ids_added = False
            self.stats.pull_failed(failed.what)
            # P holds the prompt's KV: it answers the whole request, as sent to one replica
            self.flow.moved(turn, pre.replica)
            await attempts(payload, (pre.replica,), False)
        return True

    def collects(self, endpoint: str) -> bool:
        """Whether a stream's text is collected (gateway.pd.answer): the next turn's
        check needs it, and only `[pd] reuse_decoder_kv` keeps anything for one."""
        return self.pullback.enabled and endpoint in REUSE_ENDPOINTS

    def reads_ids(self, turn: Turn, endpoint: str) -> bool:
        """Whether an answer's token ids are read (gateway.pd.tokenids): token mode's
        check of the next turn needs them."""
        return (self.collects(endpoint) and turn.plan is not None
                and self.pullback.token_mode(turn.plan))

    def answered(self, turn: Turn, prep: Prepared) -> None:
        """The request was answered: keep a decoder's returned params for the next turn
        (`[pd] reuse_decoder_kv`; a 200 from a decode replica, whole or streamed, whose
        answer carried no reasoning: D's KV holds the thinking, the next turn sends the
        content alone, so its bytes cannot be checked against D's tokens)."""
        ex, plan = turn.ex, turn.plan
        out = ex.outcome
        if (not self.pullback.enabled or plan is None or ex.status != 200
                or out.kv_params is None or ex.replica is None or out.reasoned
                or prep.endpoint not in REUSE_ENDPOINTS):
            return
        replica = turn.replica  # the server that answered, not whoever has its name now
        if replica is None or not self.fleet.current(replica) or replica.prefill_only:
            return  # replaced or gone while it ran; or P answered alone: no decoder's params
        if self.pullback.remember(plan, prep.kind, ex.replica, out.reply_text, out.kv_params,
                                  self.clock(), out.token_ids):
            self.stats.kept()

    def _account(self, ex: Exchange, pre: Prefilled, preview: RoutePlan | None,
                 pulled: dict[str, Any] | None) -> None:
        """P's own report (gateway.pd.accounting): its cached tokens and, on a turn sent
        the decoder's params, those pulled back into the record; P's prediction judged by
        what the report can tell, once (the decode leg's copy of it judges nothing)."""
        if pre.cached_tokens is None:
            return  # an engine without prompt_tokens_details: nothing to read or judge
        predicted = None if preview is None else preview.predicted.get(pre.replica)
        block = self.router.engine_block(pre.replica)
        level = None if pulled is None else pull_level(transferred_tokens(pulled, None),
                                                       pre.prompt_tokens)
        report = read_prefill(pre.cached_tokens, predicted, sent=pulled is not None,
                              level=level, engine_block=block,
                              threshold=self.config.kv_recompute_threshold)
        ex.prefill_cached_tokens = report.cached
        if pulled is not None:
            ex.pulled_tokens, ex.pulled_exact = report.pulled, report.exact
            self.stats.pulled(report.pulled)
        if preview is None or predicted is None or not self.fleet.current(pre.instance):
            return  # a server replaced while the leg ran teaches nothing of the new one
        outcome = prefill_verdict(report, predicted, block)
        if outcome is not None:
            self.router.judged(preview, pre.replica, report.cached, outcome)

    async def _prefill(self, ex: Exchange, ranked: Sequence[str], body: bytes,
                       ) -> Prefilled | Alone:
        """The prefill leg on the first of `ranked` that takes it (after_prefill); else
        why D must compute alone: "prefill_full" when every P was at the cap and none was
        tried, "prefill_failed" otherwise."""
        why: Alone = "prefill_full"
        for name in ranked:
            replica = self.fleet.replicas.get(name)
            if replica is None or not replica.healthy:
                continue
            if self.prefill_cap and replica.in_flight >= self.prefill_cap:
                continue  # full: nothing sent, the next P or D alone
            why = "prefill_failed"
            what: LegFailure | None = None
            data = b""
            resp: UpstreamResponse | None = None
            clean = False
            replica.in_flight += 1  # P's load while its leg runs
            try:
                try:
                    resp = await self.upstream.send(
                        "POST", replica.url + ex.target,
                        upstream_request_headers(ex.up_headers, ex.upstream_id,
                                                 replica.upstream_headers),
                        body, self.timeouts)
                    what = answered(resp.status)
                    data = await resp.read()
                    clean = True
                except UpstreamError as exc:
                    what = happened(exc)
                    if verdict(what).suspect:
                        self.monitor.suspect(replica)
            finally:
                replica.in_flight -= 1
                if resp is not None:
                    if clean:
                        resp.release()
                    else:
                        resp.abort()
            params = answer_params(data) if what is None else None
            if params is not None:
                usage = parse_answer(data).usage
                return Prefilled(name, params, usage.prompt_tokens if usage else None,
                                 reported_cached(usage.cached_tokens if usage else None,
                                                 params), replica)
            if what is None:
                what = "no_params"
            else:
                self.counters.failure(name, what)
            self.stats.leg_failed("prefill", what)
            if after_prefill(what) == "decode_alone":
                return why
        return why
