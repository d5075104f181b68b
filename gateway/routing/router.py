"""The router: one object the app owns, pure (time is a parameter, no I/O).

The protocol with the request path is two calls: `decide` once, `report` once.

`decide` renders the body (normalize), chain-hashes it (blocks), asks the index how many
leading blocks each candidate holds, turns that into predicted cached tokens (estimate:
learned bytes/token + anchors, then vLLM's cap `min(floor(m/B)*B, floor((N-1)/B)*B)` with B
the engine's block size), ranks the candidates (policy) and counts the request as sent to
the first: the request path forwards it there at once (what being sent, retried, begun and
reported records, the index, its limits and the requests in flight: ledger.py).

`report`: usage arrived (or the request failed): the ledger learns from it (the bytes/token
ratio, the feedback on the index's limits, the reply's blocks).

`set_capacity`, `add_replica`, `remove_replica`, `replica_restarted`: fleet changes.

Tenants: with API keys, a session id and an implicit conversation belong to the key's
tenant (`decide(tenant=...)`): one tenant's session id or identical prompt cannot bind,
join or move another's (sessions.scoped, conversations' scope). The replicas' caches are
shared, so block matching is not scoped.

Shared state: `apply` takes another instance's fact at the time it happened. A replica's
restart (`replica_restarted`, published as a `Restarted` fact) empties its index and
voids block facts about it from before, whichever instance learns them later.

Token mode (optional, `tokens`): where a model has a renderer and a replica's KV events
flow, the prediction on that replica is exact (its events' blocks, events/tokenmode.py)
instead of the text guess, and `sent` adds short-lived predicted blocks there.

Every policy computes predictions (so usage records compare prediction and delivery under
any policy); only `prefix` uses them to choose.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from gateway.routing.blocks import TextChains
from gateway.routing.config import RoutingConfig
from gateway.routing.conversations import Conversations
from gateway.routing.decision import Decision, ReplicaState
from gateway.routing.facts import (
    Departed,
    Dropped,
    Fact,
    Reply,
    Response,
    Restarted,
    Sent,
    Trust,
)
from gateway.routing.feedback import Limits, Verdict
from gateway.routing.ledger import Ledger, began, shared_prefix
from gateway.routing.normalize import canonical_bytes, chain_seed
from gateway.routing.plan import RoutePlan, engine_cap
from gateway.routing.policy import Candidate, cache_fill, choose, move_reason
from gateway.routing.restarts import RestartMark, settle
from gateway.routing.sessions import (
    SessionKey,
    SessionLoad,
    ratio_key,
    scoped,
    tenant_scope,
)

if TYPE_CHECKING:
    from gateway.events.tokenmode import TokenMode

# began and shared_prefix live in ledger.py; their callers import them from here too.
__all__ = ["Router", "began", "shared_prefix"]

class Router:
    def __init__(self, config: RoutingConfig, tokens: TokenMode | None = None,
                 publish: Callable[[Fact], None] | None = None) -> None:
        self.config = config
        self._tokens = tokens
        # The index, its limits, the estimator and the requests in flight (ledger.py);
        # shared state (gateway/shared/): every fact this router learns goes out through it.
        self._ledger = Ledger(config, publish)
        self._rng = random.Random(config.seed)
        self._turn = 0
        # A conversation's next turn hashes only what follows its last checkpoint.
        self._chains = TextChains(config.block_bytes)
        self._sessions = SessionLoad(config.session_active_s, config.session_capacity)
        self._conversations = Conversations(config.conversation_capacity,
                                            config.conversation_tips,
                                            config.conversation_sample_every)
        # replica -> its last restart (cache empty since its `at`): older block facts void;
        # one entry per replica the router was told of, removed with it like the tables
        self._restarted: dict[str, RestartMark] = {}
        # replica -> how many restarts this router took as new (`restarts`), bounded the same
        self._restart_count: dict[str, int] = {}

    # the protocol -----------------------------------------------------------------------
    def decide(
        self,
        body: Mapping[str, Any],
        endpoint: Literal["chat", "completions"],
        model: str,
        session: str | None,
        candidates: Sequence[ReplicaState],
        now: float,
        *,
        pin: str | None = None,
        tenant: str | None = None,
        previewed: RoutePlan | None = None,
    ) -> RoutePlan:
        """Rank `candidates` and count the request as sent to the first. `previewed` (a
        `preview` of the same body) saves rendering and hashing it again. `pin` names the
        one replica the request may go to (a Responses API continuation must reach the
        replica that stored its previous response): the decision says so (reason
        `response`), predictions are still made. `tenant`: the API key's, whose sessions
        and conversations these are. Raises NormalizeError (a ValueError) for a body that
        cannot be rendered and ValueError for an empty candidate list."""
        self._ledger.settle(now)
        plan = self._route(body, endpoint, model, session, candidates, now, tenant,
                           previewed=previewed)
        if pin is not None:
            plan = dataclasses.replace(plan, decision=dataclasses.replace(
                plan.decision, replica=pin, reason="response", ranked=(pin,),
                predicted_cached_tokens=plan.predicted.get(pin, 0)))
        chosen = plan.decision.replica
        plan.outcome.replica = chosen
        self._sent(plan, chosen, now)
        return plan

    def preview(
        self,
        body: Mapping[str, Any],
        endpoint: Literal["chat", "completions"],
        model: str,
        session: str | None,
        candidates: Sequence[ReplicaState],
        now: float,
        *,
        tenant: str | None = None,
        answers: bool = True,
    ) -> RoutePlan:
        """What `decide` would predict now, without counting anything as sent or opening a
        conversation (the admission queue asks it for each waiting request once, to know
        which replica holds its prefix; `decide` is called when it goes). `answers` False:
        the candidates never generate (P/D prefill replicas), so a conversation's earlier
        answers are not predicted cached there (TokenEstimator.matched_tokens)."""
        self._ledger.settle(now)
        return self._route(body, endpoint, model, session, candidates, now, tenant,
                           commit=False, answers=answers)

    def report(self, plan: RoutePlan, now: float) -> None:
        """The request is over: its outcome (replica, usage, reply) is final."""
        self._ledger.reported(plan)

    def prefilled_elsewhere(self, plan: RoutePlan) -> None:
        """`plan` takes a prefill leg on a prefill replica (gateway.pd): its replica (D)
        pulls the prompt's KV instead of computing it, so its uncached tokens are not
        prefill queued there (counted so, D looked busier than it was while P worked, and
        follow-ups left their decode replica for load). It stays in flight there. Should
        the prefill leg fail and D compute alone after all, its prefill is not counted
        there either until its first token (rare: every prefill replica failed)."""
        self._ledger.unqueue(plan, plan.outcome.replica)

    def engine_began(self, replica: str, asked_at: float, waiting: float | None,
                     s_per_token: float) -> None:
        """A scrape of `replica` asked for at `asked_at` shows `waiting` requests in its
        engine's queue: of this gateway's requests sent there before it and still counted
        as queued prefill, all but the `waiting` youngest have begun (`began`). Begun is
        not prefilled (vLLM prefills a begun prompt in chunks, before any waiting one): a
        streamed request's prefill stays queued to its first token; a non-streamed one's,
        whose first byte is its last, ends once its uncached tokens' prefill at
        `s_per_token` (the engine's rate), after that of those begun before it (first
        come, first served), has passed since `asked_at`."""
        self._ledger.engine_began(replica, asked_at, waiting, s_per_token)

    def estimate_began(self, replica: str, now: float) -> None:
        """No engine figure says which requests sent to `replica` began (an engine without
        running/waiting counts, llama.cpp's; or its scrapes fail): a non-streamed one counts
        as prefilled once the cost model's prefill time of its prompt and of those sent
        before it (first come, first served) has passed since it was sent, else, its first
        byte its last, it would count as queued prefill until its answer ended; a streamed
        one at its first token (the estimate ends a prompt early that waited behind others:
        `engine_began`). O(n log n) in the requests queued there, asked only without engine
        figures."""
        self._ledger.estimate_began(replica, now)

    def retried(self, plan: RoutePlan, replica: str, now: float) -> None:
        """The request path moved `plan` to `replica`: the replica tried before never
        received it (not delivered), so nothing of it was scheduled there."""
        old = plan.outcome.replica
        plan.outcome.replica = replica
        if old == replica:
            return
        if old:
            self._ledger.moved(plan, old)
        self._sent(plan, replica, now)

    def judged(self, plan: RoutePlan, replica: str, delivered: int, outcome: Verdict) -> None:
        """`replica`'s answer to `plan` was judged elsewhere (a P/D prefill leg's own
        report, gateway.pd.accounting: `plan` is the preview that ranked the prefill
        replicas): the same limits a one-leg answer's verdict moves."""
        if replica in plan.predicted and replica in self._ledger.limits and self.config.feedback:
            self._ledger.feedback(plan, replica, delivered, outcome)

    def engine_block(self, replica: str) -> int:
        """The engine's KV block size on `replica` (its scrape's, else the configured)."""
        return self._ledger.engine_block(replica)

    def holds(self, replica: str, plan: RoutePlan, now: float) -> None:
        """`replica` computed `plan`'s prompt too (a P/D prefill leg, gateway.pd): it holds
        the prefix now, as the replica serving the request does; nothing else of the
        request (its session, queued work) moves there."""
        if replica not in self._ledger.limits:
            self.add_replica(replica)
        index = self._ledger.index
        index.record(replica, plan.hashes, len(plan.hashes), index.matched(replica, plan.hashes))
        publish = self._ledger.publish
        if publish is not None:  # another instance records it as a reply's blocks
            publish(Reply(replica, plan.hashes, 0))
        if plan.tokens is not None and self._tokens is not None:
            self._tokens.sent(plan.tokens, replica, now)

    # the decision ---------------------------------------------------------------------
    def _route(
        self,
        body: Mapping[str, Any],
        endpoint: Literal["chat", "completions"],
        model: str,
        session: str | None,
        candidates: Sequence[ReplicaState],
        now: float,
        tenant: str | None = None,
        commit: bool = True,
        previewed: RoutePlan | None = None,
        answers: bool = True,
    ) -> RoutePlan:
        """Rank `candidates` for this request (`commit`: a decision, not a preview: a new
        conversation is opened, round robin advances). Raises NormalizeError (a ValueError) for a
        body that cannot be rendered and ValueError for an empty candidate list."""
        if not candidates:
            raise ValueError("no candidate replica")
        ledger = self._ledger
        ledger.sweep(now)
        if previewed is not None:
            data, seed, hashes = previewed.data, previewed.seed, previewed.hashes
        else:
            data = canonical_bytes(body, endpoint)
            seed = chain_seed(body, endpoint, model)
            hashes = self._chains.hashes(data, seed)
        est = ledger.estimator
        ratio = est.ratio(ratio_key(model, tenant))
        prompt_tokens = est.prompt_tokens(hashes, len(data), ratio)
        # Token mode (KV events): exact counts on the replicas whose events flow.
        lookup = (self._tokens.lookup(body, endpoint, model, [c.name for c in candidates], now)
                  if self._tokens is not None else None)
        if lookup is not None:
            prompt_tokens = float(lookup.prompt_tokens)
        matched: dict[str, int] = {}
        predicted: dict[str, int] = {}
        # Replicas usually share a few match lengths: estimate each (length, block) once.
        by_blocks: dict[tuple[int, int], int] = {}
        default_block = self.config.engine_block_size
        sessions = self._sessions
        conversation: int | None = None
        skey: SessionKey | None = None if session is None else scoped(session, tenant)
        bound: str | None = None
        own = 0.0
        if session is None and hashes:
            found = self._conversations.find(hashes, tenant_scope(tenant))
            if found is not None and found.how == "follows":
                conversation = found.conversation
            elif commit:
                conversation = self._conversations.open()
                if found is not None:  # a fork: placed as a follow-up of its origin
                    bound = sessions.replica(found.conversation)
            skey = conversation
        if skey is not None and bound is None:
            bound = sessions.replica(skey)
            own = sessions.weight(skey, now)
        index = ledger.index
        views: list[Candidate] = []
        for state in candidates:
            name = state.name
            if name not in ledger.limits:
                self.add_replica(name)
            m = index.matched(name, hashes)
            key = (m, ledger.engine_blocks.get(name, default_block))
            p = lookup.cached_tokens(name) if lookup is not None else None
            if p is None:
                p = by_blocks.get(key)
            if p is None:
                tokens = est.matched_tokens(data, hashes, m, ratio, answers)
                p = by_blocks[key] = engine_cap(tokens, prompt_tokens, key[1])
            matched[name] = m
            predicted[name] = p
            pend = ledger.pending.get(name)
            views.append(Candidate(
                name=name, predicted_tokens=p, queued_tokens=ledger.queued.get(name, 0.0),
                queued_requests=len(pend) if pend else 0, in_flight=state.in_flight,
                engine_waiting=state.engine_waiting, engine_running=state.engine_running,
                sessions=sessions.load(name, now) - (own if name == bound else 0.0),
                fill=cache_fill(index.size(name), index.capacity(name)),
            ))
        policy = self.config.policy
        # The `session` policy hashes what the client named; the others see conversations.
        named = None if session is None else skey
        choice = choose(policy, views, prompt_tokens, skey if policy != "session" else named,
                        bound, self.config, self._rng, self._turn)
        self._turn += commit
        chosen = views[choice.ranked[0]].name
        decision = Decision(
            replica=chosen, reason=choice.reason, predicted_cached_tokens=predicted[chosen],
            best_available_tokens=max(predicted.values()),
            estimated_prompt_tokens=max(0, round(prompt_tokens)),
            ranked=tuple(views[i].name for i in choice.ranked),
            move=move_reason(bound, chosen, views) if bound is not None else None,
        )
        return RoutePlan(decision=decision, model=model, session=session,
                         conversation=conversation, data=data,
                         seed=seed, hashes=hashes, matched=matched, predicted=predicted,
                         estimated_tokens=prompt_tokens, tokens=lookup, tenant=tenant,
                         streamed=body.get("stream") is True)

    # what happened to it ----------------------------------------------------------------
    def _sent(self, plan: RoutePlan, replica: str, now: float) -> None:
        if replica not in self._ledger.limits:
            self.add_replica(replica)
        self._ledger.sent(plan, replica, now)
        if plan.tokens is not None and self._tokens is not None:
            self._tokens.sent(plan.tokens, replica, now)
        if plan.session is not None:
            self._sessions.touch(scoped(plan.session, plan.tenant), replica, now)
        elif plan.conversation is not None:
            self._sessions.touch(plan.conversation, replica, now)
            self._conversations.advance(plan.conversation, plan.hashes,
                                        tenant_scope(plan.tenant))

    # fleet --------------------------------------------------------------------------------
    def set_capacity(
        self, replica: str, capacity_tokens: int | None, engine_block_size: int | None = None
    ) -> None:
        """KV capacity in tokens (num_gpu_blocks x block_size) or None for the default;
        `engine_block_size` (vllm:cache_config_info block_size) when known."""
        ledger = self._ledger
        if replica not in ledger.limits:
            self.add_replica(replica)
        if capacity_tokens is None:
            ledger.capacity_tokens.pop(replica, None)
        else:
            ledger.capacity_tokens[replica] = max(0, capacity_tokens)
        if engine_block_size is not None and engine_block_size > 0:
            ledger.engine_blocks[replica] = engine_block_size
        ledger.refresh_capacity(replica)

    def add_replica(self, replica: str) -> None:
        ledger = self._ledger
        if replica in ledger.limits:
            return
        nominal = ledger.blocks_for(self.config.default_capacity_tokens)
        ledger.limits[replica] = Limits(nominal, nominal)
        ledger.index.add_replica(replica)
        ledger.index.set_capacity(replica, nominal)

    def remove_replica(self, replica: str) -> None:
        """The replica left the fleet: everything about it goes (the token mode's view of
        it too)."""
        self._ledger.index.remove_replica(replica)
        if self._tokens is not None:
            self._tokens.forget_replica(replica)
        self._sessions.forget_replica(replica)
        self._ledger.forget(replica)
        for table in (self._restarted, self._restart_count):
            table.pop(replica, None)

    def replica_restarted(self, replica: str, now: float, started: float | None = None,
                          sign: str = "events") -> None:
        """The replica restarted at about `now` (a new process, whose start time is
        `started` when the engine shows it; its counters gone backwards, or down too long
        to tell): its cache is empty, and so are the facts about it from before, here and,
        through the `Restarted` fact, on every other instance; the sessions bound to it
        are forgotten, its capacity figures kept. `sign`: the kind of sign seen
        (restarts.py; "events" for the KV feed, the one caller that names none)."""
        seen = RestartMark(now, started, signs=frozenset((sign,)))
        publish = self._ledger.publish
        if self._restart(replica, seen) and publish is not None:
            publish(Restarted(replica, started))

    def _restart(self, replica: str, seen: RestartMark) -> bool:
        """False when this is a restart already known (restarts.py: by the engine's
        process start time where shown): every instance sees it, each at its own next
        scrape, and a second clear would drop what was learnt in between."""
        new, self._restarted[replica] = settle(self._restarted.get(replica), seen)
        if new:
            self._restart_count[replica] = self._restart_count.get(replica, 0) + 1
            self._ledger.index.clear(replica)
            self._sessions.forget_replica(replica)
        return new

    def token_mode(self, model: str) -> bool:
        """Whether `model` is in token mode (`[tokens]`: the router renders and tokenizes
        its prompts), whether or not its replicas' events flow right now."""
        return self._tokens is not None and model in self._tokens.models()

    def prompt_ids(self, body: Mapping[str, Any], endpoint: Literal["chat", "completions"],
                   model: str) -> list[int] | None:
        """Token mode: the prompt's every token id (gateway.tokens.render), None when the
        model is not in token mode or its prompt does not render."""
        return None if self._tokens is None else self._tokens.token_ids(body, endpoint, model)

    def restarts(self, replica: str) -> int:
        """How many restarts of `replica` were taken as new since it joined (however they
        were seen: its metrics, its KV events, down too long, another instance's fact):
        what was learnt of its engine before the last one is void (admission/fleetview.py)."""
        return self._restart_count.get(replica, 0)

    def share(self, publish: Callable[[Fact], None] | None) -> None:
        """Publish every fact this router learns to `publish` (shared state), or stop."""
        self._ledger.publish = publish

    def apply(self, fact: Fact, at: float) -> None:
        """A fact another gateway instance published (facts.py), applied at `at`, when it
        happened: the same bookkeeping as if this one had routed it then, but no queued
        work (that load is the other's, and the replica's own metrics show it to everyone).
        Replicas this router does not know (not in its fleet, or not up yet) are left
        alone; blocks a replica held before its last restart are not put back. A departure
        is the shared state's to apply (it voids the facts before it, gateway/shared/)."""
        limits = self._ledger.limits
        if isinstance(fact, (Response, Departed)) or fact.replica not in limits:
            return
        replica, index = fact.replica, self._ledger.index
        if isinstance(fact, Restarted):
            self._restart(replica, RestartMark(at, fact.started, local=False))
            return
        last = self._restarted.get(replica)
        stale = last is not None and at < last.at
        if isinstance(fact, Trust):
            nominal = limits[replica].nominal
            limit = max(1 if nominal else 0, int(nominal * fact.fraction))
            limits[replica] = Limits(nominal, limit)
            index.set_capacity(replica, limit)
        elif isinstance(fact, Dropped):
            index.drop_from(replica, fact.hashes, fact.keep)
        else:
            if not stale:
                index.record(replica, fact.hashes, len(fact.hashes),
                             index.matched(replica, fact.hashes))
            if isinstance(fact, Sent):
                # The binding holds across the restart, as it does for this instance's own.
                self._bind(fact, at)

    def _bind(self, fact: Sent, now: float) -> None:
        if fact.session is not None:
            self._sessions.touch(scoped(fact.session, fact.tenant), fact.replica, now)
        elif fact.implicit and fact.hashes:
            convs = self._conversations
            scope = tenant_scope(fact.tenant)
            found = convs.find(fact.hashes, scope)
            conv = found.conversation if found is not None and found.how == "follows" \
                else convs.open()
            self._sessions.touch(conv, fact.replica, now)
            convs.advance(conv, fact.hashes, scope)

    # introspection (stats, tests): each settles in-flight outcomes first, like a decision,
    # so it reads the state the next decision would see ----------------------------------
    def indexed_blocks(self, replica: str) -> int:
        self._ledger.settle(self._ledger.last_settle)
        return self._ledger.index.size(replica)

    def index_limit(self, replica: str) -> int:
        return self._ledger.index.capacity(replica)

    def queued_tokens(self, replica: str, now: float | None = None) -> float:
        """The prefill sent to `replica` and not yet done (ledger.py), settled at `now`
        (None: the last decision's time; a begun non-streamed request's prefill ends by
        the clock)."""
        self._ledger.settle(self._ledger.last_settle if now is None else now)
        return self._ledger.queued.get(replica, 0.0)

    def largest_by_replica(self) -> dict[str, float]:
        """The largest prompt (estimated tokens) of the requests in flight on each replica
        (O(requests in flight); the admission queue's floor of a replica's prefill room)."""
        return {replica: max(p.estimated_tokens for p in live)
                for replica, live in self._ledger.live.items() if live}

    def live_prompts(self, replica: str) -> list[tuple[float, float]]:
        """(sent at, estimated prompt tokens) of each request in flight on `replica`."""
        live = self._ledger.live.get(replica)
        return [(at, float(p.estimated_tokens)) for p, at in live.items()] if live else []

    def pinned_tokens(self, replica: str) -> float:
        """The estimated prompt tokens of the requests in flight on `replica` (what they
        hold in its KV cache: the admission queue's KV usage between scrapes), those the
        ledger's sweep forgot counted as still there: a sweep is no end, and the queue
        reads only the difference from what a scrape was asked for with
        (gateway/admission/engine.py)."""
        return (sum(t for _, t in self.live_prompts(replica))
                + self._ledger.swept.get(replica, 0.0))

    def swept_tokens(self, replica: str) -> float:
        """What `pinned_tokens` counts of requests the ledger's sweep forgot."""
        return self._ledger.swept.get(replica, 0.0)

    def cache_free_tokens(self, replica: str) -> float:
        """Tokens the index believes `replica`'s prefix cache can still take before it
        evicts (its capacity, from the engine's reported KV blocks, less what is indexed)."""
        ledger = self._ledger
        ledger.settle(ledger.last_settle)
        free = ledger.index.capacity(replica) - ledger.index.size(replica)
        return max(0, free) * self.config.block_bytes / ledger.estimator.mean_ratio()

    def queued_by_replica(self, now: float | None = None) -> dict[str, float]:
        """`queued_tokens` of every replica, settled once at `now` (the admission queue
        reads them all on each pass)."""
        self._ledger.settle(self._ledger.last_settle if now is None else now)
        return dict(self._ledger.queued)

    def session_load(self, replica: str, now: float) -> float:
        return self._sessions.load(replica, now)

    def session_replica(self, session: SessionKey) -> str | None:
        return self._sessions.replica(session)

    def conversations(self) -> int:
        """Implicit conversations remembered."""
        return len(self._conversations)
