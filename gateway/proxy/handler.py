"""The request path for proxied calls (design.md section 2), sequencing the pure parts:

    auth -> read body (bounded) -> parse + check once -> session -> candidates (404/503)
    -> hygiene scan/log/rewrite -> route -> forward (original bytes unless changed)
    -> relay (retry on the next ranked healthy replica only what never reached a replica)
    -> finally: one UsageRecord, one Router.report of the plan's outcome (with the reply
       text of a non-streamed answer, so the router indexes the answer the next turn
       repeats), in-flight released

The steps from parsing to the end (admission, priorities, the headers, the in-flight
count, the report and the record) are the request flow `gateway epp` shares
(gateway.proxy.flow.RequestFlow); this module owns the bytes: reading, serve's own body
edits (usage asked of a stream, hygiene rewrites), relaying and retries.

Cancellation: once the body is read, a watcher task waits for `http.disconnect`; when the
client goes, it cancels the request task, which closes the upstream connection at once
(the engine aborts the request and frees its KV blocks) and records status 499. The
in-flight count is released in a `finally`, never in a background task.

Retry rule (gateway.upstream.failure, one table): only a request that provably never
reached its replica (not delivered: refused, DNS, connect timeout) moves to the next healthy
replica of `Decision.ranked` (at most `server.retries` times), and the router is told of the
move (`Router.retried`). Anything delivered is never sent again: a replica's 4xx or 5xx is
relayed as is, a broken connection is a 502, a timeout a 504, a full connection pool (the
gateway's own congestion) a 503 with `Retry-After`. A not-delivered failure asks the monitor
to probe that replica now (`FleetMonitor.suspect`); only probes mark a replica down.

Responses (`/v1/responses`) and Messages (`/v1/messages`) bodies are routed and scanned as
the chat request vLLM renders from them (gateway.routing.responses_api / messages_api).
A Responses request that names a `previous_response_id` whose creator the gateway knows is
pinned to that replica (route `response`): no other replica holds the stored response.
If that replica left the fleet or is unhealthy, the gateway answers 404/503 saying so
instead of sending it where it can only fail. Each relayed Responses answer's id is
remembered with the replica that made it (`Services.affinity`).

P/D (gateway.proxy.pd_path): with `prefill` replicas in the fleet, a chat, completions,
Responses or Messages request (not one continuing a stored response) whose decode replica
(the router's decision) would leave enough of the prompt uncached takes a prefill leg
first; the decode leg is then this module's ordinary try on the
decision's ranking, whose failure before a byte (`pull`: PullFailed) lets the prefill
replica answer the whole request.

Other `/v1/*` calls and vLLM's own endpoints (`forward`) go to the least busy healthy
replica (never a `prefill` one) serving the body's `model` (any healthy replica without
one), relayed the same way, and are recorded too. A call on one stored response
(`GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`) goes to the replica
that created it when the gateway knows it (404/503 as above when that replica is gone or
down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from urllib.parse import quote

import orjson

from gateway.admission import priority
from gateway.admission.gate import Gate
from gateway.admission.priority import header_value as priority_header
from gateway.agents.programs import identify
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.pd.config import PdConfig
from gateway.pd.failures import PullFailed, prefill_instead
from gateway.pd.metrics import PdMetrics
from gateway.proxy import pinning
from gateway.proxy.asgi import ClientGone, Headers, Receive, Scope, Send, read_body, request_headers
from gateway.proxy.auth import Authenticator
from gateway.proxy.errors import GatewayError, UpstreamError, error_response, from_upstream
from gateway.proxy.exchange import Exchange
from gateway.proxy.flow import Kind, RequestFlow, Turn
from gateway.proxy.inbound import (
    Endpoint,
    Inbound,
    inject_usage,
    parse_json,
    strip_gateway_only,
)
from gateway.proxy.pd_path import PdPath
from gateway.proxy.relay import (
    RelayOutcome,
    relay,
    shutting_down,
    upstream_request_headers,
)
from gateway.proxy.target import client_request_id, forwarded_headers, upstream_target
from gateway.proxy.tenancy import TenantSalts
from gateway.replicas.fleet import Fleet, Replica, no_healthy
from gateway.replicas.monitor import FleetMonitor
from gateway.routing.affinity import AffinityStore
from gateway.routing.router import Router
from gateway.sessions import session_header
from gateway.settings import ServerSettings
from gateway.tracing import propagate
from gateway.tracing.tracer import RequestTracer
from gateway.upstream.counters import UpstreamCounters
from gateway.upstream.failure import answered, client_error, happened, verdict
from gateway.upstream.seam import Timeouts, Upstream, UpstreamResponse
from gateway.usage.metrics import UNKNOWN_MODEL, GatewayMetrics
from gateway.usage.recorder import UsageRecorder
from gateway.usage.sse import RESPONSES_FIRST_TOKEN

log = logging.getLogger("gateway.proxy.handler")

_WANTED = (b"x-request-id", b"authorization", b"content-length")


class Proxy:
    """The request path. Every collaborator is given explicitly; `clock` stamps records
    (wall time) and `timer` measures latencies (a monotonic clock), so tests can drive
    both."""

    def __init__(
        self, *, server: ServerSettings, fleet: Fleet, router: Router,
        analyzer: HygieneAnalyzer, metrics: GatewayMetrics, recorder: UsageRecorder,
        auth: Authenticator, monitor: FleetMonitor, upstream: Upstream,
        affinity: AffinityStore, clock: Callable[[], float], timer: Callable[[], float],
        counters: UpstreamCounters,
        gate: Gate, salts: TenantSalts | None = None, tracer: RequestTracer | None = None,
        pd: PdConfig | None = None,
    ) -> None:
        self.gate = gate  # admission: the gateway queue
        self.affinity = affinity  # Responses API: which replica created which response
        self.fleet = fleet
        self.router = router
        self.analyzer = analyzer
        self.metrics = metrics
        self.recorder = recorder
        self.auth = auth
        self.monitor = monitor
        self.upstream = upstream
        self.clock = clock
        self.timer = timer
        self.counters = counters
        self.retry_after_s = max(1, round(server.upstream_pool_wait_s))
        self.max_body = server.max_body_bytes
        self.body_idle_s = server.client_body_timeout_s
        self.retries = server.retries
        self.session_headers = tuple(h.lower().encode("latin-1") for h in server.session_headers)
        self.timeouts = Timeouts(connect_s=server.connect_timeout_s, read_s=server.read_timeout_s)
        # the inference request's bookkeeping, admission and priorities, as `gateway epp`'s
        self.flow = RequestFlow(
            fleet=fleet, router=router, analyzer=analyzer, metrics=metrics, recorder=recorder,
            auth=auth, gate=gate, salts=salts or TenantSalts((), ""), affinity=affinity,
            clock=clock, timer=timer, tracer=tracer)
        # prefill/decode legs, where the fleet has prefill replicas ([pd], gateway.pd)
        self.pd = PdPath(config=pd or PdConfig(), fleet=fleet, router=router, flow=self.flow,
                         upstream=upstream, monitor=monitor, counters=counters,
                         timeouts=self.timeouts, clock=clock,
                         metrics=PdMetrics(metrics.registry),
                         prefill_cap=(gate.config.replica_max_in_flight
                                      if gate.config.enabled else 0))

    @property
    def salts(self) -> TenantSalts:
        """Each tenant's cache namespace (the flow's)."""
        return self.flow.salts

    @salts.setter
    def salts(self, value: TenantSalts) -> None:
        self.flow.salts = value

    # the path ---------------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint | None,
                     ) -> None:
        """One proxied call: `endpoint` for the routed inference routes, None for any other
        `/v1/*` call (forwarded to the least busy replica serving its model)."""
        rid_h, auth_h, length_h = request_headers(scope, _WANTED)
        # The engine's id is always the gateway's own random one (vLLM builds its request
        # id from X-Request-Id: two clients choosing the same id must not collide there);
        # the client's id, when it sent a usable one, names the request in records and logs.
        own = os.urandom(16).hex()
        rid = client_request_id(rid_h) or own
        turn = self.flow.begin(rid, own, endpoint or scope["path"][:200], scope["method"],
                               propagate.from_raw(scope["headers"]))
        ex = turn.ex
        headers: Headers = [(b"x-request-id", rid.encode("latin-1")),
                            (b"x-gateway-request-id", own.encode())]
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        try:
            self.flow.authorize(turn, auth_h)
            # Checked before anything is read or routed; never the decoded scope["path"].
            ex.target = upstream_target(
                scope.get("raw_path") or quote(scope["path"]).encode(),
                scope.get("query_string", b""))
            # the client's trace context never goes as sent: the gateway span's (tracing
            # on) or the client's checked one (off) instead (gateway.tracing.propagate)
            ex.up_headers = propagate.upstream(forwarded_headers(scope["headers"]),
                                               turn.trace.upstream)
            raw = await read_body(receive, self.max_body, length_h, self.body_idle_s)
            watcher = asyncio.create_task(self._watch(receive, ex, task))
            if endpoint is None:
                await self._forward_other(scope, send, raw, turn, headers)
            else:
                await self._inference(scope, send, raw, endpoint, turn, headers)
        except GatewayError as err:
            ex.fail(err)
            if not ex.outcome.started:
                ex.done = True
                await error_response(err, headers)(scope, receive, send)
        except ClientGone:
            ex.status, ex.error = 499, "client disconnected"
        except asyncio.CancelledError:
            if not ex.disconnected:
                # the server's shutdown grace period is over; a stream was ended by the
                # relay, an answer not yet begun is refused here
                if not ex.outcome.started:
                    cut = shutting_down()
                    ex.fail(cut)
                    with contextlib.suppress(RuntimeError, OSError):
                        await error_response(cut, headers)(scope, receive, send)
                raise
            task.uncancel()
            ex.status, ex.error = 499, "client disconnected"
        finally:
            ex.done = True
            if watcher is not None:
                watcher.cancel()
            self.flow.finish(turn)  # report, gate, in-flight and record: once

    async def _watch(self, receive: Receive, ex: Exchange, task: asyncio.Task[None]) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not ex.done:
            ex.disconnected = True
            task.cancel()

    async def _inference(
        self, scope: Scope, send: Send, raw: bytes, endpoint: Endpoint, turn: Turn,
        headers: Headers,
    ) -> None:
        session = session_header(scope["headers"], self.session_headers)
        prep = self.flow.prepare(turn, raw, endpoint, session, edit=self._edit)
        program = identify(scope["headers"], prep.body, turn.ex.tenant)  # agent program
        headers.extend(await self.flow.admit(turn, prep, priority_header(scope["headers"]),
                                             program))
        payload = orjson.dumps(prep.body) if prep.changed else raw
        plan = turn.plan
        assert plan is not None
        strip = prep.inbound.stream and not prep.inbound.client_wants_usage

        async def attempts(body: bytes, ranked: tuple[str, ...], pull: bool) -> None:
            await self._attempts(scope, send, body, ranked, strip, turn, headers, pull=pull)

        if not await self.pd.serve(turn, prep, payload, headers, attempts):
            await self._attempts(scope, send, payload, plan.decision.ranked, strip, turn,
                                 headers)
        self.pd.answered(turn, prep)  # a decoder's params for the next turn ([pd])

    def _edit(self, inbound: Inbound, view: dict[str, object], kind: Kind) -> bool:
        """serve's own byte changes (the picker forwards the client's bytes): usage asked
        of a stream (stripped again on the way back), hygiene rewrites."""
        body = inbound.body
        changed = inject = inbound.stream and not inbound.client_wants_usage
        if inject:
            inject_usage(body)
        # Rewrites know the chat and completions shapes only.
        if view is body and self.analyzer.rewrite(body):
            changed = True
        return changed

    async def _forward_other(self, scope: Scope, send: Send, raw: bytes, turn: Turn,
                             headers: Headers) -> None:
        ex = turn.ex
        holder = pinning.stored_holder(scope["path"], scope["method"], ex.tenant,
                                       self.affinity, self.fleet.replicas)
        model = None
        if raw and scope["method"] != "GET":
            doc = parse_json(raw, self.flow.guard)
            if isinstance(doc, dict):
                if isinstance(doc.get("model"), str):
                    model = doc["model"]
                # vLLM's pooling, score, tokenize... bodies take `priority` too: no class
                # is granted here, so the engine's default (`normal`); and only the gateway
                # sets kv_transfer_params, on any endpoint (inbound.GATEWAY_ONLY)
                stripped = strip_gateway_only(doc)
                if priority.stamp(doc, None) or stripped:
                    raw = orjson.dumps(doc)
        if model is not None:
            ex.model = model if self.fleet.known_model(model) else UNKNOWN_MODEL
            candidates = self.fleet.candidates(model)
        else:
            candidates = self.fleet.serving()
            if not candidates:
                raise no_healthy(None)
        ranked = tuple(r.name for r in sorted(candidates, key=lambda r: r.in_flight))
        ex.route = "forward"
        if holder is not None:
            ranked, ex.route = (holder,), "response"
        headers.append((b"x-gateway-route", ex.route.encode()))
        await self._attempts(scope, send, raw or None, ranked, False, turn, headers)

    # forwarding -------------------------------------------------------------------------

    async def _attempts(
        self, scope: Scope, send: Send, payload: bytes | None, ranked: tuple[str, ...],
        strip: bool, turn: Turn, headers: Headers, *, pull: bool = False,
    ) -> None:
        """Try the ranked replicas in turn while a try was not delivered (`pull`: a decode
        leg, `_attempt`)."""
        failure: GatewayError | None = None
        fleet = self.fleet.replicas
        tries = 0
        for i, name in enumerate(ranked):
            replica = fleet.get(name)
            # A retry goes only to a replica still healthy now (the first was chosen so).
            if replica is None or (i and not replica.healthy):
                continue
            if tries > self.retries:
                break
            tries += 1
            if i:
                self.flow.moved(turn, name)  # the router told, the in-flight count moved
                self.counters.retried(name)
            else:
                self.flow.bind(turn, name)
            failure = await self._attempt(scope, send, payload, replica, strip, turn, headers,
                                          pull=pull)
            if failure is None:
                return
        if pull and failure is not None and prefill_instead("not_delivered", last=True):
            # the decode leg reached no decode replica (each try was not delivered): the
            # prefill replica answers it whole (gateway.pd.failures says why it may)
            raise PullFailed(name, "not_delivered")
        raise failure if failure is not None else no_healthy(turn.ex.model or None)

    async def _attempt(
        self, scope: Scope, send: Send, payload: bytes | None, replica: Replica,
        strip: bool, turn: Turn, headers: Headers, *, pull: bool = False,
    ) -> GatewayError | None:
        """One try on one replica: None when it answered the client, the error to answer
        when nothing reached the replica (the caller may try another), else raises. The
        in-flight count is the flow's (taken at the pick, moved, released at the end).
        `pull`: a P/D decode leg, whose failure before its answer's head raises PullFailed
        where gateway.pd.failures lets the prefill replica answer instead."""
        name, ex = replica.name, turn.ex
        resp: UpstreamResponse | None = None
        clean = False
        ex.outcome = outcome = RelayOutcome()
        try:
            up_headers = upstream_request_headers(ex.up_headers, ex.upstream_id,
                                                  replica.upstream_headers)
            try:
                resp = await self.upstream.send(scope["method"], replica.url + ex.target,
                                                up_headers, payload, self.timeouts)
            except UpstreamError as exc:
                what = happened(exc)
                self.counters.failure(name, what)
                rule = verdict(what)
                if rule.suspect:
                    self.monitor.suspect(replica)
                if pull and prefill_instead(what):
                    raise PullFailed(name, what) from None
                error = client_error(exc, None if ex.withheld else name, self.retry_after_s)
                if rule.retry:
                    return error
                raise error from None
            status_class = answered(resp.status)
            if status_class is not None:
                self.counters.failure(name, status_class)  # relayed as is (the table)
                if pull and prefill_instead(status_class):
                    raise PullFailed(name, status_class)  # dropped unread (`finally`)
            await self._relay(send, resp, replica, strip, turn, headers, outcome, pull=pull)
            clean = outcome.error is None
            return None
        finally:
            ex.done = ex.done or clean
            if resp is not None:
                if clean:
                    resp.release()
                else:
                    resp.abort()  # cancelled or broken: drop the connection, engine aborts

    async def _relay(
        self, send: Send, resp: UpstreamResponse, replica: Replica, strip: bool, turn: Turn,
        headers: Headers, outcome: RelayOutcome, *, pull: bool = False,
    ) -> None:
        """Relay one answer. `pull` (a decode leg): a failure before anything went to the
        client (a whole JSON answer cut after its head: the relay reads it whole first) is
        the failure table's "broken before any answer" and raises PullFailed."""
        name, ex = replica.name, turn.ex
        extra = headers if ex.withheld else [*headers, (b"x-gateway-replica", name.encode())]
        responses = ex.endpoint == "responses"
        try:
            await relay(resp, send, extra, strip_usage=strip,
                        replica=None if ex.withheld else name, outcome=outcome,
                        on_first_byte=lambda: self.flow.first_token(turn), timer=self.timer,
                        on_response_id=((lambda rid: self.flow.remember_response(turn, rid))
                                        if responses else None),
                        first_token=RESPONSES_FIRST_TOKEN if responses else None,
                        collect_reply=self.pd.collects(ex.endpoint),
                        collect_ids=self.pd.reads_ids(turn, ex.endpoint),
                        strip_ids=turn.ids_added)
        except UpstreamError as exc:  # nothing sent yet: delivered, no usable answer
            what = happened(exc)
            self.counters.failure(name, what)
            if pull and prefill_instead(what):  # relay raises only before any byte went
                raise PullFailed(name, what) from None
            raise from_upstream(exc, None if ex.withheld else name) from None
        ex.status = outcome.status
        if outcome.error is not None:
            ex.fail(outcome.error)

