"""The picker and stored responses, tried as an outsider would (review of issue 34), over
real gRPC on loopback in front of simulated replicas, each case ending with nothing held:

- calls on one stored response (`GET`/`DELETE /v1/responses/{id}`,
  `POST /v1/responses/{id}/cancel`) go to the replica that created it, as in serve
  (404 when it left, 503 when it is down, another tenant's id a 404);
- a streamed Responses answer pins its continuation; a continuation pinned outside the
  data plane's subset hint is a 503 at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.epp import decision
from gateway.settings import AuthSettings
from tests.epp_outsider import call, hinted, nothing_held, responses_body, two_holders
from tests.servers import sim
from tests.test_epp_grpc import MODEL, Epp, Stream, response_headers, running_epp
from tests.test_flow_epp_admission import ONE_EACH, finish, picked, request


@pytest.fixture(scope="module")
def two() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found


# calls on one stored response ------------------------------------------------------------

async def stored_call(epp: Epp, path: str, method: str, auth: str,
                      ) -> ext.ProcessingResponse:
    """One body-less call on a stored response (`POST .../cancel` with an empty body);
    the picker's answer to it (the pick, or an immediate response)."""
    s = Stream(epp)
    resp = await s.ask(call(path, method, auth))
    if method == "POST" and resp.HasField("request_headers"):
        empty = ext.ProcessingRequest()
        empty.request_body.end_of_stream = True
        resp = await s.ask(empty)
    if not resp.HasField("immediate_response"):
        await s.ask(response_headers(200))
    await s.close()
    return resp


def target(resp: ext.ProcessingResponse) -> str:
    phase = resp.request_body if resp.HasField("request_body") else resp.request_headers
    return {h.header.key: h.header.raw_value.decode()
            for h in phase.response.header_mutation.set_headers}[decision.DESTINATION]


def error(resp: ext.ProcessingResponse) -> tuple[int, str, str]:
    im = resp.immediate_response
    err = orjson.loads(im.body)["error"]
    return im.status.code, err["code"], err["param"]


STORED = [("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"),
          ("POST", "/v1/responses/{}/cancel")]


async def test_stored_response_calls_go_to_their_creator(two: list[str]) -> None:
    keys = AuthSettings(keys={"ka": "alice", "kb": "bob"})
    alice, bob = "Bearer ka", "Bearer kb"
    async with running_epp(two, auth=keys) as epp:
        services = epp.app.services
        assert services is not None
        creator_ep, other_ep = epp.endpoints
        # alice's answer is made on the first replica (the hint puts it there)
        s = Stream(epp)
        await s.ask(hinted(request([("authorization", alice), (":path", "/v1/responses")]),
                           [creator_ep]))
        first = ext.ProcessingRequest()
        first.request_body.body = orjson.dumps({"model": MODEL, "input": "remember me"})
        first.request_body.end_of_stream = True
        assert picked(await s.ask(first))[0] == creator_ep
        await s.ask(response_headers(200))
        answer = ext.ProcessingRequest()
        answer.response_body.body = orjson.dumps({
            "id": "resp_alice1", "object": "response", "status": "completed", "output": [],
            "usage": {"input_tokens": 5, "output_tokens": 1}})
        answer.response_body.end_of_stream = True
        await s.ask(answer)
        await s.close()
        creator = epp.picker.by_endpoint[creator_ep]
        # the creator busier than the other: least busy alone would send them elsewhere
        services.fleet.replicas[creator].in_flight += 5
        for method, path in STORED:
            resp = await stored_call(epp, path.format("resp_alice1"), method, alice)
            assert target(resp) == creator_ep, (method, path)  # no fallback either
            assert epp.records[-1].route == "response"
        services.fleet.replicas[creator].in_flight -= 5
        for method, path in STORED:  # another tenant's id: as the engine's unknown id
            resp = await stored_call(epp, path.format("resp_alice1"), method, bob)
            assert error(resp) == (404, "response_not_found", "response_id")
        services.fleet.replicas[creator].healthy = False
        for method, path in STORED:
            resp = await stored_call(epp, path.format("resp_alice1"), method, alice)
            assert error(resp) == (503, "previous_response_unavailable", "response_id")
        services.fleet.replicas[creator].healthy = True
        services.fleet.remove(creator)  # left (its stored state with it)
        resp = await stored_call(epp, "/v1/responses/resp_alice1", "GET", alice)
        assert error(resp) == (404, "previous_response_lost", "response_id")
        # an id the gateway never saw: any replica (the engine answers)
        resp = await stored_call(epp, "/v1/responses/resp_unknown", "GET", alice)
        assert target(resp).split(",")[0] == other_ep
        nothing_held(epp)


async def test_a_streamed_responses_answer_pins_its_continuation(two: list[str]) -> None:
    """`[epp] response = "body"`: the id is read from the stream's `response.created`."""
    async with running_epp(two, response="body") as epp:
        creator_ep = epp.endpoints[1]
        s = Stream(epp)
        await s.ask(hinted(request([(":path", "/v1/responses")]), [creator_ep]))
        assert picked(await s.ask(hinted(responses_body("stream it", stream=True),
                                         [creator_ep])))[0] == creator_ep
        await s.ask(response_headers(200, content_type="text/event-stream"))
        event = ext.ProcessingRequest()
        event.response_body.body = (
            b'event: response.created\ndata: {"type": "response.created", "response": '
            b'{"id": "resp_streamed1", "status": "in_progress", "usage": null}}\n\n')
        await s.ask(event)
        end = ext.ProcessingRequest()
        end.response_body.end_of_stream = True
        await s.ask(end)
        await s.close()
        creator = epp.picker.by_endpoint[creator_ep]
        assert epp.app.services is not None
        epp.app.services.fleet.replicas[creator].in_flight += 3  # least busy: the other
        s = Stream(epp)
        await s.ask(request([(":path", "/v1/responses")]))
        resp = await s.ask(responses_body("go on", previous_response_id="resp_streamed1"))
        assert picked(resp)[0] == creator_ep
        await s.close()
        epp.app.services.fleet.replicas[creator].in_flight -= 3
        nothing_held(epp)
    assert epp.records[-1].route == "response"


async def test_a_continuation_pinned_outside_the_hint_is_a_503_at_once(two: list[str]) -> None:
    async with running_epp(two, admission=ONE_EACH) as epp:
        services = epp.app.services
        assert services is not None
        creator_ep, other_ep = epp.endpoints
        services.affinity.remember("resp_there", epp.picker.by_endpoint[creator_ep])
        (s1, _), (s2, _) = await two_holders(epp)  # no room anywhere: it would queue
        s = Stream(epp)
        await s.ask(hinted(request([(":path", "/v1/responses")]), [other_ep]))
        resp = await asyncio.wait_for(s.ask(hinted(
            responses_body("go on", previous_response_id="resp_there"), [other_ep])), 5)
        assert resp.immediate_response.status.code == 503
        await s.close()
        for h in (s1, s2):
            await finish(h)
        nothing_held(epp)
