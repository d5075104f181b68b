"""P/D legs through the real gateway on loopback (tests/pd_gateway.py), against replicas
that answer the legs as vLLM 0.32 does (tests/pd_replica.py), counting what each replica
received: the two legs' bodies, ids and answer, and what is recorded. A leg that fails:
test_pd_leg_failures.py; the decoder's KV pulled back on the next turn:
test_pd_decoder_kv.py.

Mutations seen failing here: the prefill body left streamed, with the client's max_tokens
or min_tokens; P's params not copied to D; another X-Request-Id on one leg; the threshold
ignored; /v1/embeddings forwarded to a prefill replica; the router not told that P holds
the prompt; D's prediction recorded (not P's) or judged by P's cached count; prefill
replicas left among the candidates."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.pd.config import PdConfig
from gateway.pd.legs import FRESH
from tests.pd_gateway import CHAT, gateway, replicas, sse_texts, url
from tests.pd_replica import P_CACHED


@pytest.mark.parametrize("stream", [False, True])
async def test_two_legs_bodies_ids_answer_and_record(stream: bool) -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        sent = {**CHAT, "stream": stream}
        r = await client.post(gw.url + "/v1/chat/completions", json=sent)
        assert r.status_code == 200, r.text
        assert (p.legs(), d.legs()) == (["prefill"], ["decode"])
        (pre,), (dec,) = p.bodies, d.bodies
        expected_p = {k: v for k, v in sent.items() if k not in ("min_tokens",)}
        assert pre == {**expected_p, "stream": False, "max_tokens": 1,
                       "kv_transfer_params": dict(FRESH)}
        # D: the client's body (min_tokens restored, usage asked of a stream) + P's params
        p_params = dec.pop("kv_transfer_params")
        assert p_params["remote_engine_id"] == "p1" and p_params["remote_port"] == p.port
        assert p_params["remote_block_ids"] == [[1, 2, 3, 4]]
        usage_asked = {"stream_options": {"include_usage": True}} if stream else {}
        assert dec == {**sent, **usage_asked}
        assert p.request_ids == d.request_ids and len(p.request_ids[0]) == 32
        assert r.headers["x-gateway-replica"] == "d1"
        assert r.headers["x-gateway-prefill"] == "p1"
        texts = sse_texts(r.content) if stream else [r.json()["choices"][0]["message"]["content"]]
        assert texts == ["d1:decode"]  # the client sees D's answer only
        (rec,) = gw.records
        assert (rec.replica, rec.prefill_replica, rec.transferred_tokens, rec.cached_from) == (
            "d1", "p1", 128, "prefill")
        assert rec.cached_tokens == P_CACHED and rec.status == 200
        assert rec.engine_request_id == p.request_ids[0].decode()
        assert gw.app.services is not None
        router = gw.app.services.router
        assert router.indexed_blocks("p1") > 0 and router.indexed_blocks("d1") > 0
        assert gw.stats()["pd"]["two_legs"] == 1
        assert gw.stats()["pd"]["transferred_tokens"] == 128


async def test_completions_take_two_legs_too() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        body = {"model": "m", "prompt": "once upon a time " * 40, "max_tokens": 20}
        r = await client.post(gw.url + "/v1/completions", json=body)
        assert r.status_code == 200
        assert (p.legs(), d.legs()) == (["prefill"], ["decode"])
        assert p.bodies[0]["max_tokens"] == 1 and d.bodies[0]["max_tokens"] == 20


async def test_the_threshold_keeps_a_short_uncached_prompt_on_d() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")],
            PdConfig(min_remote_prefill_tokens=100_000)) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and "x-gateway-prefill" not in r.headers
        assert (p.received, d.legs()) == (0, ["whole"])
        assert d.bodies[0] == CHAT
        assert gw.stats()["pd"]["decode_alone"]["cached"] == 1
        assert gw.records[0].prefill_replica is None


async def test_without_a_prefill_replica_nothing_changes() -> None:
    async with replicas(("a", "ok"), ("b", "ok")) as (a, b), gateway(
            [("a", url(a), "both"), ("b", url(b), "decode")],
            PdConfig(min_remote_prefill_tokens=0)) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and "x-gateway-prefill" not in r.headers
        assert a.legs() + b.legs() == ["whole"]
        assert (a.bodies + b.bodies)[0] == CHAT
        assert "pd" not in gw.stats()
        (rec,) = gw.records
        assert (rec.prefill_replica, rec.transferred_tokens, rec.cached_from) == (
            None, None, None)


async def test_other_endpoints_never_reach_a_prefill_replica() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")]) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        gw.busy("d1", 5)  # a prefill replica would win on load, were it a candidate
        for path, body in (("/v1/embeddings", {"model": "m", "input": "x"}),
                           ("/tokenize", {"model": "m", "prompt": "x"}),
                           ("/v1/embeddings", {"input": "no model"})):
            r = await client.post(gw.url + path, json=body)
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == "d1"
        assert (p.received, d.received) == (0, 3)
        gw.busy("d1", -5)


async def test_the_prediction_recorded_is_ps_and_ds_is_not_judged_by_ps_count() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok"), ("d2", "ok")) as (p, d1, d2), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d1), "decode"),
             ("d2", url(d2), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        assert gw.app.services is not None
        router = gw.app.services.router
        reported: list[int | None] = []
        original = router.report

        def spy(plan: Any, now: float) -> None:
            reported.append(plan.outcome.cached_tokens)
            original(plan, now)

        router.report = spy  # type: ignore[method-assign]
        gw.busy("d1", 5)  # turn 1 on d2 (and p1)
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        gw.busy("d1", -5)
        assert r.headers["x-gateway-replica"] == "d2"
        longer = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "and then? " * 40}]}
        gw.busy("d2", 50)  # turn 2 on d1, which holds nothing; p1 holds turn 1's prompt
        r = await client.post(gw.url + "/v1/chat/completions", json=longer)
        gw.busy("d2", -50)
        assert (r.headers["x-gateway-replica"], r.headers["x-gateway-prefill"]) == ("d1", "p1")
        first, second = gw.records
        assert first.predicted_cached_tokens == 0
        assert second.predicted_cached_tokens is not None and second.predicted_cached_tokens > 0
        # D's reported count is P's (vLLM >= 0.32): the router's feedback on D never sees it
        assert [rec.cached_tokens for rec in gw.records] == [P_CACHED, P_CACHED]
        assert reported == [None, None]
