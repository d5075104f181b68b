"""The inference request's flow, shared by every transport (`gateway serve`'s proxy,
gateway/proxy/handler.py; `gateway epp`'s picker, gateway/epp/picker.py), so that the
bookkeeping, admission and priorities are the same in both by construction. No bytes
are moved here and nothing is awaited but the admission queue.

    begin      the request's facts (Exchange): ids, endpoint, method
    authorize  the key's tenant (401)
    prepare    parse + check once, model label, session, candidates, chat view, Responses
               pinning, hygiene scan + metrics, the tenant's salts (the engine's on the
               body) and whether its answer withholds the shared index's decisions, the
               routing view
    admit      await the gate (off: Router.decide at once) -> the plan; decision metrics,
               route/predicted/best, the move, the response headers (withheld as due),
               the granted class stamped on the body (the client's `priority` never
               reaches the engine); one in-flight count taken on the pick
    moved      the request was served elsewhere (a retry, a data plane's fallback): the
               router moves its bookkeeping there, the in-flight count and the gate's
               ticket follow
    finish     once, whatever happened: the plan's outcome from the usage read, the
               in-flight count released, Router.report, Gate.done, one UsageRecord;
               of these only the in-flight count when the replica it was sent to is no
               longer the fleet's under that name (departed, or the name now another
               server's: Fleet.current), so an old address teaches nothing of the new one

Order in `finish`: the in-flight count is released before `Gate.done`, whose dispatch
reads each replica's load as max(in flight, admitted): a count still held would keep the
room the request just freed from the waiter that should take it.

What stays with each transport: reading the request, the serve-only body edits (usage
asked of a stream, hygiene rewrites: the `edit` hook of `prepare`), relaying, retries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.admission import priority
from gateway.admission.gate import Ask, Gate, Ticket
from gateway.agents.programs import ProgramId
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.proxy import pinning
from gateway.proxy.auth import Authenticator
from gateway.proxy.errors import GatewayError
from gateway.proxy.exchange import Exchange
from gateway.proxy.headers import response_headers
from gateway.proxy.inbound import (
    DepthGuard,
    Endpoint,
    Inbound,
    chat_view,
    parse_inbound,
    strip_gateway_only,
)
from gateway.proxy.tenancy import WITHHELD, TenantSalts
from gateway.replicas.fleet import Fleet, Replica
from gateway.routing.affinity import AffinityStore
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.sessions import resolve_session
from gateway.tracing.tracer import Passthrough, RequestTracer, Trace
from gateway.usage.metrics import UNKNOWN_MODEL, GatewayMetrics
from gateway.usage.recorder import UsageRecorder

Headers = list[tuple[bytes, bytes]]
Kind = Literal["chat", "completions"]
# serve's byte-changing steps on the parsed body (gateway/proxy/handler.py): whether the
# body changed; run after the hygiene scan, before the routing view is taken
Edit = Callable[[Inbound, dict[str, Any], Kind], bool]


class Turn:
    """One request's state in the flow."""

    __slots__ = ("ex", "finished", "ids_added", "plan", "replica", "ticket", "trace")

    def __init__(self, ex: Exchange, trace: Trace) -> None:
        self.ex = ex
        self.trace = trace  # its span (tracing on) and the context sent upstream
        self.plan: RoutePlan | None = None
        self.ticket: Ticket | None = None
        self.replica: Replica | None = None  # holds one in-flight count while set
        self.finished = False
        # a P/D decode leg asked for token ids the client did not (gateway.pd.tokenids)
        self.ids_added = False


@dataclass(slots=True)
class Prepared:
    """An inference request, parsed and checked, ready to be admitted."""

    endpoint: Endpoint
    inbound: Inbound
    kind: Kind
    view: dict[str, Any]  # what the router sees (the tenant's routing view)
    candidates: list[Replica]
    pin: str | None  # the replica a Responses continuation must go to
    changed: bool  # the body must be sent as re-serialized (not the client's bytes)
    # the replicas it may go to at all (a data plane's subset hint), None: any; the
    # admission queue binds a waiter within these only
    allowed: frozenset[str] | None = None

    @property
    def body(self) -> dict[str, Any]:
        return self.inbound.body


class RequestFlow:
    """The steps (module docstring); every collaborator given explicitly."""

    def __init__(self, *, fleet: Fleet, router: Router, analyzer: HygieneAnalyzer,
                 metrics: GatewayMetrics, recorder: UsageRecorder, auth: Authenticator,
                 gate: Gate, salts: TenantSalts, affinity: AffinityStore,
                 clock: Callable[[], float], timer: Callable[[], float],
                 tracer: RequestTracer | None = None) -> None:
        self.fleet = fleet
        self.tracer: RequestTracer = tracer or Passthrough()  # [tracing] (gateway.tracing)
        self.guard = DepthGuard()  # every body's depth proof (inbound.py)
        self.router = router
        self.analyzer = analyzer
        self.metrics = metrics
        self.recorder = recorder
        self.auth = auth
        self.gate = gate
        self.salts = salts
        self.affinity = affinity
        self.clock = clock  # wall time: records, routing
        self.timer = timer  # monotonic: latencies

    def begin(self, request_id: str, own_id: str, endpoint: str, method: str,
              trace_headers: Sequence[tuple[str, str]] = ()) -> Turn:
        """`request_id` names the request in records and logs (the client's when usable);
        `own_id` is what the engine is sent (serve's own random one); `trace_headers`: the
        client's `traceparent`/`tracestate`, continued by the request's span."""
        ex = Exchange(request_id, self.clock(), self.timer(), endpoint, method)
        ex.upstream_id = own_id
        return Turn(ex, self.tracer.begin(trace_headers, endpoint, method))

    def authorize(self, turn: Turn, authorization: bytes | None) -> None:
        turn.ex.tenant = self.auth.tenant(authorization)

    def prepare(self, turn: Turn, raw: bytes, endpoint: Endpoint, session: bytes | None, *,
                narrow: Callable[[list[Replica], str], list[Replica]] | None = None,
                allowed: frozenset[str] | None = None,
                edit: Edit | None = None) -> Prepared:
        """Parse and check the body once, scan it, and take the tenant's view of it.
        `narrow`: the transport's restriction of the candidates (a data plane's subset
        hint), `allowed` the names it allows of the whole fleet (what the admission queue
        binds a waiter within when it reads the fleet again); raises GatewayError (400,
        404, 503)."""
        ex = turn.ex
        inbound = parse_inbound(raw, endpoint, self.guard)
        body = inbound.body
        # before anything reads or sends it: only the gateway sets kv_transfer_params
        stripped = strip_gateway_only(body)
        # A name no replica serves is recorded (so labelled) as "unknown": bounded series.
        ex.model = inbound.model if self.fleet.known_model(inbound.model) else UNKNOWN_MODEL
        ex.stream = inbound.stream
        ex.session = resolve_session(session, body)
        candidates = self.fleet.candidates(inbound.model)
        if narrow is not None:
            candidates = narrow(candidates, inbound.model)
        kind, view = chat_view(endpoint, body)
        pin = (pinning.pinned(body, ex.tenant, self.affinity, self.fleet.replicas)
               if endpoint == "responses" else None)
        # The transport's edits (serve's hygiene rewrites) come first: the analyzer judges
        # the prompt the engine receives, so a tool order the gateway sorts (a key order it
        # canonicalizes) breaks nothing and is no finding, nor a remedy telling the operator
        # to set the rewrite that is set.
        changed = (edit(inbound, view, kind) if edit is not None else False) or stripped
        # parse_inbound has checked a chat or completions body more strictly than the
        # analyzer would; a converted view is checked again
        findings = self.analyzer.scan(view, kind, ex.session, ex.ts, validated=view is body,
                                      tenant=ex.tenant)
        # logged, summed up and shown in /stats from the usage record (UsageRecorder)
        ex.findings = findings
        for f in findings:
            self.metrics.hygiene_finding(f.kind, f.severity)
        if ex.tenant is not None:  # the tenant's own cache namespace (tenancy.py)
            salt = self.salts.engine(ex.tenant)
            if salt is not None:  # the engine's cache too: the client's salt overridden
                changed = changed or body.get("cache_salt") != salt
                body["cache_salt"] = salt
            view = self.salts.route_view(view, ex.tenant)
            ex.withheld = self.salts.withheld(ex.tenant, self.auth.admin_tenant(ex.tenant))
        return Prepared(endpoint, inbound, kind, view, candidates, pin, changed, allowed)

    async def admit(self, turn: Turn, prep: Prepared, priority_header: bytes | None,
                    program: ProgramId | None = None) -> Headers:
        """Wait for the gate's decision (queued, shed: `Shed`, a 429 with Retry-After;
        a client that goes away while queued cancels this await, and the gate takes it
        out of the queue); returns the headers for the client's answer."""
        ex = turn.ex
        try:  # the admission queue (off: Router.decide at once) decides when and where
            ticket = await self.gate.admit(Ask(
                prep.view, prep.kind, prep.inbound.model, ex.session, prep.pin, ex.tenant,
                priority_header, ex.ts, prep.allowed, program), prep.candidates)
        except ValueError as exc:  # NormalizeError: a body shape the engine would refuse too
            raise GatewayError(400, str(exc), code="invalid_request") from None
        turn.ticket = ticket
        plan = turn.plan = ticket.plan
        headers: Headers = []
        if ticket.queued_ms is not None:
            headers.append((b"x-gateway-queue-ms", b"%.1f" % ticket.queued_ms))
        # The client's `priority` never reaches the engine: the granted class's, or none
        # (a vLLM whose Messages endpoint takes no `priority` ignores it there).
        if priority.stamp(prep.body, ticket.engine_priority):
            prep.changed = True
        decision = plan.decision
        self.metrics.route_decision(decision.reason)
        if decision.move is not None:
            ex.moved = decision.move
            self.metrics.route_move(decision.move)
        ex.route, ex.predicted, ex.best = (
            decision.reason, decision.predicted_cached_tokens, decision.best_available_tokens)
        # decided by the index all tenants share (tenancy.py): not shown to this key
        route, shown = ((WITHHELD, None) if ex.withheld
                        else (decision.reason, decision.predicted_cached_tokens))
        headers.append((b"x-gateway-route", route.encode()))
        headers.extend(response_headers(route, shown, ex.findings,
                                        enabled=self.analyzer.config.header))
        self.bind(turn, decision.replica)
        return headers

    def bind(self, turn: Turn, name: str) -> Replica | None:
        """The request goes to `name` (one in-flight count there, none elsewhere); None
        when that replica has left the fleet (the count stays where it was)."""
        replica = self.fleet.replicas.get(name)
        if replica is None:
            return None
        old = turn.replica
        if old is not replica:
            if old is not None:
                old.in_flight -= 1
            replica.in_flight += 1
            turn.replica = replica
        turn.ex.replica = name
        return replica

    def moved(self, turn: Turn, name: str) -> Replica | None:
        """A retry, or a data plane's fallback, served it on `name`: the router moves its
        bookkeeping (the prompt's blocks, the session binding, the pending count) there,
        so the next turn goes where the cache now is; the in-flight count and the gate's
        count follow."""
        if turn.plan is not None:
            self.router.retried(turn.plan, name, self.clock())
        replica = self.bind(turn, name)
        if replica is not None and turn.ticket is not None:
            self.gate.moved(turn.ticket, name)  # the gate's count follows too
        return replica

    def remember_response(self, turn: Turn, response_id: str) -> None:
        """A Responses answer's id: its continuations go where it was made. Not when the
        server that made it is no longer the fleet's under that name (departed, or the
        name now another server's): the departure already forgot that server's responses,
        and a pin written now would send continuations to a server that never stored it."""
        if turn.ex.replica is not None and not self._gone(turn):
            pinning.remember(self.affinity, response_id, turn.ex.tenant, turn.ex.replica)

    def _gone(self, turn: Turn) -> bool:
        """Whether the replica `turn` was sent to is no longer the fleet's under its name
        (Fleet.current): what it answers teaches nothing of the server there now."""
        return turn.replica is not None and not self.fleet.current(turn.replica)

    def first_token(self, turn: Turn) -> None:
        if turn.plan is not None:
            turn.plan.outcome.first_token_at = self.clock()

    def finish(self, turn: Turn) -> None:
        """Once per request, whatever happened (order: module docstring)."""
        if turn.finished:
            return
        turn.finished = True
        ex = turn.ex
        plan = turn.plan
        if plan is not None:
            o, u = plan.outcome, ex.outcome.usage
            o.ok = ex.status < 400
            o.prompt_tokens = u.prompt_tokens if u else None
            # a decode leg reports the prefill replica's cached tokens (vLLM >= 0.32): they
            # do not judge the prediction on the decode replica (gateway.pd)
            o.cached_tokens = u.cached_tokens if u and ex.cached_from is None else None
            o.completion_tokens = u.completion_tokens if u else None
            # non-streamed answers, and streams collected for P/D reuse (gateway.pd.answer)
            o.reply_text = ex.outcome.reply_text
        sent_to = turn.replica
        gone = self._gone(turn)
        if sent_to is not None:
            sent_to.in_flight -= 1  # the count is the instance's own, whichever it is
            turn.replica = None
        try:
            if plan is not None and not gone:
                self.router.report(plan, self.clock())
        finally:
            if turn.ticket is not None:
                self.gate.done(turn.ticket, counted=not gone)
            record = ex.record(self.timer())
            self.recorder.record(record, departed=gone)
            ticket = turn.ticket
            self.tracer.end(turn.trace, record, ticket.cls if ticket else None,
                            ticket.queued_ms if ticket else None)

