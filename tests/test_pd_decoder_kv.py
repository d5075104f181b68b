"""P/D through the real gateway on loopback (tests/pd_gateway.py) with `reuse_decoder_kv`:
the next turn's prefill leg pulls the decoder's KV back only for an exact extension of the
conversation, never from a decoder restarted since, never after P answered alone."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.pd.legs import FRESH
from tests.pd_gateway import CHAT, gateway, next_turn, replicas, reuse, url


@pytest.mark.parametrize("session", [True, False])  # a session id, or an implicit one
async def test_turn_two_sends_the_decoders_params_only_for_an_exact_extension(
        session: bool) -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"} if session else {}
        turn1 = CHAT
        r = await client.post(gw.url + "/v1/chat/completions", json=turn1, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        assert p.bodies[0]["kv_transfer_params"] == dict(FRESH)
        turn2 = next_turn(turn1, answer, "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=turn2, headers=headers)
        assert r.status_code == 200 and p.legs() == ["prefill", "prefill"]
        # P is sent D's params of turn 1 (asking to pull them), D P's params of turn 2
        pulled = p.bodies[1]["kv_transfer_params"]
        assert pulled["remote_engine_id"] == "d1-d" and pulled["do_remote_decode"] is True
        assert pulled["remote_block_ids"] == [[7, 8]]
        assert d.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "p1"
        assert [rec.cached_from for rec in gw.records] == ["prefill", "decoder_kv"]
        # turn 3 edits the history: a fresh prefill, nothing pulled back
        edited = next_turn(turn2, "a different answer", "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=edited, headers=headers)
        assert r.status_code == 200 and len(p.bodies) == 3
        assert p.bodies[2]["kv_transfer_params"] == dict(FRESH)
        assert gw.stats()["pd"]["decoder_kv"] == {"remembered": 3, "pulled_back": 1,
                                                  "pulled_tokens": 0}


async def test_a_decoder_restarted_since_is_not_pulled_from() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        assert gw.app.services is not None
        gw.app.services.router.replica_restarted("d1", time.time())  # its KV is gone
        r = await client.post(gw.url + "/v1/chat/completions",
                              json=next_turn(CHAT, answer, "and then? " * 40), headers=headers)
        assert r.status_code == 200 and p.bodies[1]["kv_transfer_params"] == dict(FRESH)
        assert gw.stats()["pd"]["decoder_kv"]["pulled_back"] == 0


async def test_a_prefill_replica_answering_alone_leaves_no_params_for_the_next_turn() -> None:
    async with replicas(("p1", "ok"), ("d1", "500")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        p.params_on_whole = True
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT,
                              headers={"x-session-id": "conv-1"})
        # P's own params were on its answer (removed before the client: gateway.pd.answer)
        assert r.status_code == 200 and "kv_transfer_params" not in r.json()
        assert r.json()["choices"][0]["message"]["content"] == "p1:whole"
        assert gw.stats()["pd"]["decoder_kv"]["remembered"] == 0
