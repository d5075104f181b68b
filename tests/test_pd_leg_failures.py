"""P/D legs through the real gateway on loopback (tests/pd_gateway.py) when a leg fails: a
prefill leg that fails or is not delivered, a pull that fails, a decode leg's 4xx or one
not delivered, a client gone during the prefill leg.

Mutations seen failing here: a prefill leg not delivered taken as "D alone" (no second P);
a decode leg's 5xx relayed instead of answered by P; P's whole answer not moved in the
router."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from tests.pd_gateway import CHAT, gateway, replicas, sse_texts, url
from tests.servers import free_port


@pytest.mark.parametrize(("mode", "failure"), [
    ("500", "server_error"), ("400", "client_error"), ("read-close", "broken"),
    ("noparams", "no_params"),
])
async def test_a_failed_prefill_leg_leaves_d_alone(mode: str, failure: str) -> None:
    async with replicas(("p1", mode), ("p2", "ok"), ("d1", "ok")) as (p1, p2, d), gateway(
            [("p1", url(p1), "prefill"), ("p2", url(p2), "prefill"),
             ("d1", url(d), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.busy("p2", 5)  # p1 ranks first
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        gw.busy("p2", -5)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
            "d1:whole"
        # delivered to p1 once, never to another P, D computed the prompt itself
        assert (p1.legs(), p2.received, d.legs()) == (["prefill"], 0, ["whole"])
        assert d.bodies[0] == CHAT
        pd = gw.stats()["pd"]
        assert pd["decode_alone"]["prefill_failed"] == 1 and pd["two_legs"] == 0
        assert pd["transfer_failures"]["prefill"] == {failure: 1}
        assert gw.records[0].prefill_replica is None


async def test_a_prefill_leg_not_delivered_goes_to_the_next_prefill_replica() -> None:
    refused = free_port()
    async with replicas(("p2", "ok"), ("d1", "ok")) as (p2, d), gateway(
            [("gone", f"http://127.0.0.1:{refused}", "prefill"), ("p2", url(p2), "prefill"),
             ("d1", url(d), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.mark_up("gone")  # its last probe passed, then it went away
        gw.busy("p2", 5)  # "gone" ranks first
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        gw.busy("p2", -5)
        assert r.status_code == 200 and r.headers["x-gateway-prefill"] == "p2"
        assert (p2.legs(), d.legs()) == (["prefill"], ["decode"])
        pd = gw.stats()["pd"]
        assert pd["transfer_failures"]["prefill"] == {"not_delivered": 1}
        assert pd["two_legs"] == 1


async def test_no_prefill_replica_delivered_leaves_d_alone() -> None:
    refused = free_port()
    async with replicas(("d1", "ok"),) as (d,), gateway(
            [("gone", f"http://127.0.0.1:{refused}", "prefill"),
             ("d1", url(d), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.mark_up("gone")
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and d.legs() == ["whole"]
        assert gw.stats()["pd"]["decode_alone"]["prefill_failed"] == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("mode", "failure"), [("500", "server_error"),
                                                ("read-close", "broken")])
async def test_a_failed_pull_is_answered_by_p_alone(mode: str, failure: str,
                                                    stream: bool) -> None:
    async with replicas(("p1", "ok"), ("d1", mode)) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200, r.text
        texts = sse_texts(r.content) if stream else [r.json()["choices"][0]["message"]["content"]]
        assert texts == ["p1:whole"]
        assert r.headers["x-gateway-replica"] == "p1"
        # each leg once per engine; P's whole request is the client's, as one replica gets it
        assert (p.legs(), d.legs()) == (["prefill", "whole"], ["decode"])
        usage_asked = {"stream_options": {"include_usage": True}} if stream else {}
        assert p.bodies[1] == {**CHAT, "stream": stream, **usage_asked}
        pd = gw.stats()["pd"]
        assert pd["prefill_alone"] == 1 and pd["transfer_failures"]["decode"] == {failure: 1}
        (rec,) = gw.records
        assert (rec.replica, rec.prefill_replica, rec.status) == ("p1", "p1", 200)
        # the router moved the request to P: D never computed (nor pulled) the prompt
        assert gw.app.services is not None
        router = gw.app.services.router
        assert router.indexed_blocks("d1") == 0 < router.indexed_blocks("p1")


async def test_a_decode_leg_4xx_is_relayed_and_nothing_is_sent_again() -> None:
    async with replicas(("p1", "ok"), ("d1", "400")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 400 and b"bad" in r.content
        assert (p.legs(), d.legs()) == (["prefill"], ["decode"])
        assert gw.stats()["pd"]["prefill_alone"] == 0


async def test_a_decode_leg_not_delivered_goes_to_the_next_decode_replica() -> None:
    refused = free_port()
    async with replicas(("p1", "ok"), ("d2", "ok")) as (p, d2), gateway(
            [("p1", url(p), "prefill"), ("gone", f"http://127.0.0.1:{refused}", "decode"),
             ("d2", url(d2), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.mark_up("gone")
        gw.busy("d2", 5)  # "gone" is D
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        gw.busy("d2", -5)
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "d2"
        assert (p.legs(), d2.legs()) == (["prefill"], ["decode"])  # P's params, another D
        assert d2.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "p1"


async def test_a_client_gone_during_the_prefill_leg_cancels_it_and_sends_nothing_to_d() -> None:
    async with replicas(("p1", "hang"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw:
        async with httpx.AsyncClient(timeout=10) as client:
            call = asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=CHAT))
            for _ in range(1000):  # bounded: until P has the leg
                if p.received:
                    break
                await asyncio.sleep(0.01)
            assert p.received == 1
            call.cancel()  # the client goes
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await asyncio.wait_for(p.closed.wait(), 10)  # P's connection dropped: it aborts
        assert d.received == 0
        for _ in range(1000):
            if gw.records:
                break
            await asyncio.sleep(0.01)
        assert gw.records[0].status == 499
        assert gw.app.services is not None
        assert gw.app.services.fleet.replicas["p1"].in_flight == 0
