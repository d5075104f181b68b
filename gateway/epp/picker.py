"""The endpoint picker's request path: what `gateway serve`'s handler does before and after
relaying, without relaying (Envoy moves the bytes). No gRPC here (gateway.epp.server owns
the wire); the collaborators are `gateway serve`'s own (`gateway.proxy.app.Services`:
fleet and its monitor, router, hygiene analyzer, metrics, usage recorder, token mode and
shared state), built from the same settings.

    start (request headers: auth, request id, session header, route kind)
    -> route (request body: parse + check once, hygiene, subset hint, shed, Router.decide)
    -> response_started (response headers: status, served endpoint, retry moved it?)
    -> response_body (chunks, only when `[epp] response = "body"`: usage, reply text)
    -> finish (once: Router.report, one UsageRecord, in-flight released)

Differences from `gateway serve`, each because the EPP relays no bytes: a stream's usage
chunk is not asked for (`stream_options.include_usage` is the client's choice: asking
would need the EPP to strip it from the stream again, chunk by chunk); a hygiene rewrite
is not applied (it would change the body Envoy forwards); a Responses API continuation is
routed like any request (its creator is not remembered: that needs every answer's id).
A record whose body the EPP does not read (`[epp] response`: a stream under "json", the
default; everything under "headers") has no token counts; it still ends, and releases its
in-flight count, when the response does: Envoy closes the ext_proc stream then
(`finish(cut=True)`).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from gateway.epp import decision
from gateway.proxy.app import Services
from gateway.proxy.errors import GatewayError
from gateway.proxy.exchange import Exchange
from gateway.proxy.headers import response_headers
from gateway.proxy.inbound import Endpoint, chat_view, parse_inbound, parse_json
from gateway.proxy.session import resolve_session
from gateway.proxy.target import client_request_id
from gateway.proxy.tenancy import routing_salt, salted
from gateway.replicas.fleet import Replica, no_healthy
from gateway.routing.plan import RoutePlan
from gateway.settings import EppSettings
from gateway.usage.extract import parse_answer
from gateway.usage.metrics import UNKNOWN_MODEL
from gateway.usage.sse import SseUsageTap

log = logging.getLogger("gateway.epp")

# The inference routes routed by prefix and accounted (POST only), as `gateway serve`.
ROUTED: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions",
    "/v1/responses": "responses", "/v1/messages": "messages",
}
MAX_PATH_CHARS = 200
Headers = list[tuple[str, str]]


class Flow:
    """One request's state between the ext_proc messages."""

    __slots__ = ("added", "endpoint", "ex", "finished", "plan", "replica", "responded",
                 "session_h", "sse", "tap", "wants_body")

    def __init__(self, ex: Exchange, endpoint: Endpoint | None, session_h: str | None) -> None:
        self.ex = ex
        self.endpoint = endpoint
        self.session_h = session_h
        self.plan: RoutePlan | None = None
        self.replica: Replica | None = None  # holds one in-flight count while set
        self.added: Headers = [("x-request-id", ex.request_id)]  # for the client's answer
        self.tap: SseUsageTap | None = None
        self.sse = False
        self.wants_body = False
        self.responded = False  # the response headers arrived
        self.finished = False


class Picker:
    def __init__(self, services: Services, epp: EppSettings,
                 timer: Callable[[], float]) -> None:
        self.s = services
        self.epp = epp
        self.timer = timer
        self.retries = services.settings.server.retries
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
        """The request headers arrived. Raises GatewayError (a bad key)."""
        raw_rid = headers.get("x-request-id")
        rid = (client_request_id(raw_rid.encode("latin-1")) if raw_rid else None) or (
            f"{self._rid_prefix}{next(self._rid_seq):016x}")
        path = headers.get(":path", "/").split("?", 1)[0]
        method = headers.get(":method", "GET")
        endpoint = ROUTED.get(path) if method == "POST" else None
        ex = Exchange(rid, self.s.clock(), self.timer(), endpoint or path[:MAX_PATH_CHARS],
                      method[:16])
        flow = Flow(ex, endpoint, next(
            (v for v in map(headers.get, self.session_headers) if v and v.strip()), None))
        auth = headers.get("authorization")
        try:
            ex.tenant = self.s.auth.tenant(auth.encode("latin-1") if auth else None)
        except GatewayError as err:
            self.fail(flow, err)
            raise
        return flow

    def route(self, flow: Flow, raw: bytes | None, hint: frozenset[str] | None) -> str:
        """Pick the replica; returns the destination header value. Raises GatewayError
        (400, 404, 429, 503), already recorded."""
        try:
            if flow.endpoint is not None and raw is not None:
                return self._inference(flow, raw, hint)
            return self._forward(flow, raw, hint)
        except GatewayError as err:
            self.fail(flow, err)
            raise

    def _inference(self, flow: Flow, raw: bytes, hint: frozenset[str] | None) -> str:
        s, ex, endpoint = self.s, flow.ex, flow.endpoint
        assert endpoint is not None
        inbound = parse_inbound(raw, endpoint)
        body = inbound.body
        ex.model = inbound.model if s.fleet.known_model(inbound.model) else UNKNOWN_MODEL
        ex.stream = inbound.stream
        ex.session = resolve_session(
            flow.session_h.encode("latin-1") if flow.session_h else None, body)
        replicas = self._candidates(s.fleet.candidates(inbound.model), hint, inbound.model)
        kind, view = chat_view(endpoint, body)
        self._hygiene(flow, view, kind)
        states = [r.state() for r in replicas]
        if decision.should_shed(states, self.epp.shed_in_flight):
            raise decision.shed_error()
        if ex.tenant is not None:  # the index keyed by tenant (gateway.proxy.tenancy)
            view = salted(view, routing_salt(ex.tenant, view.get("cache_salt")))
        try:
            plan = s.router.decide(view, kind, inbound.model, ex.session, states, ex.ts,
                                   tenant=ex.tenant)
        except ValueError as exc:  # NormalizeError: a body shape the engine would refuse too
            raise GatewayError(400, str(exc), code="invalid_request") from None
        d = plan.decision
        s.metrics.route_decision(d.reason)
        if d.move is not None:
            ex.moved = d.move
            s.metrics.route_move(d.move)
        ex.route, ex.predicted, ex.best = (
            d.reason, d.predicted_cached_tokens, d.best_available_tokens)
        flow.plan = plan
        flow.added.append(("x-gateway-route", d.reason))
        flow.added.extend(
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in response_headers(
                d.reason, d.predicted_cached_tokens, ex.findings,
                enabled=s.analyzer.config.header))
        return self._pick(flow, d.ranked, [r.name for r in replicas])

    def _forward(self, flow: Flow, raw: bytes | None, hint: frozenset[str] | None) -> str:
        """Any other call: the least busy healthy replica serving the body's model."""
        model = None
        if raw:
            doc = parse_json(raw)
            if isinstance(doc, dict) and isinstance(doc.get("model"), str):
                model = doc["model"]
        if model is not None:
            flow.ex.model = model if self.s.fleet.known_model(model) else UNKNOWN_MODEL
            found = self.s.fleet.candidates(model)
        else:
            found = self.s.fleet.healthy()
        replicas = self._candidates(found, hint, model)
        ranked = tuple(r.name for r in sorted(replicas, key=lambda r: r.in_flight))
        flow.ex.route = "forward"
        flow.added.append(("x-gateway-route", "forward"))
        return self._pick(flow, ranked, ranked)

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

    def _pick(self, flow: Flow, ranked: Sequence[str], usable: Sequence[str]) -> str:
        name = ranked[0]
        replica = self.s.fleet.replicas[name]
        replica.in_flight += 1
        flow.replica = replica
        flow.ex.replica = name
        return decision.destination(ranked, self.endpoints, usable, self.retries)

    def _hygiene(self, flow: Flow, view: dict[str, object],
                 kind: Literal["chat", "completions"]) -> None:
        s, ex = self.s, flow.ex
        findings = s.analyzer.scan(view, kind, ex.session, ex.ts, validated=flow.endpoint in (
            "chat", "completions"), tenant=ex.tenant)
        # logged, summed up and shown in /stats from the usage record (UsageRecorder)
        ex.findings = findings
        for f in findings:
            s.metrics.hygiene_finding(f.kind, f.severity)

    # response --------------------------------------------------------------------------

    def response_started(self, flow: Flow, status: int, served: str | None,
                         content_type: str, *, unreachable: bool = False) -> Headers:
        """The response headers arrived; returns the headers to add to them. Sets whether
        the body is wanted (`flow.wants_body`). `unreachable`: Envoy could reach no
        upstream it tried (it says so in the response's code details)."""
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
        elif name is not None and flow.replica is not None and name != flow.replica.name:
            # Envoy retried on a fallback, which its retry policy does only when the pick
            # could not be reached: the pick is probed now (only probes mark it down).
            self.s.monitor.suspect(flow.replica)
            self._moved(flow, name)
        if flow.replica is not None:
            flow.added.append(("x-gateway-replica", flow.replica.name))
        flow.sse = content_type.startswith("text/event-stream")
        mode = self.epp.response
        flow.wants_body = status == 200 and (
            mode == "body" or (mode == "json" and not flow.sse))
        if flow.wants_body and flow.sse:
            flow.tap = SseUsageTap(strip=False)
        else:
            self._first_byte(flow)
        return flow.added

    def _moved(self, flow: Flow, name: str) -> None:
        old = flow.replica
        new = self.s.fleet.replicas.get(name)
        if old is None or new is None:
            return
        old.in_flight -= 1
        new.in_flight += 1
        flow.replica = new
        flow.ex.replica = name
        if flow.plan is not None:
            # the router moves its bookkeeping (the prompt's blocks, the session binding,
            # the pending count) to where the request was served, as `gateway serve` does
            # when it retries: the next turn goes where the cache now is
            self.s.router.retried(flow.plan, name, self.s.clock())

    def _first_byte(self, flow: Flow) -> None:
        if flow.ex.outcome.first_byte is None:
            flow.ex.outcome.first_byte = self.timer()
            if flow.plan is not None:
                flow.plan.outcome.first_token_at = self.s.clock()

    def response_body(self, flow: Flow, chunk: bytes, end: bool) -> None:
        """A chunk of the body (a JSON answer comes whole, in one call)."""
        if flow.tap is not None:
            if chunk:
                self._first_byte(flow)
                flow.tap.feed(chunk)
            if end:
                flow.tap.finish()
                flow.ex.outcome.usage = flow.tap.usage
        else:
            # A JSON answer comes once: whole, or (larger than Envoy's buffer limit) its
            # first part only, which holds no usage to read; either way the record ends here.
            if end and chunk:
                answer = parse_answer(chunk)
                flow.ex.outcome.usage = answer.usage
                flow.ex.outcome.reply_text = answer.text
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
        flow.finished = True
        ex = flow.ex
        if cut and (flow.wants_body or not flow.responded):
            ex.status, ex.error = 499, "the stream ended before the response did"
        if flow.replica is not None:
            flow.replica.in_flight -= 1
        plan = flow.plan
        if plan is not None:
            o, u = plan.outcome, ex.outcome.usage
            o.ok = ex.status < 400
            o.prompt_tokens = u.prompt_tokens if u else None
            o.cached_tokens = u.cached_tokens if u else None
            o.completion_tokens = u.completion_tokens if u else None
            o.reply_text = ex.outcome.reply_text
            self.s.router.report(plan, self.s.clock())
        self.s.recorder.record(ex.record(self.timer()))
