"""A decode leg that reached no decode replica (each try not delivered) is answered whole
by the prefill replica, which holds the prompt's KV, instead of a 502 (gateway.pd.failures
says why that second request to P keeps "each engine at most once"); loopback, with the
deliveries counted per engine.

Mutation seen failing here: the handler raising the last try's error (the 502) instead
of PullFailed when no decode replica is left."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.pd_gateway import CHAT, gateway, replicas, sse_texts, url


@pytest.mark.parametrize("stream", [False, True])
async def test_no_decode_replica_delivered_is_answered_by_p(stream: bool) -> None:
    # ports bound and never listened on, held for the whole test: connecting is refused,
    # and no other server (the suite's own) can take them meanwhile, as it could a port
    # freed after picking it (seen once: a "gone" decode replica answered 200)
    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        refused = (s1.getsockname()[1], s2.getsockname()[1])
        await _answered_by_p(stream, refused)


async def _answered_by_p(stream: bool, refused: tuple[int, int]) -> None:
    async with replicas(("p1", "ok")) as (p,), gateway(
            [("p1", url(p), "prefill"),
             ("gone1", f"http://127.0.0.1:{refused[0]}", "decode"),
             ("gone2", f"http://127.0.0.1:{refused[1]}", "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        gw.mark_up("gone1")
        gw.mark_up("gone2")
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200 and r.headers["x-gateway-replica"] == "p1"
        texts = sse_texts(r.content) if stream else [r.json()["choices"][0]["message"]["content"]]
        assert texts == ["p1:whole"]
        # P: its prefill leg, then the whole request once; no D received anything
        assert p.legs() == ["prefill", "whole"]
        assert p.request_ids[0] == p.request_ids[1]
        pd = gw.stats()["pd"]
        assert pd["prefill_alone"] == 1
        assert pd["transfer_failures"]["decode"] == {"not_delivered": 1}
