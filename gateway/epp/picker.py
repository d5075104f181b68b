"""The endpoint picker's request path: what `gateway serve`'s handler does before and after
relaying, without relaying (Envoy moves the bytes). No gRPC here (gateway.epp.server owns
the wire); the collaborators are `gateway serve`'s own (`gateway.proxy.app.Services`), and
the request's bookkeeping, admission and priorities are serve's own request flow
(gateway.proxy.flow.RequestFlow), so the two cannot drift.

    start (request headers: the flow begun, auth, session and priority headers)
    -> route (request body: the flow's prepare (with the data plane's subset hint) and
       admit, awaited: a request the admission queue holds keeps its ext_proc stream
       open until it is bound, and leaves the queue when that stream closes; shed is a
       429 with Retry-After; the body to forward instead when the flow changed it)
    -> response_started (response headers: status, served endpoint; a fallback that
       served it is the flow's `moved`)
    -> response_body (chunks, when read: usage, reply text, a Responses answer's id)
    -> finish (the flow's: once)

Differences from `gateway serve`, each because the EPP relays no bytes: a stream's usage
chunk is not asked for (`stream_options.include_usage` is the client's choice: asking
would need the EPP to strip it from the stream again, chunk by chunk); a hygiene rewrite
is not applied. The body is changed only where serve's flow changes it for every
transport (the granted class's `priority` stamped or the client's removed, the tenant's
engine `cache_salt`): the data plane then forwards the picker's body (gateway.epp.stream).
A Responses answer's id is remembered, so its continuations are pinned, when the picker
reads that answer's body (`[epp] response`: a JSON answer under "json", the default,
a stream under "body"); a call on one stored response (`GET`/`DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel`) goes to the replica that created
it, with no fallback, as in serve (gateway.proxy.pinning: 404 when it left, 503 when it is
down, another tenant's id a 404).
A record whose body the EPP does not read (a stream under "json"; everything under
"headers") has no token counts; it still ends, and releases its in-flight count, when the
response does: Envoy closes the ext_proc stream then (`finish(cut=True)`). A stream's
first token: `stream_chunk` (docs/deployment/kubernetes.md, "A stream's first token").
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

import orjson

from gateway.admission import priority
from gateway.epp import decision
from gateway.proxy import pinning
from gateway.proxy.errors import GatewayError
from gateway.proxy.exchange import Exchange
from gateway.proxy.flow import RequestFlow, Turn
from gateway.proxy.inbound import Endpoint, parse_json
from gateway.proxy.services import Services
from gateway.proxy.target import client_request_id
from gateway.replicas.fleet import Replica, no_healthy
from gateway.routing.plan import RoutePlan
from gateway.settings import EppSettings
from gateway.tracing import propagate
from gateway.usage.extract import parse_answer
from gateway.usage.metrics import UNKNOWN_MODEL
from gateway.usage.sse import RESPONSES_FIRST_TOKEN, SseUsageTap, first_token_in

log = logging.getLogger("gateway.epp")

# The inference routes routed by prefix and accounted (POST only), as `gateway serve`.
ROUTED: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions",
    "/v1/responses": "responses", "/v1/messages": "messages",
}
MAX_PATH_CHARS = 200
PRIORITY = "x-gateway-priority"  # admission.priority.HEADER, as the data plane names it
Headers = list[tuple[str, str]]


class Flow:
    """One request's state between the ext_proc messages; the request flow's own state
    (plan, ticket, in-flight replica, finished) is its `turn`."""

    __slots__ = ("added", "endpoint", "holder", "priority_h", "remembered", "responded",
                 "session_h", "sse", "tap", "turn", "wants_body")

    def __init__(self, turn: Turn, endpoint: Endpoint | None, session_h: str | None,
                 priority_h: str | None) -> None:
        self.turn = turn
        self.endpoint = endpoint
        self.session_h = session_h
        self.priority_h = priority_h
        self.added: Headers = [("x-request-id", turn.ex.request_id)]  # for the client's answer
        self.tap: SseUsageTap | None = None
        self.sse = False
        self.wants_body = False
        self.responded = False  # the response headers arrived
        self.remembered = False  # a Responses stream's id was remembered
        # a call on one stored response: the replica that created it (pinning.stored_holder)
        self.holder: str | None = None

    @property
    def ex(self) -> Exchange:
        return self.turn.ex

    @property
    def plan(self) -> RoutePlan | None:
        return self.turn.plan

    @property
    def replica(self) -> Replica | None:
        return self.turn.replica

    @property
    def finished(self) -> bool:
        return self.turn.finished


@dataclass(frozen=True, slots=True)
class Routed:
    """The pick (the destination header's value) and the request body to send instead of
    the client's (None: the client's bytes go as they are)."""

    destination: str
    body: bytes | None = None
    # the trace context the replica is sent (set on the request: the gateway span's, or
    # the client's checked one), and the trace headers removed (a client's, unchecked)
    trace: tuple[tuple[str, str], ...] = ()
    untrace: tuple[str, ...] = ()


class Picker:
    def __init__(self, services: Services, epp: EppSettings,
                 timer: Callable[[], float]) -> None:
        self.s = services
        self.epp = epp
        self.timer = timer
        self.retries = services.settings.server.retries
        assert services.gate is not None  # built with the services (GatewayApp.startup)
        # bookkeeping, admission and priorities: `gateway serve`'s own (gateway.proxy.flow)
        self.flow = RequestFlow(
            fleet=services.fleet, router=services.router, analyzer=services.analyzer,
            metrics=services.metrics, recorder=services.recorder, auth=services.auth,
            gate=services.gate, salts=services.salts, affinity=services.affinity,
            clock=services.clock, timer=timer, tracer=services.tracer)
        # the session headers gateway serve reads, in its order (`[server] session_headers`)
        self.session_headers = tuple(h.lower() for h in services.settings.server.session_headers)
        # replica name <-> endpoint (ip:port), from the configured URLs; a host name is
        # replaced by its address (`set_endpoints`, gateway.epp.run resolves them)
        self.endpoints: dict[str, str] = {}
        self.by_endpoint: dict[str, str] = {}
        self.set_endpoints({name: decision.endpoint_of(r.url)
                            for name, r in services.fleet.replicas.items()})
        self._rid_prefix = os.urandom(8).hex()
        self._rid_seq = itertools.count(1)

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        self.endpoints = dict(endpoints)
        self.by_endpoint = {ep: name for name, ep in self.endpoints.items()}

    # request ---------------------------------------------------------------------------

    def start(self, headers: Mapping[str, str]) -> Flow:
        """The request headers arrived. Raises GatewayError (a bad key; a stored response
        whose replica left or is down, or another tenant's), already recorded."""
        flow = self.begin(headers)
        self.check(flow, headers)
        return flow

    def begin(self, headers: Mapping[str, str]) -> Flow:
        """The request's flow, its id named (raises nothing: an answer refusing it at its
        headers carries that id too, `check`)."""
        raw_rid = headers.get("x-request-id")
        rid = (client_request_id(raw_rid.encode("latin-1")) if raw_rid else None) or (
            f"{self._rid_prefix}{next(self._rid_seq):016x}")
        path = _path(headers)
        method = headers.get(":method", "GET")
        endpoint = ROUTED.get(path) if method == "POST" else None
        # the engine is sent what the data plane forwards: the client's id, as named here
        turn = self.flow.begin(rid, rid, endpoint or path[:MAX_PATH_CHARS], method[:16], [
            (k, v) for k in propagate.TRACE_HEADERS if (v := headers.get(k)) is not None])
        return Flow(turn, endpoint, next(
            (v for v in map(headers.get, self.session_headers) if v and v.strip()), None),
            headers.get(PRIORITY))

    def check(self, flow: Flow, headers: Mapping[str, str]) -> None:
        """The key's tenant, and the replica a call on one stored response must go to.
        Raises GatewayError (401, 404, 503), already recorded."""
        turn = flow.turn
        auth = headers.get("authorization")
        try:
            self.flow.authorize(turn, auth.encode("latin-1") if auth else None)
            # as serve: a call on one stored response goes to the replica holding it
            flow.holder = pinning.stored_holder(
                _path(headers), headers.get(":method", "GET"), turn.ex.tenant,
                self.s.affinity, self.s.fleet.replicas)
        except GatewayError as err:
            self.fail(flow, err)
            raise

    async def route(self, flow: Flow, raw: bytes | None, hint: frozenset[str] | None,
                    ) -> Routed:
        """Pick the replica (waiting in the admission queue when it is on: the ext_proc
        stream is held until then, and its closing cancels the wait). Raises GatewayError
        (400, 404, 429 with Retry-After, 503), already recorded."""
        try:
            if flow.endpoint is not None and raw is not None:
                routed = await self._inference(flow, raw, hint)
            else:
                routed = self._forward(flow, raw, hint)
        except GatewayError as err:
            self.fail(flow, err)
            raise
        # the data plane forwards the client's headers: its trace context is replaced
        trace = flow.turn.trace.upstream
        kept = {k for k, _ in trace}
        return dataclasses.replace(routed, trace=trace, untrace=tuple(
            sorted(propagate.TRACE_HEADERS - kept)))

    async def _inference(self, flow: Flow, raw: bytes, hint: frozenset[str] | None,
                         ) -> Routed:
        endpoint = flow.endpoint
        assert endpoint is not None
        turn = flow.turn
        # the hint, by replica name, over the whole fleet: a waiter in the admission queue
        # is bound within it (also to one that was down on arrival and came back)
        allowed = (None if hint is None else frozenset(
            decision.restrict(list(self.s.fleet.replicas), self.endpoints, hint)))
        prep = self.flow.prepare(
            turn, raw, endpoint, flow.session_h.encode("latin-1") if flow.session_h else None,
            narrow=lambda found, model: self._candidates(found, hint, model), allowed=allowed)
        added = await self.flow.admit(
            turn, prep, flow.priority_h.encode("latin-1") if flow.priority_h else None)
        flow.added.extend((k.decode("latin-1"), v.decode("latin-1")) for k, v in added)
        assert turn.plan is not None
        usable = [r.name for r in prep.candidates]
        destination = self._pick(flow, turn.plan.decision.ranked, usable, hint)
        # the body changed (the granted class stamped, the client's `priority` removed,
        # the tenant's engine salt): the data plane forwards the picker's body instead
        return Routed(destination, orjson.dumps(prep.body) if prep.changed else None)

    def _forward(self, flow: Flow, raw: bytes | None, hint: frozenset[str] | None) -> Routed:
        """Any other call: the least busy healthy replica serving the body's model."""
        model, body = None, None
        if raw:
            doc = parse_json(raw, self.flow.guard)
            if isinstance(doc, dict):
                if isinstance(doc.get("model"), str):
                    model = doc["model"]
                # as serve: vLLM's pooling, score, tokenize... bodies take `priority` too,
                # and no class is granted here (the engine's default)
                if priority.stamp(doc, None):
                    body = orjson.dumps(doc)
        if model is not None:
            flow.ex.model = model if self.s.fleet.known_model(model) else UNKNOWN_MODEL
            found = self.s.fleet.candidates(model)
        else:
            found = self.s.fleet.healthy()
        replicas = self._candidates(found, hint, model)
        ranked = tuple(r.name for r in sorted(replicas, key=lambda r: r.in_flight))
        flow.ex.route = "forward"
        if flow.holder is not None:  # no other replica holds it: no fallback either
            ranked, flow.ex.route = (flow.holder,), "response"
        flow.added.append(("x-gateway-route", flow.ex.route))
        return Routed(self._pick(flow, ranked, ranked, hint), body)

    def _candidates(self, found: list[Replica], hint: frozenset[str] | None,
                    model: str | None) -> list[Replica]:
        if not found:
            raise no_healthy(model)
        if hint is None:
            return found
        allowed = set(decision.restrict([r.name for r in found], self.endpoints, hint))
        kept = [r for r in found if r.name in allowed]
        if not kept:
            raise decision.no_ready_endpoint(hinted=True)
        return kept

    def _pick(self, flow: Flow, ranked: Sequence[str], usable: Sequence[str],
              hint: frozenset[str] | None) -> str:
        """The destination: the first ranked replica still in the fleet with a known
        endpoint, within the hint (a request that waited in the queue is decided among
        the fleet as it is then: its pick may have left since, or lie outside the hint
        the data plane sent); a pick other than the decision's is a move (the router
        told, the in-flight count moved). None left: 503."""
        turn = flow.turn
        fleet = self.s.fleet.replicas
        allowed = [n for n in ranked if n in fleet and n in self.endpoints
                   and (hint is None or self.endpoints[n] in hint)]
        if not allowed:
            raise decision.no_ready_endpoint(hinted=hint is not None)
        name = allowed[0]
        if turn.plan is not None and name != turn.plan.decision.replica:
            self.flow.moved(turn, name)
        else:
            self.flow.bind(turn, name)
        return decision.destination(allowed, self.endpoints, usable, self.retries)

    # response --------------------------------------------------------------------------

    def response_started(self, flow: Flow, status: int, served: str | None,
                         content_type: str, *, unreachable: bool = False,
                         body_follows: bool = False) -> Headers:
        """The response headers arrived; returns the headers to add to them. Sets whether
        the body is wanted (`flow.wants_body`). `unreachable`: Envoy could reach no
        upstream it tried (code details); `body_follows`: the chunks reach the picker
        whatever it asks (full duplex): a stream's first token is in one (`stream_chunk`)."""
        ex = flow.ex
        ex.status = status
        flow.responded = True
        name = decision.replica_for(served, self.by_endpoint)
        if flow.replica is not None and unreachable:
            # the pick (and the last one tried) are probed now, as in `gateway serve` when
            # a request could not be delivered: only probes mark a replica down
            self.s.monitor.suspect(flow.replica)
            last = self.s.fleet.replicas.get(name) if name is not None else None
            if last is not None and last is not flow.replica:
                self.s.monitor.suspect(last)
        elif (name is not None and flow.replica is not None and name != flow.replica.name
              and name in self.s.fleet.replicas):
            # Envoy retried on a fallback, which its retry policy does only when the pick
            # could not be reached: the pick is probed now (only probes mark it down), and
            # the request moves where it was served (the router told, as `gateway serve`
            # does when it retries: the next turn goes where the cache now is)
            self.s.monitor.suspect(flow.replica)
            self.flow.moved(flow.turn, name)
        if flow.replica is not None and not ex.withheld:  # as serve's x-gateway-replica
            flow.added.append(("x-gateway-replica", flow.replica.name))
        flow.sse = content_type.startswith("text/event-stream")
        mode = self.epp.response
        flow.wants_body = status == 200 and (
            mode == "body" or (mode == "json" and not flow.sse))
        if flow.wants_body and flow.sse:
            flow.tap = SseUsageTap(strip=False)
        elif not (body_follows and flow.sse and status == 200):
            # the headers: all the picker gets. An engine sends them before its prefill,
            # so they end the queued prefill (Router.first_token) while the replica is
            # still prefilling; where the chunks pass through, `stream_chunk` waits
            self._first_byte(flow)
        return flow.added

    def stream_chunk(self, flow: Flow, chunk: bytes) -> None:
        """A chunk of a stream, read or not (`body_follows`): the first one with bytes is
        its first token, after the headers that an engine sends before its prefill; a
        Responses stream's, the first with a delta (its `response.created` comes with the
        headers: `RESPONSES_FIRST_TOKEN`, as in serve)."""
        markers = RESPONSES_FIRST_TOKEN if flow.endpoint == "responses" else None
        if flow.ex.outcome.first_byte is None and first_token_in(chunk, markers):
            self._first_byte(flow)

    def _first_byte(self, flow: Flow) -> None:
        if flow.ex.outcome.first_byte is None:
            flow.ex.outcome.first_byte = self.timer()
            self.flow.first_token(flow.turn)

    def response_body(self, flow: Flow, chunk: bytes, end: bool) -> None:
        """A chunk of the body (a JSON answer comes whole, in one call)."""
        responses = flow.endpoint == "responses" and not flow.remembered
        tap = flow.tap
        if tap is not None:
            self.stream_chunk(flow, chunk)
            if chunk:
                tap.feed(chunk)
                if responses and tap.response_id is not None:
                    # a continuation goes where this answer is stored, as in serve
                    self.flow.remember_response(flow.turn, tap.response_id)
                    flow.remembered = True
            if end:
                tap.finish()
                flow.ex.outcome.usage = tap.usage
        else:
            # A JSON answer comes once: whole, or (larger than Envoy's buffer limit) its
            # first part only, which holds no usage to read; either way the record ends here.
            if end and chunk:
                answer = parse_answer(chunk)
                flow.ex.outcome.usage = answer.usage
                flow.ex.outcome.reply_text = answer.text
                if responses and answer.response_id is not None:
                    self.flow.remember_response(flow.turn, answer.response_id)
            self.finish(flow)
            return
        if end:
            self.finish(flow)

    # the end ---------------------------------------------------------------------------

    def fail(self, flow: Flow, err: GatewayError) -> None:
        flow.ex.fail(err)
        self.finish(flow)

    def finish(self, flow: Flow, *, cut: bool = False) -> None:
        """Once per request, whatever happened: `cut` when the data plane closed the
        stream before the response was over (client gone, or headers-only reading)."""
        if flow.finished:
            return
        ex = flow.ex
        if cut and (flow.wants_body or not flow.responded):
            ex.status, ex.error = 499, "the stream ended before the response did"
        self.flow.finish(flow.turn)


def _path(headers: Mapping[str, str]) -> str:
    """The request's path, decoded as `gateway serve` reads it (uvicorn's scope["path"])
    and as the engine routes it: `/v1/chat%2Fcompletions` is the chat route, not a call
    to forward."""
    return unquote(headers.get(":path", "/").split("?", 1)[0])
