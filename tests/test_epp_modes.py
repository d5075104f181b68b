"""The picker over real gRPC on loopback in each processing mode a data plane may
configure, the mode named in the stream's first message (`protocol_config`) as Envoy
names it: the protocol's own cases (the ones the llm-d router's hermetic EPP tests
cover) and the exact shape of every answer. Replicas are real simulated ones (the picker
probes them); the picker sends them nothing itself, so every check is on what it answers
and records."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.epp import decision, messages, modes
from tests.epp_wire import (
    USAGE_JSON,
    USAGE_SSE,
    Wire,
    chat,
    chunks,
    headers,
    lb,
    request_trailers,
    response_body,
    response_headers,
    set_headers,
    streamed,
)
from tests.servers import sim
from tests.test_epp_grpc import MODEL, running_epp

FD, ST, BUF, PART, NONE = (modes.FULL_DUPLEX_STREAMED, modes.STREAMED, modes.BUFFERED,
                           modes.BUFFERED_PARTIAL, modes.NONE)


@pytest.fixture(scope="module")
def urls() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found



# full duplex: the request -----------------------------------------------------------

@pytest.mark.parametrize(("length", "want_length"), [
    (None, True),  # chunked: Content-Length is set
    ("wrong", True),
    ("right", False),  # the body goes back as it came: nothing to fix
])
async def test_full_duplex_request_answer_shape(urls: list[str], length: str | None,
                                                want_length: bool) -> None:
    raw = chat("split in three " * 40)
    extra = [] if length is None else [
        ("content-length", str(len(raw)) if length == "right" else "3")]
    async with running_epp(urls, response="body") as epp:
        w = Wire(epp)
        await w.send(headers(extra=extra), *chunks(raw, 3))
        first, *body = await w.read(2)
        # one headers response carrying the pick, then the body; nothing before the end
        assert first.WhichOneof("response") == "request_headers"
        hr = first.request_headers
        assert hr.response.clear_route_cache
        got = set_headers(hr)
        pick = got.pop(decision.DESTINATION)
        assert got == ({"content-length": str(len(raw))} if want_length else {})
        assert pick in epp.endpoints  # one address: ORIGINAL_DST reads it so
        assert lb(first).split(",")[0] == pick
        assert set(lb(first).split(",")) == set(epp.endpoints)  # the fallback too
        assert streamed(body, "request_body") == (raw, [True])
        await w.close()
    assert epp.records[0].replica is not None


async def test_a_large_body_in_many_chunks_goes_back_whole(urls: list[str]) -> None:
    raw = chat(bytes(range(33, 127)).decode() * ((1 << 20) // 94 + 1))
    assert len(raw) > 1 << 20
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(raw, 64))
        (first,) = await w.read(1)
        assert first.WhichOneof("response") == "request_headers"
        n = -(-len(raw) // messages.BODY_PIECE)
        body, ends = streamed(await w.read(n), "request_body")
        assert body == raw and ends == [False] * (n - 1) + [True]
        await w.close()


async def test_request_trailers_end_the_request(urls: list[str]) -> None:
    raw = chat("with trailers")
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(raw, 2, end=False), request_trailers())
        first, second, third = await w.read(3)
        assert first.WhichOneof("response") == "request_headers"
        assert streamed([second], "request_body") == (raw, [False])  # trailers follow
        assert third.WhichOneof("response") == "request_trailers"
        await w.close()


@pytest.mark.parametrize("which", ["all", "some", "none"])
async def test_subset_hint(urls: list[str], which: str) -> None:
    async with running_epp(urls) as epp:
        hint = {"all": epp.endpoints, "some": epp.endpoints[1:],
                "none": ["10.9.9.9:8000"]}[which]
        w = Wire(epp)
        await w.send(headers(hint=hint), *chunks(chat(f"hinted {which}"), 2))
        (first,) = await w.read(1)
        if which == "none":
            im = first.immediate_response
            assert im.status.code == 503
            assert orjson.loads(im.body)["error"]["message"] == (
                "No ready endpoint in the subset the gateway allowed is available.")
            assert await w.ended()
        else:
            assert set(lb(first).split(",")) == set(hint)  # fallbacks inside it too
            await w.close()
    if which == "none":
        assert epp.records[-1].status == 503


@pytest.mark.parametrize(("raw", "code"), [
    (b'{"model": "' + MODEL.encode() + b'", "messages": [', "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "missing_required_parameter"),
])
async def test_a_bad_body_is_a_400_in_openais_shape(urls: list[str], raw: bytes,
                                                   code: str) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(raw, 2))
        (first,) = await w.read(1)
        im = first.immediate_response
        assert im.status.code == 400
        assert orjson.loads(im.body)["error"]["code"] == code
        assert await w.ended()
    (rec,) = epp.records
    assert rec.status == 400


async def test_a_body_over_the_limit_is_a_413(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        assert epp.app.services is not None
        limit = epp.app.services.settings.server.max_body_bytes
        w = Wire(epp)
        part = ext.ProcessingRequest()
        part.request_body.body = b"x" * (limit // 2 + 1)
        await w.send(headers(), part, part)  # the second goes past the limit, not at end
        (first,) = await w.read(1)
        im = first.immediate_response
        assert im.status.code == 413
        assert orjson.loads(im.body)["error"]["code"] == "request_too_large"
        assert await w.ended()
    (rec,) = epp.records
    assert rec.status == 413


async def test_a_header_only_get_is_picked_at_its_headers(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers("/v1/models", "GET", end=True))
        (first,) = await w.read(1)
        hr = first.request_headers
        assert hr.response.clear_route_cache
        assert set(set_headers(hr)) == {decision.DESTINATION}
        assert set_headers(hr)[decision.DESTINATION] == lb(first).split(",")[0]
        # the answer: headers, then the body passed back, the record ended at its end
        await w.send(response_headers(), response_body(b'{"data": []}', True))
        rh, rb = await w.read(2)
        assert not rh.HasField("mode_override")  # full duplex is never overridden
        assert streamed([rb], "response_body") == (b'{"data": []}', [True])
        await w.close()
    assert epp.records[-1].route == "forward"


# full duplex: the response -----------------------------------------------------------

@pytest.mark.parametrize(("content_type", "parts"), [
    ("text/event-stream", USAGE_SSE),
    ("application/json", [USAGE_JSON[:40], USAGE_JSON[40:90], USAGE_JSON[90:]]),
])
async def test_response_chunks_pass_back_and_usage_is_read(
        urls: list[str], content_type: str, parts: list[bytes]) -> None:
    async with running_epp(urls, response="body") as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(chat("usage"), 1))
        await w.read(2)
        await w.send(response_headers(content_type=content_type))
        (rh,) = await w.read(1)
        assert rh.WhichOneof("response") == "response_headers"
        assert set_headers(rh.response_headers)["x-gateway-replica"]
        for i, p in enumerate(parts):  # each chunk back as it comes, before the next
            await w.send(response_body(p, i == len(parts) - 1))
            assert streamed(await w.read(1), "response_body") == (
                p, [i == len(parts) - 1])
        await w.close()
    (rec,) = epp.records
    assert (rec.status, rec.prompt_tokens, rec.cached_tokens) == (200, 7, 5)


def queued(epp: object) -> float:
    """The prefill the router counts as sent and not yet begun, over the fleet."""
    router = epp.app.services.router  # type: ignore[attr-defined]
    return float(sum(router.queued_by_replica().values()))


@pytest.mark.parametrize(("mode", "at_headers"), [
    # the field's configuration (llm-d, Istio, kgateway): the stream's chunks pass through
    # the picker even under the default `[epp] response = "json"`: its first chunk ends it
    ((FD, FD), False),
    # the project's file: the stream's body is turned off (mode override NONE), so its
    # headers are all the picker sees of it
    ((BUF, NONE), True),
])
async def test_a_streams_queued_prefill_ends_at_its_first_chunk_where_chunks_pass(
        urls: list[str], mode: tuple[int, int], at_headers: bool) -> None:
    body = orjson.dumps({"model": MODEL, "stream": True,
                         "messages": [{"role": "user", "content": "prefill " * 400}]})
    async with running_epp(urls) as epp:  # `[epp] response` left at its default, "json"
        w = Wire(epp)
        await w.send(headers(mode=mode), *chunks(body, 1))
        await w.read(2)  # the pick
        assert queued(epp) > 0  # sent, not begun
        # an engine sends a stream's headers before its prefill
        await w.send(response_headers(content_type="text/event-stream"))
        await w.read(1)
        assert (queued(epp) == 0) is at_headers
        if not at_headers:
            await w.send(response_body(USAGE_SSE[0], False))  # the first token
            await w.read(1)
            assert queued(epp) == 0
            await w.send(response_body(USAGE_SSE[1] + USAGE_SSE[2], True))
            await w.read(1)
        await w.close()
    (rec,) = epp.records
    assert rec.status == 200 and (rec.ttft_ms is not None)


async def test_response_trailers_are_answered_and_end_the_record(urls: list[str]) -> None:
    async with running_epp(urls, response="body") as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(chat("trailers"), 1))
        await w.read(2)
        await w.send(response_headers(content_type="text/event-stream"),
                     response_body(USAGE_SSE[0] + USAGE_SSE[1] + USAGE_SSE[2], False),
                     ext.ProcessingRequest(response_trailers=ext.HttpTrailers()))
        _, rb, rt = await w.read(3)
        assert streamed([rb], "response_body")[1] == [False]
        assert rt.WhichOneof("response") == "response_trailers"
        assert len(epp.records) == 1  # ended at the trailers, not at the stream's close
        await w.close()
    assert (epp.records[0].status, epp.records[0].cached_tokens) == (200, 5)


# the other modes -----------------------------------------------------------------------

async def test_buffered_picks_in_the_body_response(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(mode=(BUF, NONE)))
        (hr,) = await w.read(1)
        assert hr.WhichOneof("response") == "request_headers"
        assert not hr.request_headers.response.HasField("header_mutation")
        await w.send(*chunks(chat("buffered"), 1))
        (br,) = await w.read(1)
        assert br.WhichOneof("response") == "request_body"
        assert br.request_body.response.clear_route_cache
        assert set_headers(br.request_body)[decision.DESTINATION] == lb(br).split(",")[0]
        assert not br.request_body.response.HasField("body_mutation")  # the body is Envoy's
        # the JSON answer asked for whole (mode override), read, answered "continue"
        await w.send(response_headers())
        (rh,) = await w.read(1)
        assert rh.mode_override.response_body_mode == PART
        await w.send(response_body(USAGE_JSON, True))
        (rb,) = await w.read(1)
        assert rb.WhichOneof("response") == "response_body"
        assert not rb.response_body.response.HasField("body_mutation")
        await w.close()
    assert (epp.records[0].prompt_tokens, epp.records[0].cached_tokens) == (7, 5)


@pytest.mark.parametrize(("raw", "end", "picked"), [
    (chat("whole"), True, True),
    (chat("whole, trailers follow"), False, True),
    (chat("over Envoy's buffer")[:30], False, False),  # a first part only: 413
])
async def test_buffered_partial(urls: list[str], raw: bytes, end: bool, picked: bool) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(mode=(PART, NONE)))
        await w.read(1)
        await w.send(*chunks(raw, 1, end=end))
        (br,) = await w.read(1)
        if picked:
            assert set_headers(br.request_body)[decision.DESTINATION] in epp.endpoints
        else:
            assert br.immediate_response.status.code == 413
        await w.close()


async def test_no_request_body_mode_picks_at_the_headers(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(mode=(NONE, NONE)))
        (hr,) = await w.read(1)
        assert set_headers(hr.request_headers)[decision.DESTINATION] in epp.endpoints
        await w.close()


@pytest.mark.parametrize("without_waiting", [False, True])
async def test_streamed(urls: list[str], without_waiting: bool) -> None:
    raw = chat("streamed " * 30)
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(mode=(ST, ST), without_waiting=without_waiting))
        if not without_waiting:  # Envoy waits for the headers answer: the pick is there
            (hr,) = await w.read(1)
            assert set_headers(hr.request_headers)[decision.DESTINATION] in epp.endpoints
        await w.send(*chunks(raw, 3))
        got = await w.read(4 if without_waiting else 3)
        if without_waiting:  # gathered: the pick first, then each chunk answered
            assert set_headers(got.pop(0).request_headers)[decision.DESTINATION]
        assert [r.WhichOneof("response") for r in got] == ["request_body"] * 3
        assert not any(r.request_body.response.HasField("body_mutation") for r in got)
        await w.close()
    # gathered: routed on the prompt; picked at the headers: as a body-less call
    assert (epp.records[0].route == "forward") is not without_waiting


# the served endpoint ---------------------------------------------------------------------

async def test_served_from_the_fallback_the_next_turn_follows(urls: list[str]) -> None:
    """Envoy reports (`x-gateway-destination-endpoint-served`) that a fallback served the
    request: the router is told, so the conversation's next turn goes there."""
    history = [{"role": "system", "content": "A long shared system prompt. " * 40},
               {"role": "user", "content": "first question"}]
    async with running_epp(urls, response="body") as epp:
        w = Wire(epp)
        await w.send(headers(), *chunks(orjson.dumps({"model": MODEL, "messages": history}), 1))
        first, _ = await w.read(2)
        _, fallback = lb(first).split(",")
        await w.send(response_headers(served=fallback), response_body(USAGE_JSON, True))
        await w.read(2)
        await w.close()
        history += [{"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "second question"}]
        w = Wire(epp)
        await w.send(headers(), *chunks(orjson.dumps({"model": MODEL, "messages": history}), 1))
        second, _ = await w.read(2)
        assert set_headers(second.request_headers)[decision.DESTINATION] == fallback
        await w.close()
        assert epp.app.services is not None
        assert not any(r.in_flight for r in epp.app.services.fleet.replicas.values())


# the conformance suite's hooks ---------------------------------------------------------

@pytest.mark.parametrize("on", [True, False])
async def test_conformance_hooks(urls: list[str], on: bool) -> None:
    async with running_epp(urls, conformance=on) as epp:
        for chosen in epp.endpoints:
            w = Wire(epp)
            await w.send(headers(extra=[(decision.TEST_SELECTION, chosen)]),
                         *chunks(chat("same prompt every time"), 1))
            first, _ = await w.read(2)
            pick = set_headers(first.request_headers)[decision.DESTINATION]
            if on:
                assert lb(first) == chosen  # that endpoint and no other, no fallback
            await w.send(response_headers(served=pick))
            (rh,) = await w.read(1)
            echoed = set_headers(rh.response_headers).get(decision.TEST_SERVED)
            assert echoed == (pick if on else None)
            await w.close()
        w = Wire(epp)
        await w.send(headers(extra=[(decision.TEST_SELECTION, "10.9.9.9:80")]),
                     *chunks(chat("nowhere"), 1))
        (first,) = await w.read(1)
        assert (first.immediate_response.status.code == 503) is on
        await w.close()
