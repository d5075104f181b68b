"""The picker in admission tried as an outsider would (review of issue 34), over real gRPC
on loopback in front of simulated replicas, each case ending with nothing held: every
replica's in-flight count back to zero, the gate's tickets given back, its queue empty.

- a waiter whose data plane restricted it with a subset hint is bound by the gate only
  within that subset (accounting and destination agree)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.epp import decision
from tests.servers import sim
from tests.test_epp_grpc import Epp, Stream, running_epp
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


def nothing_held(epp: Epp) -> None:
    s = epp.app.services
    assert s is not None and s.gate is not None
    assert {n: r.in_flight for n, r in s.fleet.replicas.items()} == dict.fromkeys(
        s.fleet.replicas, 0)
    assert s.gate._admitted == {}
    assert s.gate.stats()["queued"] == {"high": 0, "normal": 0, "low": 0}
    assert s.gate._count == 0


def hinted(req: ext.ProcessingRequest, hint: Sequence[str]) -> ext.ProcessingRequest:
    st = struct_pb2.Struct()
    st.update({decision.SUBSET: list(hint)})
    req.metadata_context.filter_metadata[decision.SUBSET_NAMESPACE].CopyFrom(st)
    return req


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

