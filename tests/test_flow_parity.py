"""One request flow, two transports: the same requests through `gateway serve` (the
in-process app over a mock upstream) and through the endpoint picker's request path
(driven as the ext_proc stream drives it, with the answers the replica gave serve) give
the same router reports, usage records, metrics, gate state and forwarded `priority`;
and what both must show is checked as such, so a step of the shared core broken
(gateway.proxy.flow: the router not told of a move, the in-flight count kept, the gate
not told, the priority not stamped) turns both red, not only their comparison."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import generate_latest

from gateway.admission.config import AdmissionConfig
from gateway.epp.picker import Picker
from gateway.proxy.app import GatewayApp, create_app
from gateway.proxy.errors import GatewayError, UpstreamConnectError
from gateway.routing.plan import RoutePlan
from gateway.settings import EppSettings
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import (
    COMPLETION,
    DONE,
    EVENTS,
    JSON_H,
    MODEL,
    SSE_H,
    USAGE_EVENT,
    Fake,
    settings,
)
from tests.upstream_double import MockReply, MockRequest

RESPONSE = orjson.dumps({
    "id": "resp_parity1", "object": "response", "model": MODEL, "status": "completed",
    "output": [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "hello there"}]}],
    "usage": {"input_tokens": 30, "output_tokens": 3,
              "input_tokens_details": {"cached_tokens": 16}},
})
FAILED = orjson.dumps({"error": {"message": "engine failure", "type": "server_error",
                                 "code": 500, "param": None}})
SYSTEM = "You are the parity agent. " * 30


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]
    answer: MockReply
    moved: bool = False  # the pick cannot be reached: served by the next replica


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": text}], **extra}


CASES = [
    Case("chat", "/v1/chat/completions", _chat("first", priority=7),
         MockReply(200, JSON_H, [COMPLETION])),
    Case("stream", "/v1/chat/completions",
         _chat("second", stream=True, stream_options={"include_usage": True}),
         MockReply(200, SSE_H, [*EVENTS, USAGE_EVENT, DONE])),
    Case("responses", "/v1/responses", {"model": MODEL, "input": "start a chain"},
         MockReply(200, JSON_H, [RESPONSE])),
    Case("continuation", "/v1/responses",
         {"model": MODEL, "input": "go on", "previous_response_id": "resp_parity1"},
         MockReply(200, JSON_H, [RESPONSE.replace(b"resp_parity1", b"resp_parity2")])),
    Case("moved", "/v1/chat/completions", _chat("third"), MockReply(200, JSON_H, [COMPLETION]),
         moved=True),
    Case("failing", "/v1/chat/completions", _chat("fourth"),
         MockReply(500, JSON_H, [FAILED])),
]


@dataclasses.dataclass
class Seen:
    """What one transport left behind."""

    reports: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    records: list[UsageRecord] = dataclasses.field(default_factory=list)
    priorities: list[object] = dataclasses.field(default_factory=list)  # forwarded bodies'
    served: list[str] = dataclasses.field(default_factory=list)  # where each was answered
    in_flight_after: dict[str, int] = dataclasses.field(default_factory=dict)
    gate: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: list[str] = dataclasses.field(default_factory=list)


def _config() -> Any:
    # admission on (tickets, the gate told at the end), the class stamped on every body
    return dataclasses.replace(settings(retries=1), admission=AdmissionConfig(
        enabled=True, priority_replicas=("a", "b")))


def _spy(app: GatewayApp, seen: Seen) -> None:
    s = app.services
    assert s is not None
    router_report, record = s.router.report, s.recorder.record

    def report(plan: RoutePlan, now: float) -> None:
        o = plan.outcome
        seen.reports.append((plan.decision.reason, o.replica, o.ok, o.prompt_tokens,
                             o.cached_tokens, o.completion_tokens, o.reply_text))
        router_report(plan, now)

    def keep(rec: UsageRecord, departed: bool = False) -> None:
        seen.records.append(rec)
        record(rec, departed)

    s.router.report = report  # type: ignore[method-assign]
    s.recorder.record = keep  # type: ignore[method-assign]


def _after(app: GatewayApp, seen: Seen) -> None:
    s = app.services
    assert s is not None and s.gate is not None
    seen.in_flight_after = {n: r.in_flight for n, r in s.fleet.replicas.items()}
    stats = s.gate.stats()
    seen.gate = {k: stats[k] for k in ("queued", "shed", "admitted_tokens")}
    seen.gate["holding"] = dict(s.gate._admitted)  # tickets not given back (Gate.done)
    text = generate_latest(s.metrics.registry).decode()
    seen.metrics = sorted(
        line for line in text.splitlines()
        if line.startswith(("gateway_rout", "gateway_hygiene", "gateway_admission_admitted"))
        and "_created" not in line)  # a series' creation time differs by the run


class Scripted(Fake):
    """The replicas answer each case as scripted; `refuse` makes the next inference
    attempt not delivered (the replica cannot be reached: serve tries the next)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = MockReply(200, JSON_H, [COMPLETION])
        self.refuse = False
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.behave = self._behave

    async def handle(self, req: MockRequest) -> MockReply:
        if req.method == "POST" and self.refuse:
            self.refuse = False
            raise UpstreamConnectError("connection refused")
        return await super().handle(req)

    def _behave(self, replica: str, req: MockRequest) -> MockReply:
        self.bodies.append((replica, orjson.loads(req.body or b"{}")))
        return self.answer


async def through_serve(cases: list[Case]) -> Seen:
    seen, fake = Seen(), Scripted()
    app = create_app(_config(), upstream=fake.upstream)
    async with app.running():
        _spy(app, seen)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for case in cases:
                fake.answer, fake.refuse = case.answer, case.moved
                before = len(fake.bodies)
                r = await client.post(case.path, json=case.body,
                                      headers={"x-gateway-priority": "low"})
                assert r.status_code == case.answer.status, (case.name, r.text)
                replica, body = fake.bodies[before]
                seen.served.append(replica)
                seen.priorities.append(body.get("priority"))
        _after(app, seen)
    return seen


async def through_picker(cases: list[Case]) -> Seen:
    seen = Seen()
    app = create_app(_config(), upstream=Fake().upstream)
    async with app.running():
        _spy(app, seen)
        assert app.services is not None
        picker = Picker(app.services, EppSettings(port=0, response="body"), time.perf_counter)
        for case in cases:
            flow = picker.start({":path": case.path, ":method": "POST",
                                 "x-gateway-priority": "low"})
            try:
                routed = await picker.route(flow, orjson.dumps(case.body), None)
            except GatewayError as err:  # pragma: no cover - reported by the assertion
                pytest.fail(f"{case.name}: {err.message}")
            # what the engine gets: the picker's body, else the client's as it was
            sent = orjson.loads(routed.body) if routed.body is not None else case.body
            seen.priorities.append(sent.get("priority"))
            assert flow.replica is not None
            served = flow.replica.name
            if case.moved:  # the data plane's retry served it on the next one
                served = next(n for n in ("a", "b") if n != served)
            seen.served.append(served)
            reply = case.answer
            ctype = dict(reply.headers)["content-type"]
            picker.response_started(flow, reply.status, picker.endpoints[served], ctype)
            if flow.wants_body:
                picker.response_body(flow, b"".join(reply.chunks), True)
            else:
                picker.finish(flow)
        _after(app, seen)
    return seen


def _fields(rec: UsageRecord) -> tuple[Any, ...]:
    return (rec.endpoint, rec.method, rec.tenant, rec.model, rec.replica, rec.route,
            rec.stream, rec.status, rec.prompt_tokens, rec.cached_tokens,
            rec.completion_tokens, rec.predicted_cached_tokens, rec.best_available_tokens,
            rec.session, rec.hygiene, rec.moved)


@pytest.fixture(scope="module")
def runs() -> dict[str, Seen]:
    return {"serve": asyncio.run(through_serve(CASES)),
            "picker": asyncio.run(through_picker(CASES))}


def test_both_transports_leave_the_same_state(runs: dict[str, Seen]) -> None:
    serve, picker = runs["serve"], runs["picker"]
    assert serve.served == picker.served
    assert serve.reports == picker.reports
    assert [_fields(r) for r in serve.records] == [_fields(r) for r in picker.records]
    assert serve.priorities == picker.priorities
    assert serve.gate == picker.gate
    assert serve.metrics == picker.metrics


@pytest.mark.parametrize("transport", ["serve", "picker"])
def test_what_each_transport_must_show(runs: dict[str, Seen], transport: str) -> None:
    _what_both_must_show(runs[transport])


def _what_both_must_show(seen: Seen) -> None:
    by = {c.name: i for i, c in enumerate(CASES)}
    # every request reported once and recorded once; decisions counted
    assert any(line.startswith("gateway_routing_decisions") for line in seen.metrics)
    assert len(seen.reports) == len(seen.records) == len(CASES)
    # the client's `priority` never reaches the engine: the granted class's (low) instead
    assert seen.priorities == [1] * len(CASES)
    # the continuation went where its chain is stored
    assert seen.records[by["continuation"]].route == "response"
    assert seen.served[by["continuation"]] == seen.served[by["responses"]]
    # a moved request: the router was told (its report names where it was served)
    moved = by["moved"]
    assert seen.reports[moved][1] == seen.served[moved]
    assert seen.records[moved].replica == seen.served[moved]
    # outcomes: usage read, the failure not ok
    assert [r[2] for r in seen.reports] == [c.answer.status < 400 for c in CASES]
    assert seen.records[by["stream"]].prompt_tokens == 40
    assert seen.records[by["chat"]].cached_tokens == 32
    assert seen.records[by["failing"]].status == 500
    # nothing held once every request is over: in-flight counts, the gate's tickets
    assert seen.in_flight_after == {"a": 0, "b": 0}
    assert seen.gate["queued"] == {"high": 0, "normal": 0, "low": 0}
    assert sum(seen.gate["admitted_tokens"].values()) > 0
    assert seen.gate["holding"] == {}
