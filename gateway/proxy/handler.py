"""The request path for proxied calls (design.md section 2), sequencing the pure parts:

    auth -> read body (bounded) -> parse + check once -> session -> candidates (404/503)
    -> hygiene scan/log/rewrite -> route -> forward (original bytes unless changed)
    -> relay (retry once on the next ranked replica if nothing reached the client yet)
    -> finally: one UsageRecord, one Router.report of the plan's outcome (with the reply
       text of a non-streamed answer, so the router indexes the answer the next turn
       repeats), in-flight released

Cancellation: once the body is read, a watcher task waits for `http.disconnect`; when the
client goes, it cancels the request task, which closes the upstream connection at once
(the engine aborts the request and frees its KV blocks) and records status 499. The
in-flight count is released in a `finally`, never in a background task.

Retry rule: a connect error, or a 5xx answer, from a replica before anything was sent to
the client moves the request to the next replica of `Decision.ranked` (at most
`server.retries` times). A timeout is not retried: the engine may still be working on it.
When every attempt failed, the last upstream 5xx is relayed as is, else a 502/504.

Responses (`/v1/responses`) and Messages (`/v1/messages`) bodies are routed and scanned as
the chat request vLLM renders from them (gateway.routing.responses_api / messages_api).
A Responses request that names a `previous_response_id` whose creator the gateway knows is
pinned to that replica (route `response`): no other replica holds the stored response.
If that replica left the fleet or is unhealthy, the gateway answers 404/503 saying so
instead of sending it where it can only fail. Each relayed Responses answer's id is
remembered with the replica that made it (`Services.affinity`).

Other `/v1/*` calls (`forward`) go to the least busy healthy replica serving the body's
`model` (any healthy replica without one), relayed the same way, and are recorded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

import orjson

from gateway.admission.gate import Ask, Gate
from gateway.admission.priority import header_value as priority_header
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.proxy.asgi import ClientGone, Headers, Receive, Scope, Send, read_body, request_headers
from gateway.proxy.auth import Authenticator
from gateway.proxy.errors import GatewayError, UpstreamConnectError, UpstreamError, from_upstream
from gateway.proxy.exchange import Exchange
from gateway.proxy.inbound import Endpoint, inject_usage, parse_inbound, parse_json
from gateway.proxy.relay import RelayOutcome, relay, shutting_down, upstream_request_headers
from gateway.proxy.session import resolve_session
from gateway.proxy.target import client_request_id, forwarded_headers, upstream_target
from gateway.proxy.upstream import Timeouts, Upstream, UpstreamResponse
from gateway.replicas.fleet import Fleet, Replica, no_healthy
from gateway.replicas.monitor import FleetMonitor
from gateway.routing import messages_api, responses_api
from gateway.routing.affinity import AffinityStore, Lost, Pinned, place
from gateway.routing.normalize import NormalizeError
from gateway.routing.router import Router
from gateway.settings import ServerSettings
from gateway.usage.metrics import UNKNOWN_MODEL, GatewayMetrics
from gateway.usage.recorder import UsageRecorder

if TYPE_CHECKING:
    from gateway.routing.plan import RoutePlan

log = logging.getLogger("gateway.proxy.handler")

_WANTED = (b"x-request-id", b"authorization", b"x-session-id", b"content-length")


class Proxy:
    """The request path. Every collaborator is given explicitly; `clock` stamps records
    (wall time) and `timer` measures latencies (a monotonic clock), so tests can drive
    both."""

    def __init__(
        self, *, server: ServerSettings, fleet: Fleet, router: Router,
        analyzer: HygieneAnalyzer, metrics: GatewayMetrics, recorder: UsageRecorder,
        auth: Authenticator, monitor: FleetMonitor, upstream: Upstream,
        affinity: AffinityStore, clock: Callable[[], float], timer: Callable[[], float],
        gate: Gate,
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
        self.max_body = server.max_body_bytes
        self.body_idle_s = server.client_body_timeout_s
        self.retries = server.retries
        self.timeouts = Timeouts(connect_s=server.connect_timeout_s, read_s=server.read_timeout_s)
        # Request ids: a random per-process prefix and a counter (32 hex digits, like a
        # uuid4 hex, unique without a random draw per request).
        self._rid_prefix = os.urandom(8).hex()
        self._rid_seq = itertools.count(1)

    # the path ---------------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint | None,
                     ) -> None:
        """One proxied call: `endpoint` for the routed inference routes, None for any other
        `/v1/*` call (forwarded to the least busy replica serving its model)."""
        rid_h, auth_h, session_h, length_h = request_headers(scope, _WANTED)
        rid = client_request_id(rid_h) or f"{self._rid_prefix}{next(self._rid_seq):016x}"
        ex = Exchange(rid, self.clock(), self.timer(), endpoint or scope["path"][:200],
                      scope["method"])
        headers: Headers = [(b"x-request-id", rid.encode("latin-1"))]
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
                await self._inference(scope, send, raw, endpoint, session_h, ex, headers)
        except GatewayError as err:
            ex.fail(err)
            if not ex.outcome.started:
                ex.done = True
                await _respond_error(send, err, headers)
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
                        await _respond_error(send, cut, headers)
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
        self, scope: Scope, send: Send, raw: bytes, endpoint: Endpoint, session_h: bytes | None,
        ex: Exchange, headers: Headers,
    ) -> None:
        inbound = parse_inbound(raw, endpoint)
        body = inbound.body
        # A name no replica serves is recorded (so labelled) as "unknown": bounded series.
        ex.model = inbound.model if self.fleet.known_model(inbound.model) else UNKNOWN_MODEL
        ex.stream = inbound.stream
        ex.session = resolve_session(session_h, body)
        candidates = self.fleet.candidates(inbound.model)
        view = body
        kind: Literal["chat", "completions"] = (
            "completions" if endpoint == "completions" else "chat")
        if endpoint == "responses" or endpoint == "messages":
            convert = responses_api if endpoint == "responses" else messages_api
            try:
                view = convert.chat_view(body)
            except NormalizeError as exc:
                raise GatewayError(400, str(exc), code="invalid_request") from None
        pinned = self._pinned(body) if endpoint == "responses" else None

        # parse_inbound has checked a chat or completions body more strictly than the
        # analyzer would; a converted view is checked again
        findings = self.analyzer.scan(view, kind, ex.session, ex.ts, validated=view is body)
        if findings:
            ex.findings = len(findings)
            for f in findings:
                self.metrics.hygiene_finding(f.kind, f.severity)
            for f in self.analyzer.to_log(findings, ex.ts):
                # `info` findings (a break in front of a short tail) cost almost nothing:
                # debug level, so they do not drown the warnings.
                level = logging.WARNING if f.severity == "warning" else logging.DEBUG
                log.log(level, "hygiene finding", extra={
                    "request_id": ex.request_id, "model": ex.model, **f.to_dict()})
            value = self.analyzer.header_value(findings)
            if value is not None:
                headers.append((b"x-gateway-hygiene", value.encode()))
        inject = inbound.stream and not inbound.client_wants_usage
        changed = inject
        if inject:
            inject_usage(body)
        # Rewrites know the chat and completions shapes only.
        if view is body and self.analyzer.rewrite(body):
            changed = True
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
        if ticket.engine_priority is not None and view is body:  # vLLM priority scheduling
            body["priority"] = ticket.engine_priority
            payload = orjson.dumps(body)
        decision = plan.decision
        self.metrics.route_decision(decision.reason)
        if decision.move is not None:
            ex.moved = decision.move
            self.metrics.route_move(decision.move)
        ex.route, ex.predicted, ex.best = (
            decision.reason, decision.predicted_cached_tokens, decision.best_available_tokens)
        headers.append((b"x-gateway-route", decision.reason.encode()))
        try:
            await self._attempts(scope, send, payload, decision.ranked, plan, inject, ex,
                                 headers)
        finally:
            self.router.report(plan, self.clock())  # once, whatever happened
            self.gate.done(ticket)

    def _pinned(self, body: dict[str, object]) -> str | None:
        """The replica a continuation must go to, None when routing may choose."""
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return None
        fleet = self.fleet.replicas
        where = place(self.affinity.lookup(previous),
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
                    param="previous_response_id")
            raise GatewayError(
                503, f"Response '{shown}' is stored on replica {where.replica}, which is "
                "unhealthy; no other replica holds it. Retry later.",
                code="previous_response_unavailable", param="previous_response_id")
        return None

    async def _forward_other(self, scope: Scope, send: Send, raw: bytes, ex: Exchange,
                             headers: Headers) -> None:
        model = None
        if raw and scope["method"] != "GET":
            doc = parse_json(raw)
            if isinstance(doc, dict) and isinstance(doc.get("model"), str):
                model = doc["model"]
        if model is not None:
            ex.model = model if self.fleet.known_model(model) else UNKNOWN_MODEL
            candidates = self.fleet.candidates(model)
        else:
            candidates = self.fleet.healthy()
            if not candidates:
                raise no_healthy(None)
        ranked = tuple(r.name for r in sorted(candidates, key=lambda r: r.in_flight))
        ex.route = "forward"
        headers.append((b"x-gateway-route", b"forward"))
        await self._attempts(scope, send, raw or None, ranked, None, False, ex, headers)

    # forwarding -------------------------------------------------------------------------

    async def _attempts(
        self, scope: Scope, send: Send, payload: bytes | None, ranked: tuple[str, ...],
        plan: RoutePlan | None, strip: bool, ex: Exchange, headers: Headers,
    ) -> None:
        url_path = ex.target
        failure: GatewayError | None = None
        fleet = self.fleet.replicas
        spare = [n for n in ranked[1:] if n in fleet and fleet[n].healthy]
        targets = [ranked[0], *spare[: self.retries]]
        for i, name in enumerate(targets):
            replica = fleet.get(name)
            if replica is None or (i and not replica.healthy):
                continue
            ex.replica = name
            outcome = await self._attempt(scope, send, payload, url_path, replica, plan, strip,
                                          ex, headers, i == len(targets) - 1)
            if outcome is None:
                return
            failure = outcome
        if failure is None:
            failure = no_healthy(ex.model or None)
        raise failure

    async def _attempt(
        self, scope: Scope, send: Send, payload: bytes | None, url_path: str, replica: Replica,
        plan: RoutePlan | None, strip: bool, ex: Exchange, headers: Headers, last: bool,
    ) -> GatewayError | None:
        """One try on one replica; returns the error to fall back on if another may try."""
        name = replica.name
        replica.in_flight += 1
        if plan is not None:
            plan.outcome.replica = name  # a retry moves the request (Router._settle)
        resp: UpstreamResponse | None = None
        ok = False
        clean = False
        ex.outcome = outcome = RelayOutcome()
        try:
            up_headers = upstream_request_headers(ex.up_headers, ex.request_id,
                                                  replica.upstream_headers)
            try:
                resp = await self.upstream.send(scope["method"], replica.url + url_path, up_headers,
                                             payload, self.timeouts)
            except UpstreamConnectError as exc:
                self.monitor.report_connect_failure(replica)
                return from_upstream(exc, name)
            except UpstreamError as exc:  # timeout: the engine may be busy with it, no retry
                raise from_upstream(exc, name) from None
            if resp.status >= 500 and not last:
                log.warning("upstream error, retrying", extra={
                    "request_id": ex.request_id, "replica": name, "status": resp.status})
                return GatewayError(resp.status, f"Replica {name} answered {resp.status}.",
                                    code="upstream_error")
            extra = [*headers, (b"x-gateway-replica", name.encode())]

            def first_byte() -> None:
                if plan is not None:
                    plan.outcome.first_token_at = self.clock()

            def created(response_id: str) -> None:
                self.affinity.remember(response_id, name)

            responses = ex.endpoint == "responses"

            try:
                await relay(resp, send, extra, strip_usage=strip, replica=name, outcome=outcome,
                            on_first_byte=first_byte, timer=self.timer,
                            on_response_id=created if responses else None,
                            first_token=b'"response.output_text.delta"' if responses else None)
            except UpstreamError as exc:
                raise from_upstream(exc, name) from None
            ex.status = outcome.status
            if outcome.error is not None:
                ex.fail(outcome.error)
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


async def _respond_error(send: Send, err: GatewayError, headers: Headers) -> None:
    body = err.body()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *err.headers(), *headers]})
    await send({"type": "http.response.body", "body": body})
