"""The request path for proxied calls (design.md section 2), sequencing the pure parts:

    auth -> read body (bounded) -> parse + check once -> session -> candidates (404/503)
    -> hygiene scan/log/rewrite -> route -> forward (original bytes unless changed)
    -> relay (retry on the next ranked healthy replica only what never reached a replica)
    -> finally: one UsageRecord, one Router.report of the plan's outcome (with the reply
       text of a non-streamed answer, so the router indexes the answer the next turn
       repeats), in-flight released

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

Other `/v1/*` calls and vLLM's own endpoints (`forward`) go to the least busy healthy
replica serving the body's `model` (any healthy replica without one), relayed the same way,
and are recorded too. A call on one stored response (`GET`/`DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`) goes to the replica that created it when the gateway knows
it (404/503 as above when that replica is gone or down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

import orjson

from gateway.admission import priority
from gateway.admission.gate import Ask, Gate
from gateway.admission.priority import header_value as priority_header
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.proxy.asgi import ClientGone, Headers, Receive, Scope, Send, read_body, request_headers
from gateway.proxy.auth import Authenticator
from gateway.proxy.errors import GatewayError, UpstreamError, error_response, from_upstream
from gateway.proxy.exchange import Exchange
from gateway.proxy.headers import response_headers
from gateway.proxy.inbound import Endpoint, chat_view, inject_usage, parse_inbound, parse_json
from gateway.proxy.relay import RelayOutcome, relay, shutting_down, upstream_request_headers
from gateway.proxy.session import resolve_session, session_header
from gateway.proxy.target import client_request_id, forwarded_headers, upstream_target
from gateway.proxy.tenancy import WITHHELD, TenantSalts
from gateway.replicas.fleet import Fleet, Replica, no_healthy
from gateway.replicas.monitor import FleetMonitor
from gateway.routing.affinity import AffinityStore, Lost, Pinned, owned, place
from gateway.routing.router import Router
from gateway.settings import ServerSettings
from gateway.upstream.counters import UpstreamCounters
from gateway.upstream.failure import answered, client_error, happened, verdict
from gateway.upstream.seam import Timeouts, Upstream, UpstreamResponse
from gateway.usage.metrics import UNKNOWN_MODEL, GatewayMetrics
from gateway.usage.recorder import UsageRecorder

if TYPE_CHECKING:
    from gateway.routing.plan import RoutePlan

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
        gate: Gate, salts: TenantSalts | None = None,
    ) -> None:
        self.gate = gate  # admission: the gateway queue
        self.salts = salts or TenantSalts((), "")  # each tenant's cache namespace
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
        ex = Exchange(rid, self.clock(), self.timer(), endpoint or scope["path"][:200],
                      scope["method"])
        ex.upstream_id = own
        headers: Headers = [(b"x-request-id", rid.encode("latin-1")),
                            (b"x-gateway-request-id", own.encode())]
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.Task[None] | None = None
        try:
            ex.tenant = self.auth.tenant(auth_h)
            # Checked before anything is read or routed; never the decoded scope["path"].
            ex.target = upstream_target(
                scope.get("raw_path") or quote(scope["path"]).encode(),
                scope.get("query_string", b""))
            ex.up_headers = forwarded_headers(scope["headers"])
            raw = await read_body(receive, self.max_body, length_h, self.body_idle_s)
            watcher = asyncio.create_task(self._watch(receive, ex, task))
            if endpoint is None:
                await self._forward_other(scope, send, raw, ex, headers)
            else:
                await self._inference(scope, send, raw, endpoint, ex, headers)
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
            self.recorder.record(ex.record(self.timer()))

    async def _watch(self, receive: Receive, ex: Exchange, task: asyncio.Task[None]) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not ex.done:
            ex.disconnected = True
            task.cancel()

    async def _inference(
        self, scope: Scope, send: Send, raw: bytes, endpoint: Endpoint, ex: Exchange,
        headers: Headers,
    ) -> None:
        inbound = parse_inbound(raw, endpoint)
        body = inbound.body
        # A name no replica serves is recorded (so labelled) as "unknown": bounded series.
        ex.model = inbound.model if self.fleet.known_model(inbound.model) else UNKNOWN_MODEL
        ex.stream = inbound.stream
        ex.session = resolve_session(session_header(scope["headers"], self.session_headers),
                                     body)
        candidates = self.fleet.candidates(inbound.model)
        kind, view = chat_view(endpoint, body)
        pinned = self._pinned(body, ex.tenant) if endpoint == "responses" else None

        # parse_inbound has checked a chat or completions body more strictly than the
        # analyzer would; a converted view is checked again
        findings = self.analyzer.scan(view, kind, ex.session, ex.ts, validated=view is body,
                                      tenant=ex.tenant)
        # logged, summed up and shown in /stats from the usage record (UsageRecorder)
        ex.findings = findings
        for f in findings:
            self.metrics.hygiene_finding(f.kind, f.severity)
        inject = inbound.stream and not inbound.client_wants_usage
        changed = inject
        if inject:
            inject_usage(body)
        # Rewrites know the chat and completions shapes only.
        if view is body and self.analyzer.rewrite(body):
            changed = True
        if ex.tenant is not None:  # the tenant's own cache namespace (tenancy.py)
            salt = self.salts.engine(ex.tenant)
            if salt is not None:  # the engine's cache too: the client's salt overridden
                changed = changed or body.get("cache_salt") != salt
                body["cache_salt"] = salt
            view = self.salts.route_view(view, ex.tenant)
            ex.withheld = self.salts.withheld(ex.tenant, self.auth.admin_tenant(ex.tenant))
        payload = orjson.dumps(body) if changed else raw

        try:  # the admission queue (off: Router.decide at once) decides when and where
            ticket = await self.gate.admit(Ask(
                view, kind, inbound.model, ex.session, pinned, ex.tenant,
                priority_header(scope["headers"]), ex.ts), candidates)
        except ValueError as exc:  # NormalizeError: a body shape the engine would refuse too
            raise GatewayError(400, str(exc), code="invalid_request") from None
        plan = ticket.plan
        if ticket.queued_ms is not None:
            headers.append((b"x-gateway-queue-ms", b"%.1f" % ticket.queued_ms))
        # The client's `priority` never reaches the engine: the granted class's, or none
        # (a vLLM whose Messages endpoint takes no `priority` ignores it there).
        if priority.stamp(body, ticket.engine_priority):
            payload = orjson.dumps(body)
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
        headers.extend(response_headers(route, shown, findings,
                                        enabled=self.analyzer.config.header))
        try:
            await self._attempts(scope, send, payload, decision.ranked, plan, inject, ex,
                                 headers)
        finally:
            self.router.report(plan, self.clock())  # once, whatever happened
            self.gate.done(ticket)

    def _pinned(self, body: dict[str, object], tenant: str | None) -> str | None:
        """The replica a continuation must go to, None when routing may choose."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return None
        return self._holder(previous, "previous_response_id", tenant)

    def _holder(self, previous: str, param: str, tenant: str | None) -> str | None:
        """The replica that stored response `previous` for `tenant`, None when the gateway
        does not know it (or it is another tenant's); raises when that replica left or is
        down (no other holds it)."""
        fleet = self.fleet.replicas
        mine = self.affinity.lookup(owned(previous, tenant))
        if mine is None and tenant is not None and self.affinity.lookup(previous) is not None:
            # another tenant's response: answered as the engine answers an unknown id,
            # never sent where it lives
            raise GatewayError(404, f"Response with id '{previous[:64]}' not found.",
                               code="response_not_found", param=param)
        where = place(mine,
                      {name: r.healthy for name, r in fleet.items()})
        if isinstance(where, Pinned):
            return where.replica
        if isinstance(where, Lost):
            shown = previous[:64]
            if where.why == "removed":
                raise GatewayError(
                    404, f"Response '{shown}' was created on replica {where.replica}, which has "
                    "left the fleet; its stored state was lost with it. Start a new chain "
                    "without previous_response_id.", code="previous_response_lost",
                    param=param)
            raise GatewayError(
                503, f"Response '{shown}' is stored on replica {where.replica}, which is "
                "unhealthy; no other replica holds it. Retry later.",
                code="previous_response_unavailable", param=param)
        return None

    async def _forward_other(self, scope: Scope, send: Send, raw: bytes, ex: Exchange,
                             headers: Headers) -> None:
        stored = stored_response(scope["path"], scope["method"])
        holder = (self._holder(stored, "response_id", ex.tenant) if stored is not None
                  else None)
        model = None
        if raw and scope["method"] != "GET":
            doc = parse_json(raw)
            if isinstance(doc, dict):
                if isinstance(doc.get("model"), str):
                    model = doc["model"]
                # vLLM's pooling, score, tokenize... bodies take `priority` too: no class
                # is granted here, so the engine's default (`normal`)
                if priority.stamp(doc, None):
                    raw = orjson.dumps(doc)
        if model is not None:
            ex.model = model if self.fleet.known_model(model) else UNKNOWN_MODEL
            candidates = self.fleet.candidates(model)
        else:
            candidates = self.fleet.healthy()
            if not candidates:
                raise no_healthy(None)
        ranked = tuple(r.name for r in sorted(candidates, key=lambda r: r.in_flight))
        ex.route = "forward"
        if holder is not None:
            ranked, ex.route = (holder,), "response"
        headers.append((b"x-gateway-route", ex.route.encode()))
        await self._attempts(scope, send, raw or None, ranked, None, False, ex, headers)

    # forwarding -------------------------------------------------------------------------

    async def _attempts(
        self, scope: Scope, send: Send, payload: bytes | None, ranked: tuple[str, ...],
        plan: RoutePlan | None, strip: bool, ex: Exchange, headers: Headers,
    ) -> None:
        """Try the ranked replicas in turn while a try was not delivered."""
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
            if i and plan is not None:
                self.router.retried(plan, name, self.clock())
            if i:
                self.counters.retried(name)
            ex.replica = name
            failure = await self._attempt(scope, send, payload, replica, plan, strip, ex, headers)
            if failure is None:
                return
        raise failure if failure is not None else no_healthy(ex.model or None)

    async def _attempt(
        self, scope: Scope, send: Send, payload: bytes | None, replica: Replica,
        plan: RoutePlan | None, strip: bool, ex: Exchange, headers: Headers,
    ) -> GatewayError | None:
        """One try on one replica: None when it answered the client, the error to answer
        when nothing reached the replica (the caller may try another), else raises."""
        name = replica.name
        replica.in_flight += 1
        resp: UpstreamResponse | None = None
        ok = False
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
                error = client_error(exc, None if ex.withheld else name, self.retry_after_s)
                if rule.retry:
                    return error
                raise error from None
            status_class = answered(resp.status)
            if status_class is not None:
                self.counters.failure(name, status_class)  # relayed as is (the table)
            await self._relay(send, resp, replica, plan, strip, ex, headers, outcome)
            ok = ex.status < 400
            clean = outcome.error is None
            return None
        finally:
            ex.done = ex.done or clean
            replica.in_flight -= 1
            if resp is not None:
                if clean:
                    resp.release()
                else:
                    resp.abort()  # cancelled or broken: drop the connection, engine aborts
            if plan is not None:
                o, u = plan.outcome, outcome.usage
                o.ok = ok
                o.prompt_tokens = u.prompt_tokens if u else None
                o.cached_tokens = u.cached_tokens if u else None
                o.completion_tokens = u.completion_tokens if u else None
                o.reply_text = outcome.reply_text  # non-streamed answers only (RelayOutcome)

    async def _relay(
        self, send: Send, resp: UpstreamResponse, replica: Replica, plan: RoutePlan | None,
        strip: bool, ex: Exchange, headers: Headers, outcome: RelayOutcome,
    ) -> None:
        name = replica.name
        extra = headers if ex.withheld else [*headers, (b"x-gateway-replica", name.encode())]

        def first_byte() -> None:
            if plan is not None:
                plan.outcome.first_token_at = self.clock()

        def created(response_id: str) -> None:
            if ex.tenant is not None:  # that some tenant holds it (see _holder); first, so
                self.affinity.remember(response_id, name)  # the LRU forgets it first
            self.affinity.remember(owned(response_id, ex.tenant), name)

        responses = ex.endpoint == "responses"
        try:
            await relay(resp, send, extra, strip_usage=strip,
                        replica=None if ex.withheld else name, outcome=outcome,
                        on_first_byte=first_byte, timer=self.timer,
                        on_response_id=created if responses else None,
                        first_token=b'"response.output_text.delta"' if responses else None)
        except UpstreamError as exc:  # before the head: delivered, no usable answer
            self.counters.failure(name, happened(exc))
            raise from_upstream(exc, None if ex.withheld else name) from None
        ex.status = outcome.status
        if outcome.error is not None:
            ex.fail(outcome.error)


def stored_response(path: str, method: str) -> str | None:
    """The response id a call on one stored response names (GET/DELETE
    /v1/responses/{id}, POST /v1/responses/{id}/cancel), else None (pure)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[1:3] != ["v1", "responses"] or not parts[3]:
        return None
    if len(parts) == 4 and method in ("GET", "DELETE"):
        return parts[3]
    if len(parts) == 5 and parts[4] == "cancel" and method == "POST":
        return parts[3]
    return None
