"""The router: one object the app owns, pure (time is a parameter, no I/O).

The protocol with the request path is two calls: `decide` once, `report` once.

`decide` renders the body (normalize), chain-hashes it (blocks), asks the index how many
leading blocks each candidate holds, turns that into predicted cached tokens (estimate:
learned bytes/token + anchors, then vLLM's cap `min(floor(m/B)*B, floor((N-1)/B)*B)` with B
the engine's block size), ranks the candidates (policy) and counts the request as sent to
the first: the request path forwards it there at once. Sent means the index records the
whole prompt on that replica now, because vLLM registers a request's blocks when it
schedules it, not when it finishes, and the request's uncached tokens count as queued
prefill there.

The plan carries an `Outcome` the request path fills in as it goes. Each decision first
settles the outcomes of requests still in flight: a first token ends its queued prefill. A
retry is told explicitly (`retried`): the request never reached the replica first chosen, so
its queued work and the blocks it alone added there move to the replica now trying it.

A request that failed before its first token was never scheduled: the blocks it alone added
are dropped (`_drop_own`: not those it found there, nor those another request in flight on
that replica shares with it). Once a first token came, vLLM has its blocks (an aborted
request's blocks stay cached): they are kept whatever happens next.

`report`: usage arrived (or the request failed). prompt_tokens teaches the bytes/token ratio
and sets an anchor; cached_tokens vs the prediction drives the feedback (feedback.py). With
`reply_text` (the generated answer, when the proxy has it) the reply's blocks are indexed
too, as vLLM caches generated tokens and the next turn of the conversation repeats them.

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
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from gateway.routing.blocks import TextChains, chain_hashes
from gateway.routing.config import RoutingConfig
from gateway.routing.conversations import Conversations
from gateway.routing.decision import Decision, ReplicaState
from gateway.routing.estimate import TokenEstimator
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
from gateway.routing.feedback import Limits, Verdict, adjust, verdict
from gateway.routing.index import BlockIndex
from gateway.routing.normalize import END, canonical_bytes, chain_seed
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

class Router:
    def __init__(self, config: RoutingConfig, tokens: TokenMode | None = None,
                 publish: Callable[[Fact], None] | None = None) -> None:
        self.config = config
        self._tokens = tokens
        # Shared state (gateway/shared/): every fact this router learns goes out here.
        self._publish = publish
        self._rng = random.Random(config.seed)
        self._turn = 0
        self._estimator = TokenEstimator(
            config.initial_bytes_per_token, config.ratio_ewma_alpha,
            config.anchor_capacity, config.block_bytes,
        )
        self._index = BlockIndex(self._blocks_for(config.default_capacity_tokens))
        # A conversation's next turn hashes only what follows its last checkpoint.
        self._chains = TextChains(config.block_bytes)
        self._capacity_tokens: dict[str, int] = {}
        self._limits: dict[str, Limits] = {}
        self._engine_block: dict[str, int] = {}
        self._pending: dict[str, dict[RoutePlan, tuple[float, float]]] = {}
        # Requests in flight per replica (plan -> sent at), queued or past their first token;
        # bounded like `_pending`: removed at report, by a retry, or by the sweep.
        self._live: dict[str, dict[RoutePlan, float]] = {}
        self._queued: dict[str, float] = {}
        self._sessions = SessionLoad(config.session_active_s, config.session_capacity)
        self._conversations = Conversations(config.conversation_capacity,
                                            config.conversation_tips,
                                            config.conversation_sample_every)
        self._last_sweep = float("-inf")
        self._last_settle = 0.0
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
        self._settle(now)
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
        self._settle(now)
        return self._route(body, endpoint, model, session, candidates, now, tenant,
                           commit=False, answers=answers)

    def report(self, plan: RoutePlan, now: float) -> None:
        """The request is over: its outcome (replica, usage, reply) is final."""
        o = plan.outcome
        self._unqueue(plan, o.replica)
        self._completed(plan, o.replica, o.prompt_tokens, o.cached_tokens, o.ok, now,
                        o.reply_text, o.completion_tokens)
        live = self._live.get(o.replica)
        if live is not None:
            live.pop(plan, None)

    def prefilled_elsewhere(self, plan: RoutePlan) -> None:
        """`plan` takes a prefill leg on a prefill replica (gateway.pd): its replica (D)
        pulls the prompt's KV instead of computing it, so its uncached tokens are not
        prefill queued there (counted so, D looked busier than it was while P worked, and
        follow-ups left their decode replica for load). It stays in flight there. Should
        the prefill leg fail and D compute alone after all, its prefill is not counted
        there either until its first token (rare: every prefill replica failed)."""
        self._unqueue(plan, plan.outcome.replica)

    def engine_began(self, replica: str, asked_at: float, waiting: float | None) -> None:
        """A scrape of `replica` asked for at `asked_at` shows `waiting` requests in its
        engine's queue: of this gateway's requests sent there before it and still counted
        as queued prefill, all but the `waiting` youngest have begun (`began`), so their
        prefill no longer waits, whether or not a first byte came (a non-streamed answer's
        first byte is its last)."""
        pend = self._pending.get(replica)
        if not pend:
            return
        before = sorted((item[1], i, plan) for i, (plan, item) in enumerate(pend.items())
                        if item[1] < asked_at)
        for _, _, plan in before[:began(len(before), waiting)]:
            self._unqueue(plan, replica)

    def estimate_began(self, replica: str, now: float) -> None:
        """No engine figure says which requests sent to `replica` began (an engine without
        running/waiting counts, llama.cpp's; or its scrapes fail): each counts as begun once
        the cost model's prefill time of its prompt and of those sent before it (first
        come, first served) has passed since it was sent, else a non-streamed one, whose
        first byte is its last, would count as queued prefill until its answer ended.
        O(n log n) in the requests queued there, asked only without engine figures."""
        pend = self._pending.get(replica)
        if not pend:
            return
        per_token = self.config.prefill_s_per_token
        ahead = 0.0
        for plan, (tokens, at) in sorted(pend.items(), key=lambda kv: kv[1][1]):
            ahead += tokens
            if now - at >= ahead * per_token:
                self._unqueue(plan, replica)

    def retried(self, plan: RoutePlan, replica: str, now: float) -> None:
        """The request path moved `plan` to `replica`: the replica tried before never
        received it (not delivered), so nothing of it was scheduled there."""
        old = plan.outcome.replica
        plan.outcome.replica = replica
        if old == replica:
            return
        if old:
            self._unqueue(plan, old)
            live = self._live.get(old)
            if live is not None:
                live.pop(plan, None)
            if old in self._limits:
                self._drop_own(plan, old)
        self._sent(plan, replica, now)

    def judged(self, plan: RoutePlan, replica: str, delivered: int, outcome: Verdict) -> None:
        """`replica`'s answer to `plan` was judged elsewhere (a P/D prefill leg's own
        report, gateway.pd.accounting: `plan` is the preview that ranked the prefill
        replicas): the same limits a one-leg answer's verdict moves."""
        if replica in plan.predicted and replica in self._limits and self.config.feedback:
            self._feedback(plan, replica, delivered, outcome)

    def engine_block(self, replica: str) -> int:
        """The engine's KV block size on `replica` (its scrape's, else the configured)."""
        return self._engine_block.get(replica, self.config.engine_block_size)

    def holds(self, replica: str, plan: RoutePlan, now: float) -> None:
        """`replica` computed `plan`'s prompt too (a P/D prefill leg, gateway.pd): it holds
        the prefix now, as the replica serving the request does; nothing else of the
        request (its session, queued work) moves there."""
        if replica not in self._limits:
            self.add_replica(replica)
        index = self._index
        index.record(replica, plan.hashes, len(plan.hashes), index.matched(replica, plan.hashes))
        if self._publish is not None:  # another instance records it as a reply's blocks
            self._publish(Reply(replica, plan.hashes, 0))
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
        self._sweep(now)
        if previewed is not None:
            data, seed, hashes = previewed.data, previewed.seed, previewed.hashes
        else:
            data = canonical_bytes(body, endpoint)
            seed = chain_seed(body, endpoint, model)
            hashes = self._chains.hashes(data, seed)
        est = self._estimator
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
        index = self._index
        views: list[Candidate] = []
        for state in candidates:
            name = state.name
            if name not in self._limits:
                self.add_replica(name)
            m = self._index.matched(name, hashes)
            key = (m, self._engine_block.get(name, default_block))
            p = lookup.cached_tokens(name) if lookup is not None else None
            if p is None:
                p = by_blocks.get(key)
            if p is None:
                tokens = est.matched_tokens(data, hashes, m, ratio, answers)
                p = by_blocks[key] = engine_cap(tokens, prompt_tokens, key[1])
            matched[name] = m
            predicted[name] = p
            pend = self._pending.get(name)
            views.append(Candidate(
                name=name, predicted_tokens=p, queued_tokens=self._queued.get(name, 0.0),
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
                         estimated_tokens=prompt_tokens, tokens=lookup, tenant=tenant)

    # what happened to it ----------------------------------------------------------------
    def _settle(self, now: float) -> None:
        """Apply what in-flight outcomes say since the last decision (O(requests in
        flight)): first tokens end queued prefill."""
        self._last_settle = now
        for replica, pend in self._pending.items():
            for plan in [p for p in pend if p.outcome.first_token_at is not None]:
                self._unqueue(plan, replica)

    def _sent(self, plan: RoutePlan, replica: str, now: float) -> None:
        if replica not in self._limits:
            self.add_replica(replica)
        uncached = max(0.0, plan.estimated_tokens - plan.predicted.get(replica, 0))
        self._unqueue(plan, replica)
        plan.outcome.arriving_from = self._arriving_from(plan, replica)
        self._pending.setdefault(replica, {})[plan] = (uncached, now)
        self._live.setdefault(replica, {})[plan] = now
        self._queued[replica] = self._queued.get(replica, 0.0) + uncached
        self._index.record(replica, plan.hashes, len(plan.hashes), plan.matched.get(replica, 0))
        if self._publish is not None:
            self._publish(Sent(replica, plan.hashes, plan.session, plan.conversation is not None,
                               plan.tenant))
        if plan.tokens is not None and self._tokens is not None:
            self._tokens.sent(plan.tokens, replica, now)
        if plan.session is not None:
            self._sessions.touch(scoped(plan.session, plan.tenant), replica, now)
        elif plan.conversation is not None:
            self._sessions.touch(plan.conversation, replica, now)
            self._conversations.advance(plan.conversation, plan.hashes,
                                        tenant_scope(plan.tenant))

    def _completed(
        self,
        plan: RoutePlan,
        replica: str,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        ok: bool,
        now: float,
        reply_text: str | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """Usage is known. `reply_text` / `completion_tokens` (optional) let the index
        follow the conversation into the generated answer, which vLLM caches too."""
        self._unqueue(plan, replica)
        if replica not in self._limits:
            return  # removed meanwhile
        est = self._estimator
        if not ok and prompt_tokens is None:
            if plan.outcome.first_token_at is None:
                # Never scheduled (rejected, cut before its first token): the blocks it
                # alone added at `sent` are not there.
                self._drop_own(plan, replica)
            return
        if prompt_tokens is not None and prompt_tokens > 0:
            key = ratio_key(plan.model, plan.tenant)
            est.observe(key, len(plan.data), prompt_tokens)
            est.set_anchor(plan.data, plan.hashes, prompt_tokens, est.ratio(key),
                           completion_tokens if ok else None)
            self._refresh_capacity(replica)
            if ok and reply_text:
                self._index_reply(plan, replica, prompt_tokens, reply_text, completion_tokens)
        if cached_tokens is not None and replica in plan.predicted and self.config.feedback:
            self._feedback(plan, replica, cached_tokens)

    # fleet --------------------------------------------------------------------------------
    def set_capacity(
        self, replica: str, capacity_tokens: int | None, engine_block_size: int | None = None
    ) -> None:
        """KV capacity in tokens (num_gpu_blocks x block_size) or None for the default;
        `engine_block_size` (vllm:cache_config_info block_size) when known."""
        if replica not in self._limits:
            self.add_replica(replica)
        if capacity_tokens is None:
            self._capacity_tokens.pop(replica, None)
        else:
            self._capacity_tokens[replica] = max(0, capacity_tokens)
        if engine_block_size is not None and engine_block_size > 0:
            self._engine_block[replica] = engine_block_size
        self._refresh_capacity(replica)

    def add_replica(self, replica: str) -> None:
        if replica in self._limits:
            return
        nominal = self._blocks_for(self.config.default_capacity_tokens)
        self._limits[replica] = Limits(nominal, nominal)
        self._index.add_replica(replica)
        self._index.set_capacity(replica, nominal)

    def remove_replica(self, replica: str) -> None:
        """The replica left the fleet: everything about it goes (the token mode's view of
        it too)."""
        self._index.remove_replica(replica)
        if self._tokens is not None:
            self._tokens.forget_replica(replica)
        self._sessions.forget_replica(replica)
        for table in (self._limits, self._capacity_tokens, self._engine_block, self._pending,
                      self._queued, self._live, self._restarted, self._restart_count):
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
        if self._restart(replica, seen) and self._publish is not None:
            self._publish(Restarted(replica, started))

    def _restart(self, replica: str, seen: RestartMark) -> bool:
        """False when this is a restart already known (restarts.py: by the engine's
        process start time where shown): every instance sees it, each at its own next
        scrape, and a second clear would drop what was learnt in between."""
        new, self._restarted[replica] = settle(self._restarted.get(replica), seen)
        if new:
            self._restart_count[replica] = self._restart_count.get(replica, 0) + 1
            self._index.clear(replica)
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
        self._publish = publish

    def apply(self, fact: Fact, at: float) -> None:
        """A fact another gateway instance published (facts.py), applied at `at`, when it
        happened: the same bookkeeping as if this one had routed it then, but no queued
        work (that load is the other's, and the replica's own metrics show it to everyone).
        Replicas this router does not know (not in its fleet, or not up yet) are left
        alone; blocks a replica held before its last restart are not put back. A departure
        is the shared state's to apply (it voids the facts before it, gateway/shared/)."""
        if isinstance(fact, (Response, Departed)) or fact.replica not in self._limits:
            return
        replica, index = fact.replica, self._index
        if isinstance(fact, Restarted):
            self._restart(replica, RestartMark(at, fact.started, local=False))
            return
        last = self._restarted.get(replica)
        stale = last is not None and at < last.at
        if isinstance(fact, Trust):
            nominal = self._limits[replica].nominal
            limit = max(1 if nominal else 0, int(nominal * fact.fraction))
            self._limits[replica] = Limits(nominal, limit)
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
        self._settle(self._last_settle)
        return self._index.size(replica)

    def index_limit(self, replica: str) -> int:
        return self._index.capacity(replica)

    def queued_tokens(self, replica: str) -> float:
        self._settle(self._last_settle)
        return self._queued.get(replica, 0.0)

    def largest_by_replica(self) -> dict[str, float]:
        """The largest prompt (estimated tokens) of the requests in flight on each replica
        (O(requests in flight); the admission queue's floor of a replica's prefill room)."""
        return {replica: max(p.estimated_tokens for p in live)
                for replica, live in self._live.items() if live}

    def cache_free_tokens(self, replica: str) -> float:
        """Tokens the index believes `replica`'s prefix cache can still take before it
        evicts (its capacity, from the engine's reported KV blocks, less what is indexed)."""
        self._settle(self._last_settle)
        free = self._index.capacity(replica) - self._index.size(replica)
        return max(0, free) * self.config.block_bytes / self._estimator.mean_ratio()

    def queued_by_replica(self) -> dict[str, float]:
        """`queued_tokens` of every replica, settled once (the admission queue reads them
        all on each pass)."""
        self._settle(self._last_settle)
        return dict(self._queued)

    def session_load(self, replica: str, now: float) -> float:
        return self._sessions.load(replica, now)

    def session_replica(self, session: SessionKey) -> str | None:
        return self._sessions.replica(session)

    def conversations(self) -> int:
        """Implicit conversations remembered."""
        return len(self._conversations)

    # internals ----------------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return int(tokens * self._estimator.mean_ratio() / self.config.block_bytes)

    def _refresh_capacity(self, replica: str) -> None:
        tokens = self._capacity_tokens.get(replica, self.config.default_capacity_tokens)
        nominal = self._blocks_for(tokens)
        old = self._limits.get(replica, Limits(nominal, nominal))
        # Keep the feedback's trust fraction when the nominal size moves.
        fraction = old.limit / old.nominal if old.nominal else 1.0
        limits = Limits(nominal, max(1 if nominal else 0, int(nominal * fraction)))
        self._limits[replica] = limits
        self._index.set_capacity(replica, limits.limit)

    def _unqueue(self, plan: RoutePlan, replica: str) -> None:
        pend = self._pending.get(replica)
        if pend is None:
            return
        item = pend.pop(plan, None)
        if item is not None:
            left = self._queued.get(replica, 0.0) - item[0]
            self._queued[replica] = left if pend else 0.0  # no float drift when idle

    def _sweep(self, now: float) -> None:
        """Forget queued work whose callbacks never came (at most once a second)."""
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        cutoff = now - self.config.pending_ttl_s
        for replica, pend in self._pending.items():
            for plan in [p for p, (_, at) in pend.items() if at < cutoff]:
                self._unqueue(plan, replica)
        for live in self._live.values():
            for plan in [p for p, at in live.items() if at < cutoff]:
                del live[plan]

    def _feedback(self, plan: RoutePlan, replica: str, delivered: int,
                  outcome: Verdict | None = None) -> None:
        cfg = self.config
        if outcome is None:
            outcome = verdict(plan.predicted[replica], delivered, self.engine_block(replica))
        if outcome == "under" and self._arriving(plan, delivered):
            return  # not judged: the blocks it missed were on their way, not evicted
        short = False
        if outcome == "over":
            ratio = self._estimator.ratio(ratio_key(plan.model, plan.tenant))
            pos = self._estimator.bytes_for_tokens(plan.hashes, len(plan.hashes), delivered, ratio)
            held = min(len(plan.hashes), int(pos) // cfg.block_bytes)
            short = held > plan.matched.get(replica, 0)
        limits = adjust(self._limits[replica], outcome, self._index.size(replica), short,
                        cfg.feedback_shrink, cfg.feedback_recover, cfg.feedback_min_factor)
        self._limits[replica] = limits
        self._index.set_capacity(replica, limits.limit)
        if self._publish is not None and limits.nominal:
            self._publish(Trust(replica, min(1.0, limits.limit / limits.nominal)))

    def _arriving(self, plan: RoutePlan, delivered: int) -> bool:
        """Whether what `plan` was predicted but not delivered begins where blocks were
        still arriving when it was sent (`arriving_from`, set by `_sent`), give or take
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
        ratio = self._estimator.ratio(ratio_key(plan.model, plan.tenant))
        pos = self._estimator.bytes_for_tokens(plan.hashes, len(plan.hashes), delivered, ratio)
        held = min(len(plan.hashes), int(pos) // self.config.block_bytes)
        return held + 1 >= start

    def _arriving_from(self, plan: RoutePlan, replica: str) -> int | None:
        """The first block of `plan`'s prompt that a request in flight on `replica` with
        no first token yet added to the index there (past what that request found there,
        up to what it shares with `plan`); None when none did. O(requests in flight
        there), each a bisection of the two chains."""
        first: int | None = None
        for other in self._live.get(replica, {}):
            if other is plan or other.outcome.first_token_at is not None:
                continue
            found = other.matched.get(replica, 0)
            if shared_prefix(plan.hashes, other.hashes) > found:
                first = found if first is None else min(first, found)
        return first

    def _drop_own(self, plan: RoutePlan, replica: str) -> None:
        """Drop the blocks `plan` alone added on `replica`: past those it found there and
        past those any other request in flight there shares with it."""
        keep = plan.matched.get(replica, 0)
        hashes = plan.hashes
        for other in self._live.get(replica, {}):
            if other is not plan and keep < len(hashes):
                keep = max(keep, shared_prefix(hashes, other.hashes))
        if keep < len(hashes):
            self._drop(replica, hashes, keep)

    def _drop(self, replica: str, hashes: Sequence[int], keep: int) -> None:
        self._index.drop_from(replica, hashes, keep)
        if self._publish is not None:
            self._publish(Dropped(replica, hashes, keep))

    def _index_reply(self, plan: RoutePlan, replica: str, prompt_tokens: int,
                     reply_text: str, completion_tokens: int | None) -> None:
        """Extend the chain through the answer as the next turn will render it."""
        block = self.config.block_bytes
        full = len(plan.hashes)
        extended = plan.data + reply_text.encode("utf-8", "surrogatepass") + END.encode()
        parent = plan.hashes[-1] if full else plan.seed
        hashes = plan.hashes + chain_hashes(extended[full * block :], parent, block)
        self._index.record(replica, hashes, len(hashes), full)
        if self._publish is not None:
            self._publish(Reply(replica, hashes, full))
        ratio = self._estimator.ratio(ratio_key(plan.model, plan.tenant))
        generated = (completion_tokens if completion_tokens is not None
                     else (len(extended) - len(plan.data)) / ratio)
        # The reply's last generated token never had its KV computed: the engine holds
        # prompt + generated - 1 tokens of this conversation.
        self._estimator.set_anchor(extended, hashes, prompt_tokens + generated - 1, ratio)



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
