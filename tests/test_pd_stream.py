"""P/D answers through the real gateway on loopback (tests/pd_replica.py's doubles): the
engine's kv_transfer_params never reach the client, whole or streamed, and a streamed
turn's params and text are kept for turn two without re-prefill as a whole answer's are.

Mutations seen failing here: relay not stripping the JSON body or the stream; the
stream's params not read into the outcome; the stream's text not collected."""

from __future__ import annotations

import httpx
import pytest

from gateway.pd.legs import FRESH
from tests.pd_gateway import CHAT, gateway, next_turn, replicas, reuse, sse_texts, url

LEAKS = (b"kv_transfer_params", b"remote_block_ids", b"remote_host")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decoders_params_never_reach_the_client(stream: bool) -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                              headers={"x-session-id": "conv-1"})
        assert r.status_code == 200 and d.legs() == ["decode"]
        assert not [k for k in LEAKS if k in r.content]
        texts = sse_texts(r.content) if stream else [r.json()["choices"][0]["message"]["content"]]
        assert texts == ["d1:decode"]
        # read before it was removed: kept for the next turn
        assert gw.stats()["pd"]["decoder_kv"]["remembered"] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_whole_answers_params_never_reach_the_client_either(stream: bool) -> None:
    async with replicas(("d1", "ok")) as (d,), gateway([("d1", url(d), "both")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        d.params_on_whole = True
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200 and d.legs() == ["whole"]
        assert not [k for k in LEAKS if k in r.content]


async def test_a_streamed_turn_is_pulled_back_on_an_exact_next_turn() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        turn1 = {**CHAT, "stream": True}
        r = await client.post(gw.url + "/v1/chat/completions", json=turn1, headers=headers)
        answer = "".join(sse_texts(r.content))
        turn2 = next_turn(turn1, answer, "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=turn2, headers=headers)
        assert r.status_code == 200 and p.legs() == ["prefill", "prefill"]
        pulled = p.bodies[1]["kv_transfer_params"]
        assert pulled["remote_engine_id"] == "d1-d" and pulled["remote_block_ids"] == [[7, 8]]
        assert [rec.cached_from for rec in gw.records] == ["prefill", "decoder_kv"]
        # an edited streamed history: a fresh prefill
        edited = next_turn(turn2, "not what d1 said", "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=edited, headers=headers)
        assert r.status_code == 200 and p.bodies[2]["kv_transfer_params"] == dict(FRESH)
        assert gw.stats()["pd"]["decoder_kv"] == {"remembered": 3, "pulled_back": 1,
                                                  "pulled_tokens": 0}


async def test_with_reuse_off_a_stream_keeps_nothing() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              headers=headers)
        r = await client.post(gw.url + "/v1/chat/completions",
                              json=next_turn(CHAT, "".join(sse_texts(r.content)), "more " * 40),
                              headers=headers)
        assert r.status_code == 200 and p.bodies[1]["kv_transfer_params"] == dict(FRESH)
        assert gw.stats()["pd"]["decoder_kv"] == {"remembered": 0, "pulled_back": 0,
                                                  "pulled_tokens": 0}
