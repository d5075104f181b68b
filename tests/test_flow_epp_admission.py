"""The picker in admission, over real gRPC on loopback (a data plane's messages in the
project's own configuration: request body BUFFERED), in front of simulated replicas,
with `[admission]` on and each replica's room one request (`replica_max_in_flight`):

- a request with no room holds its ext_proc stream (no answer) until another finishes,
  then goes to the replica that freed, its answer saying how long it queued;
- a flood past `max_queue` is shed: a 429 immediate response in OpenAI's shape with
  Retry-After; a client that goes away while queued (its stream cancelled, as Envoy
  resets it) leaves the queue at once;
- `high` outranks `low`; a second tenant cannot outrank with a body `priority` (the
  body the picker returns carries none), and never sees the first tenant's route or
  replica where serve withholds them;
- a replica that leaves while requests are queued receives none of them;
- in each mode that carries the body, the client's `priority` is removed from the body
  the picker returns, with its Content-Length."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.admission.config import AdmissionConfig
from gateway.epp import decision, modes
from gateway.proxy.tenancy import TenantSalts
from gateway.settings import AuthSettings, EppSettings
from tests.proxy_fakes import COMPLETION
from tests.servers import sim
from tests.test_epp_grpc import MODEL, Epp, Stream, response_headers, running_epp
from tests.test_epp_modes import Wire, set_headers, streamed
from tests.test_epp_modes import chunks as split
from tests.test_epp_modes import headers as modes_headers

ONE_EACH = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=8,
                           default_priority_cap="high")


@pytest.fixture(scope="module")
def one() -> Iterator[list[str]]:
    with sim(1, ["--speed", "1000"]) as found:
        yield found


@pytest.fixture(scope="module")
def two() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found


def request(extra: Sequence[tuple[str, str]] = ()) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"), *extra):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    return req


def chat(content: str, **extra: object) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    req.request_body.body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})
    req.request_body.end_of_stream = True
    return req


def picked(resp: ext.ProcessingResponse) -> tuple[str, str]:
    """(the destination header, the pick and fallbacks in `envoy.lb` metadata)."""
    assert resp.HasField("request_body"), resp
    got = {h.header.key: h.header.raw_value.decode()
           for h in resp.request_body.response.header_mutation.set_headers}
    lb = resp.dynamic_metadata.fields[decision.LB_NAMESPACE].struct_value
    return got[decision.DESTINATION], lb.fields[decision.DESTINATION].string_value


def added(resp: ext.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.response_headers.response.header_mutation.set_headers}


async def start(epp: Epp, content: str, headers: Sequence[tuple[str, str]] = (),
                **body: object) -> tuple[Stream, asyncio.Task[ext.ProcessingResponse]]:
    """A request sent whole; the task ends with the picker's answer to its body."""
    s = Stream(epp)
    assert (await s.ask(request(headers))).HasField("request_headers")
    return s, asyncio.create_task(s.ask(chat(content, **body)))


async def finish(s: Stream) -> dict[str, str]:
    """The replica answered (headers, then the JSON body with its usage); the headers the
    picker added to the answer."""
    heads = added(await s.ask(response_headers(200)))
    done = ext.ProcessingRequest()
    done.response_body.body = COMPLETION
    done.response_body.end_of_stream = True
    assert (await s.ask(done)).HasField("response_body")
    await s.close()
    return heads


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def queued(epp: Epp) -> dict[str, int]:
    assert epp.app.services is not None and epp.app.services.gate is not None
    q: dict[str, int] = epp.app.services.gate.stats()["queued"]
    return q


async def test_a_queued_request_holds_its_stream_until_another_finishes(
        one: list[str]) -> None:
    async with running_epp(one, admission=ONE_EACH) as epp:
        (endpoint,) = epp.endpoints
        holder, first = await start(epp, "the first")
        assert picked(await first)[0] == endpoint
        waiter, second = await start(epp, "the second")
        await until(lambda: queued(epp)["normal"] == 1, "the second never queued")
        assert not second.done()  # its stream is held: no pick yet
        await finish(holder)
        assert picked(await asyncio.wait_for(second, 10))[0] == endpoint
        heads = await finish(waiter)
        assert float(heads["x-gateway-queue-ms"]) >= 0.0
    assert [r.status for r in epp.records] == [200, 200]


async def test_a_flood_is_shed_and_a_client_gone_leaves_the_queue(one: list[str]) -> None:
    flood = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=2)
    async with running_epp(one, admission=flood) as epp:
        holder, first = await start(epp, "the holder")
        await first
        waiting = [await start(epp, f"waiter {i}") for i in range(2)]
        await until(lambda: queued(epp)["normal"] == 2, "the waiters never queued")
        _, shed = await start(epp, "one too many")
        im = (await shed).immediate_response
        assert im.status.code == 429
        heads = {h.header.key: h.header.raw_value for h in im.headers.set_headers}
        assert int(heads["retry-after"]) >= 1
        assert orjson.loads(im.body)["error"]["code"] == "overloaded_queue_full"
        assert orjson.loads(im.body)["error"]["type"] == "rate_limit_exceeded"
        for w, task in waiting:  # the clients go away: Envoy resets their streams
            w.call.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await until(lambda: queued(epp)["normal"] == 0, "cancelled waiters stayed queued")
        await finish(holder)
    statuses = sorted(r.status for r in epp.records)
    assert statuses == [200, 429, 499, 499]


async def test_high_outranks_low(one: list[str]) -> None:
    async with running_epp(one, admission=ONE_EACH) as epp:
        holder, first = await start(epp, "the holder")
        await first
        low, low_pick = await start(epp, "low one", [("x-gateway-priority", "low")])
        await until(lambda: queued(epp)["low"] == 1, "low never queued")
        high, high_pick = await start(epp, "high one", [("x-gateway-priority", "high")])
        await until(lambda: queued(epp)["high"] == 1, "high never queued")
        await finish(holder)
        await asyncio.wait_for(high_pick, 10)  # the one room goes to `high`
        assert not low_pick.done() and queued(epp)["low"] == 1
        await finish(high)
        await asyncio.wait_for(low_pick, 10)
        await finish(low)


async def test_a_second_tenant_neither_outranks_nor_learns_the_first(one: list[str]) -> None:
    auth = AuthSettings(keys={"ka": "alice", "kb": "bob"}, admin_tenants=("alice",))
    caps = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=8,
                           priority_caps={"alice": "high"})
    async with running_epp(one, admission=caps, auth=auth) as epp:
        # the index shared by all tenants (token mode without the salt): what it decided
        # is withheld from every key but an admin's, as in serve
        epp.picker.flow.salts = TenantSalts({"alice", "bob"}, "", token_mode=True)
        alice = [("authorization", "Bearer ka")]
        bob = [("authorization", "Bearer kb")]
        holder, first = await start(epp, "alice holds", alice)
        await first
        b, b_pick = await start(epp, "bob wants in", [*bob, ("x-gateway-priority", "high")],
                                priority=-100)
        await until(lambda: queued(epp)["normal"] == 1, "bob never queued")  # capped
        a, a_pick = await start(epp, "alice, urgent", [*alice, ("x-gateway-priority", "high")])
        await until(lambda: queued(epp)["high"] == 1, "alice never queued")
        await finish(holder)
        a_resp = await asyncio.wait_for(a_pick, 10)
        assert not b_pick.done()  # bob's body priority bought him nothing
        assert not a_resp.request_body.response.HasField("body_mutation")  # unchanged
        a_heads = await finish(a)
        b_resp = await asyncio.wait_for(b_pick, 10)
        # bob's `priority` never reaches the engine: the body returned carries none
        mutated = b_resp.request_body.response.body_mutation.body
        assert "priority" not in orjson.loads(mutated)
        sets = {h.header.key: h.header.raw_value.decode()
                for h in b_resp.request_body.response.header_mutation.set_headers}
        assert sets["content-length"] == str(len(mutated))
        b_heads = await finish(b)
    assert a_heads["x-gateway-route"] != "withheld" and "x-gateway-replica" in a_heads
    assert b_heads["x-gateway-route"] == "withheld"
    assert "x-gateway-replica" not in b_heads
    assert all("predicted" not in v for k, v in b_heads.items() if k.startswith("x-gateway"))


async def test_a_replica_that_leaves_gets_none_of_the_queued(two: list[str]) -> None:
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None
        holders = []
        for i in range(2):
            s, task = await start(epp, f"holder {i}")
            holders.append((s, picked(await asyncio.wait_for(task, 10))[0]))
        assert {ep for _, ep in holders} == set(epp.endpoints)  # one on each
        waiting = [await start(epp, f"waiter {i}") for i in range(2)]
        await until(lambda: queued(epp)["normal"] == 2, "the waiters never queued")
        (gone_s, gone_ep), (stay_s, stay_ep) = holders
        gone = epp.picker.by_endpoint[gone_ep]
        services.remove_replica(gone)
        epp.picker.set_endpoints({n: e for n, e in epp.picker.endpoints.items() if n != gone})
        await finish(gone_s)  # its room frees, but it is no longer there
        await asyncio.sleep(0)
        assert queued(epp)["normal"] == 2 and not any(t.done() for _, t in waiting)
        await finish(stay_s)
        for s, task in waiting:
            header, meta = picked(await asyncio.wait_for(task, 10))
            assert header == meta == stay_ep  # no fallback to the departed one either
            await finish(s)


# the body returned in each mode ---------------------------------------------------------

def _forwarded(resps: Sequence[ext.ProcessingResponse], mode: str) -> tuple[bytes, str]:
    """(the request body the data plane forwards, its Content-Length) from the picker's
    answers in each processing mode."""
    first, *rest = resps
    if mode == "buffered":
        common = first.request_body.response
        return common.body_mutation.body, set_headers(first.request_body)["content-length"]
    length = set_headers(first.request_headers)["content-length"]
    if mode == "duplex":
        return streamed(rest, "request_body")[0], length
    mutations = [r.request_body.response.body_mutation for r in rest]  # STREAMED
    assert [m.WhichOneof("mutation") for m in mutations] == (
        ["body"] + ["clear_body"] * (len(mutations) - 1))
    return mutations[0].body, length


@pytest.mark.parametrize("mode", ["buffered", "duplex", "streamed"])
async def test_the_clients_priority_never_reaches_the_engine(one: list[str], mode: str,
                                                            ) -> None:
    raw = orjson.dumps({"model": MODEL, "priority": -50,
                        "messages": [{"role": "user", "content": "jump the queue " * 30}]})
    # admission off: the class is `normal`, no priority
    async with running_epp(one, admission=AdmissionConfig(enabled=False)) as epp:
        w = Wire(epp)
        if mode == "buffered":
            await w.send(modes_headers(mode=None), *split(raw, 1))
            assert (await w.read(1))[0].HasField("request_headers")
            resps = await w.read(1)
        elif mode == "duplex":
            await w.send(modes_headers(), *split(raw, 3))
            resps = await w.read(2)
        else:
            await w.send(modes_headers(mode=(modes.STREAMED, modes.NONE),
                                       without_waiting=True), *split(raw, 3))
            resps = await w.read(4)
        body, length = _forwarded(resps, mode)
        sent = orjson.loads(body)
        assert "priority" not in sent and sent["messages"] == orjson.loads(raw)["messages"]
        assert length == str(len(body))
        await w.close()


def test_shed_in_flight_names_its_replacement() -> None:
    with pytest.raises(ValueError, match=r"replaced by \[admission\]"):
        EppSettings(shed_in_flight=2)
    assert EppSettings().shed_in_flight == 0


async def test_a_forwarded_call_loses_the_clients_priority_too(one: list[str]) -> None:
    async with running_epp(one) as epp:
        s = Stream(epp)
        tokenize = ext.ProcessingRequest()
        for k, v in ((":path", "/tokenize"), (":method", "POST")):
            tokenize.request_headers.headers.headers.add(key=k, raw_value=v.encode())
        assert (await s.ask(tokenize)).HasField("request_headers")
        body = ext.ProcessingRequest()
        body.request_body.body = orjson.dumps({"model": MODEL, "prompt": "x", "priority": 3})
        body.request_body.end_of_stream = True
        resp = await s.ask(body)
        assert orjson.loads(resp.request_body.response.body_mutation.body) == {
            "model": MODEL, "prompt": "x"}
        await s.close()
