"""The picker in admission tried as an outsider would (review of issue 34), over real gRPC
on loopback in front of simulated replicas, each case ending with nothing held: every
replica's in-flight count back to zero, the gate's tickets given back, its queue empty.

- a waiter whose data plane restricted it with a subset hint is bound by the gate only
  within that subset (accounting and destination agree);
- replicas failing, moved, shed or displaced while requests wait; another tenant's chain.
Stored responses through the picker: tests/test_flow_epp_stored.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.admission.config import AdmissionConfig
from gateway.epp import decision
from gateway.proxy import pinning
from gateway.settings import AuthSettings
from tests.epp_outsider import call, hinted, nothing_held, responses_body, two_holders
from tests.proxy_fakes import COMPLETION
from tests.servers import sim
from tests.test_epp_grpc import Stream, response_headers, running_epp
from tests.test_flow_epp_admission import (
    ONE_EACH,
    chat,
    finish,
    picked,
    queued,
    request,
    start,
    until,
)


@pytest.fixture(scope="module")
def two() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found


@pytest.fixture(scope="module")
def one_of(two: list[str]) -> list[str]:
    return two[:1]




async def test_a_hinted_waiter_is_bound_within_its_subset(two: list[str]) -> None:
    async with running_epp(two, admission=ONE_EACH) as epp:
        holders = []
        for i in range(2):
            s, task = await start(epp, f"holder {i}")
            holders.append((s, picked(await asyncio.wait_for(task, 10))[0]))
        assert {ep for _, ep in holders} == set(epp.endpoints)
        (other_s, other_ep), (only_s, only_ep) = holders
        w = Stream(epp)
        assert (await w.ask(hinted(request(), [only_ep]))).HasField("request_headers")
        pick = asyncio.create_task(w.ask(hinted(chat("only there"), [only_ep])))
        await until(lambda: queued(epp)["normal"] == 1, "the hinted one never queued")
        await finish(other_s)  # room outside its subset: it must not take it
        await asyncio.sleep(0.3)  # a recheck or two
        assert not pick.done(), "bound outside its subset"
        assert epp.app.services is not None and epp.app.services.gate is not None
        gate = epp.app.services.gate
        other = epp.picker.by_endpoint[other_ep]
        assert gate._admitted.get(other, 0) == 0
        await finish(only_s)
        header, meta = picked(await asyncio.wait_for(pick, 10))
        assert header == meta == only_ep
        only = epp.picker.by_endpoint[only_ep]
        assert gate._admitted == {only: 1}
        await finish(w)
        nothing_held(epp)



async def test_an_escaped_route_is_still_admitted(two: list[str]) -> None:
    """`/v1/chat%2Fcompletions` is the chat route to the engine (and to serve, which reads
    the decoded path): through the picker it is admitted and accounted as chat, not
    forwarded past the queue (and past the tenant's cache namespace)."""
    one = two[:1]
    async with running_epp(one, admission=ONE_EACH) as epp:
        holder, first = await start(epp, "the holder")
        await first
        s, pick = await start(epp, "around the queue", [(":path", "/v1/chat%2Fcompletions")])
        await until(lambda: queued(epp)["normal"] == 1, "the escaped route skipped the queue")
        await finish(holder)
        await asyncio.wait_for(pick, 10)
        await finish(s)
        assert [r.endpoint for r in epp.records] == ["chat", "chat"]
        nothing_held(epp)


# a replica failing while requests wait ----------------------------------------------------

async def test_a_replica_marked_down_gets_none_of_the_queued(two: list[str]) -> None:
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None
        (down_s, down_ep), (up_s, up_ep) = await two_holders(epp)
        waiting = [await start(epp, f"waiter {i}") for i in range(2)]
        await until(lambda: queued(epp)["normal"] == 2, "the waiters never queued")
        services.fleet.replicas[epp.picker.by_endpoint[down_ep]].healthy = False
        await finish(down_s)  # its room frees, but it is down
        await asyncio.sleep(0.3)
        assert queued(epp)["normal"] == 2 and not any(t.done() for _, t in waiting)
        await finish(up_s)
        for s, task in waiting:
            header, meta = picked(await asyncio.wait_for(task, 10))
            assert header == meta == up_ep  # no fallback to the one that is down either
            await finish(s)
        nothing_held(epp)


async def test_a_hinted_waiter_whose_subset_left_is_answered_at_once(two: list[str]) -> None:
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None
        (gone_s, gone_ep), (stay_s, _) = await two_holders(epp)
        w = Stream(epp)
        await w.ask(hinted(request(), [gone_ep]))
        pick = asyncio.create_task(w.ask(hinted(chat("only there"), [gone_ep])))
        await until(lambda: queued(epp)["normal"] == 1, "the hinted one never queued")
        services.remove_replica(epp.picker.by_endpoint[gone_ep])
        await finish(stay_s)  # a pass: nothing left in its subset
        im = (await asyncio.wait_for(pick, 10)).immediate_response
        assert im.status.code == 503
        assert orjson.loads(im.body)["error"]["message"] == (
            "No ready endpoint in the subset the gateway allowed is available.")
        await w.close()
        await finish(gone_s)  # the departed replica's request ends after it left
        nothing_held(epp)
    assert sorted(r.status for r in epp.records) == [200, 200, 503]


# what the mutations of the shared flow left green ------------------------------------------

async def test_a_hinted_request_is_counted_where_it_goes(two: list[str]) -> None:
    """Not queued: decided within the hint at once (no move from a pick outside it), its
    ticket and in-flight count on the hinted replica."""
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None and services.gate is not None
        for only in reversed(epp.endpoints):  # the router's own first choice, and not
            name = epp.picker.by_endpoint[only]
            s = Stream(epp)
            await s.ask(hinted(request(), [only]))
            assert picked(await s.ask(hinted(chat(f"a prompt for {only}"), [only])))[0] == only
            assert services.gate._admitted == {name: 1}
            assert {n: r.in_flight for n, r in services.fleet.replicas.items()
                    if r.in_flight} == {name: 1}
            await finish(s)
            nothing_held(epp)
    assert [r.replica for r in epp.records] == [
        epp.picker.by_endpoint[e] for e in reversed(epp.endpoints)]


async def test_a_session_moved_off_a_replica_is_recorded_so(two: list[str]) -> None:
    async with running_epp(two) as epp:
        services = epp.app.services
        assert services is not None
        session = [("x-session-id", "conversation-1")]
        s, task = await start(epp, "first turn", session)
        home = picked(await task)[0]
        await finish(s)
        services.fleet.replicas[epp.picker.by_endpoint[home]].healthy = False
        s, task = await start(epp, "second turn", session)
        assert picked(await task)[0] != home
        await finish(s)
        nothing_held(epp)
    assert [r.moved for r in epp.records] == [None, "unavailable"]



async def test_a_pick_without_a_known_endpoint_moves_the_conversation(two: list[str]) -> None:
    """The decision's replica has no endpoint the picker knows (the pool's endpoints not
    yet updated): the pick is another, and the router is told, so the next turn follows
    it there instead of going back to a replica the data plane cannot reach."""
    async with running_epp(two) as epp:
        session = [("x-session-id", "conversation-2")]
        s, task = await start(epp, "first turn", session)
        home = picked(await task)[0]
        await finish(s)
        known = dict(epp.picker.endpoints)
        epp.picker.set_endpoints({n: e for n, e in known.items() if e != home})
        s, task = await start(epp, "second turn", session)
        there = picked(await task)[0]
        assert there != home
        await finish(s)
        epp.picker.set_endpoints(known)
        s, task = await start(epp, "third turn", session)
        assert picked(await task)[0] == there
        await finish(s)
        nothing_held(epp)


async def test_an_unreachable_pick_is_probed(two: list[str]) -> None:
    async with running_epp(two) as epp:
        services = epp.app.services
        assert services is not None
        suspected: list[str] = []
        services.monitor.suspect = (  # type: ignore[method-assign]
            lambda replica: suspected.append(replica.name))
        s, task = await start(epp, "nobody home")
        pick = picked(await task)[0]
        failed = response_headers(503, content_type="text/plain")
        st = struct_pb2.Struct()
        st.update({decision.CODE_DETAILS:
                   "upstream_reset_before_response_started{connection_failure}"})
        failed.attributes["envoy.filters.http.ext_proc"].CopyFrom(st)
        await s.ask(failed)
        await s.close()
        assert suspected == [epp.picker.by_endpoint[pick]]
        nothing_held(epp)


# the queue's other answers through the picker ----------------------------------------------

async def test_a_waiter_past_its_class_limit_is_shed_and_nothing_is_held(one_of: list[str],
                                                                         ) -> None:
    short = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=8,
                            normal_max_wait_s=0.3)
    async with running_epp(one_of, admission=short) as epp:
        holder, first = await start(epp, "the holder")
        await first
        s, task = await start(epp, "waits too long")
        im = (await asyncio.wait_for(task, 10)).immediate_response
        assert im.status.code == 429
        assert orjson.loads(im.body)["error"]["code"] == "overloaded_wait_timeout"
        assert {h.header.key for h in im.headers.set_headers} >= {"retry-after"}
        await s.close()
        await finish(holder)
        nothing_held(epp)
    assert sorted(r.status for r in epp.records) == [200, 429]


async def test_a_displaced_low_waiter_is_answered_and_its_stream_ends(one_of: list[str],
                                                                      ) -> None:
    full = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=1,
                           default_priority_cap="high")
    async with running_epp(one_of, admission=full) as epp:
        holder, first = await start(epp, "the holder")
        await first
        low, low_task = await start(epp, "low waits", [("x-gateway-priority", "low")])
        await until(lambda: queued(epp)["low"] == 1, "low never queued")
        high, high_task = await start(epp, "high comes", [("x-gateway-priority", "high")])
        im = (await asyncio.wait_for(low_task, 10)).immediate_response
        assert im.status.code == 429
        assert orjson.loads(im.body)["error"]["code"] == "overloaded_displaced"
        await low.close()
        await finish(holder)
        await asyncio.wait_for(high_task, 10)
        await finish(high)
        nothing_held(epp)
    assert sorted(r.status for r in epp.records) == [200, 200, 429]


async def test_another_tenants_chain_is_not_found_through_the_picker(two: list[str]) -> None:
    keys = AuthSettings(keys={"ka": "alice", "kb": "bob"})
    async with running_epp(two, auth=keys, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None
        pinning.remember(services.affinity, "resp_alices", "alice",
                         epp.picker.by_endpoint[epp.endpoints[0]])
        s = Stream(epp)
        await s.ask(request([(":path", "/v1/responses"), ("authorization", "Bearer kb")]))
        resp = await s.ask(responses_body("read hers", previous_response_id="resp_alices"))
        err = orjson.loads(resp.immediate_response.body)["error"]
        assert (resp.immediate_response.status.code, err["code"]) == (404,
                                                                        "response_not_found")
        assert "127.0.0.1" not in err["message"]
        await s.close()
        nothing_held(epp)


async def test_a_request_served_elsewhere_is_counted_there(two: list[str]) -> None:
    """Envoy served it from the fallback: the gate's ticket follows it (the pick it left
    has room again at once, the replica serving it none), as the in-flight count does."""
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None and services.gate is not None
        s, task = await start(epp, "served by the fallback")
        pick = picked(await task)[0]
        (fallback,) = [e for e in epp.endpoints if e != pick]
        await s.ask(response_headers(200, served=fallback))
        by = epp.picker.by_endpoint
        assert services.gate._admitted == {by[fallback]: 1}
        assert {n: r.in_flight for n, r in services.fleet.replicas.items()} == {
            by[pick]: 0, by[fallback]: 1}
        s2, task2 = await start(epp, "the pick is free again")
        assert picked(await asyncio.wait_for(task2, 5))[0] == pick  # not queued
        await finish(s2)
        done = ext.ProcessingRequest()
        done.response_body.body = COMPLETION
        done.response_body.end_of_stream = True
        await s.ask(done)
        await s.close()
        nothing_held(epp)


async def test_a_waiter_takes_the_room_a_moved_request_left(two: list[str]) -> None:
    """At once, not at the next recheck (here 30 s away)."""
    slow = AdmissionConfig(enabled=True, replica_max_in_flight=1, max_queue=8,
                           recheck_s=30.0, own_replica_max_wait_s=0.0)
    async with running_epp(two, admission=slow) as epp:
        (moving, pick), (other, fallback) = await two_holders(epp)
        s, task = await start(epp, "waits for room")
        await until(lambda: queued(epp)["normal"] == 1, "it never queued")
        await moving.ask(response_headers(200, served=fallback))  # served elsewhere
        assert picked(await asyncio.wait_for(task, 5))[0] == pick
        for h in (s, moving, other):
            await finish(h)
        nothing_held(epp)


async def test_an_answer_at_the_headers_names_the_request(two: list[str]) -> None:
    """A bad key (401) and a stored response held by a replica that is down (503) are
    answered at the request's headers, with its x-request-id, as every other answer."""
    keys = AuthSettings(keys={"ka": "alice"})
    async with running_epp(two, auth=keys) as epp:
        services = epp.app.services
        assert services is not None
        pinning.remember(services.affinity, "resp_down", "alice",
                         epp.picker.by_endpoint[epp.endpoints[0]])
        services.fleet.replicas[epp.picker.by_endpoint[epp.endpoints[0]]].healthy = False
        for auth, path, status in (("Bearer nope", "/v1/models", 401),
                                   ("Bearer ka", "/v1/responses/resp_down", 503)):
            s = Stream(epp)
            req = call(path, "GET", auth)
            req.request_headers.headers.headers.add(key="x-request-id",
                                                    raw_value=b"client-id-1")
            im = (await s.ask(req)).immediate_response
            assert im.status.code == status
            sent = {h.header.key: h.header.raw_value for h in im.headers.set_headers}
            assert sent["x-request-id"] == b"client-id-1", (status, sent)
            await s.close()
        nothing_held(epp)
