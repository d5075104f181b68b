"""The fixes of the outside review of P/D (issue 35) beyond tests/test_pd_review.py's own
cases, on loopback against the vLLM-like double (tests/pd_replica.py):

- F1: a client's `kv_transfer_params` are dropped while the body is parsed, whatever the
  fleet: with no prefill replica at all (a `both` fleet whose engines run NixlConnector),
  on every inference endpoint and on a forwarded `/v1/*` body;
- F3: a turn without the generation prompt (`add_generation_prompt` false) never begins
  the next turn's prompt (its bytes lack the assistant's header);
- F4: a streamed answer that carried reasoning is not remembered either;
- F6: a prefill replica at admission's `replica_max_in_flight` is passed over: the
  decode replica computes the prompt alone.

Mutations seen failing here: the strip in RequestFlow.prepare removed (the fleet and
endpoint rows), the strip in Proxy._forward_other removed (the forwarded row),
normalize rendering the generation prompt whatever `add_generation_prompt` says,
StreamAnswer not marking reasoning, PdPath._prefill not checking the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest

from gateway.pd.config import PdConfig
from gateway.pd.legs import FRESH
from tests.pd_gateway import CHAT, next_turn, replicas, url
from tests.test_pd_review import LEASE, VICTIM, gateway, params_sent, until

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "once upon a time " * 40}),
    "responses": ("/v1/responses", {"model": "m", "input": "tell me a story " * 40}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 50,
                                  "messages": [{"role": "user", "content": "a story"}]}),
    "forwarded": ("/v1/embeddings", {"model": "m", "input": "embed me"}),
}


@pytest.mark.parametrize("injected", [VICTIM, LEASE], ids=["decode-shape", "prefill-shape"])
@pytest.mark.parametrize("what", list(BODIES))
async def test_a_both_fleet_never_sends_a_clients_kv_transfer_params(
        what: str, injected: dict[str, Any]) -> None:
    """No prefill replica: P/D never runs, yet a `both` replica running NixlConnector
    would still load the blocks a client names from the engine it names."""
    path, body = BODIES[what]
    async with replicas(("b1", "ok"),) as (b,), gateway(
            [("b1", url(b), "both")], PdConfig()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + path, json={**body, "kv_transfer_params": injected})
        assert r.status_code == 200, r.text
        assert b.received == 1
        assert params_sent(b) == [None], f"the client's params reached an engine: {b.bodies}"
        assert {k: v for k, v in b.bodies[0].items() if k != "stream_options"} == {
            k: v for k, v in body.items() if k != "stream_options"}


async def test_a_turn_without_the_generation_prompt_is_prefilled_afresh_next() -> None:
    """`add_generation_prompt: false`: D's KV covers a prompt without the assistant's
    header, which the next turn renders before the same answer."""
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")],
            PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True)) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions",
                              json={**CHAT, "add_generation_prompt": False}, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        r = await client.post(gw.url + "/v1/chat/completions",
                              json=next_turn(CHAT, answer, "and then? " * 40), headers=headers)
        assert r.status_code == 200 and p.bodies[1]["kv_transfer_params"] == dict(FRESH)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_streamed_reasoning_answer_is_not_remembered(field: str) -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")],
            PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True)) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        d.reasoning = (field, "let me think this through step by step " * 30)
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions",
                              json={**CHAT, "stream": True}, headers=headers)
        assert r.status_code == 200 and b"let me think" in r.content
        assert b"kv_transfer_params" not in r.content
        assert gw.stats()["pd"]["decoder_kv"]["remembered"] == 0
        turn2 = next_turn(CHAT, "d1:decode", "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=turn2, headers=headers)
        assert r.status_code == 200 and p.bodies[1]["kv_transfer_params"] == dict(FRESH)


async def test_a_streamed_answer_without_reasoning_is_still_remembered() -> None:
    """The control of the case above: the same stream without thinking is kept."""
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")],
            PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True)) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions",
                              json={**CHAT, "stream": True}, headers=headers)
        assert r.status_code == 200
        assert gw.stats()["pd"]["decoder_kv"]["remembered"] == 1
        turn2 = next_turn(CHAT, "d1:decode", "and then? " * 40)
        r = await client.post(gw.url + "/v1/chat/completions", json=turn2, headers=headers)
        assert r.status_code == 200
        assert p.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "d1-d"


@pytest.mark.parametrize("cap", [1, 2])
async def test_a_prefill_replica_at_the_cap_is_passed_over(cap: int) -> None:
    """The first request's prefill leg holds P (it never answers); the second, admitted
    on the other decode replica, finds P at a cap of 1 and is computed there alone; under
    a cap of 2 its prefill leg goes to P."""
    async with replicas(("p1", "hang"), ("d1", "ok"), ("d2", "ok")) as (p, d1, d2), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d1), "decode"),
             ("d2", url(d2), "decode")],
            PdConfig(min_remote_prefill_tokens=16), admission=True, max_in_flight=cap,
            read_timeout_s=30) as gw, httpx.AsyncClient(timeout=30) as client:
        first = asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=CHAT))
        try:
            await until(lambda: p.received == 1, "P has the first prefill leg")
            other = {**CHAT, "messages": [{"role": "user", "content": "another story " * 40}]}
            second = asyncio.create_task(client.post(gw.url + "/v1/chat/completions",
                                                     json=other))
            if cap == 1:
                r = await asyncio.wait_for(second, 20)
                assert r.status_code == 200, r.text
                assert p.received == 1 and d1.legs() + d2.legs() == ["whole"]
                assert gw.stats()["pd"]["decode_alone"]["prefill_full"] == 1
            else:
                await until(lambda: p.received == 2, "the second prefill leg on P")
                second.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await second
        finally:
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
