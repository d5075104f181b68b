"""What the picker's outsider tests share (tests/test_flow_epp_outsider.py and
tests/test_flow_epp_stored.py): the end-of-case check that nothing is held, a data plane's
subset hint on a request, body-less calls and Responses bodies, and two holders (one
request on each replica, so that the next one queues)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.epp import decision
from tests.test_epp_grpc import MODEL, Epp, Stream
from tests.test_flow_epp_admission import picked, start


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


def call(path: str, method: str, auth: str) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":path", path), (":method", method), ("authorization", auth)):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = method != "POST"
    return req


def responses_body(content: str, **extra: object) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    req.request_body.body = orjson.dumps({"model": MODEL, "input": content, **extra})
    req.request_body.end_of_stream = True
    return req


async def two_holders(epp: Epp) -> list[tuple[Stream, str]]:
    holders = []
    for i in range(2):
        s, task = await start(epp, f"holder {i}")
        holders.append((s, picked(await asyncio.wait_for(task, 10))[0]))
    assert {ep for _, ep in holders} == set(epp.endpoints)  # one on each
    return holders
