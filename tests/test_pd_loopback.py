"""P/D legs through the real gateway (uvicorn, its aiohttp upstream) on loopback, against
replicas that answer the legs as vLLM 0.32 does (tests/pd_replica.py), counting what each
replica received.

Routing is `least_loaded` so a test can say which replica ranks first (a replica given a
few requests in flight by hand ranks last). Mutations seen failing here: the prefill
body left streamed, with the client's max_tokens or min_tokens; P's params not copied to
D; another X-Request-Id on one leg; a prefill leg not delivered taken as "D alone" (no
second P); a decode leg's 5xx relayed instead of answered by P; P's whole answer not
moved in the router; the threshold ignored; /v1/embeddings forwarded to a prefill
replica; the router not told that P holds the prompt; D's prediction recorded (not P's)
or judged by P's cached count; prefill replicas left among the candidates."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from gateway.pd.config import PdConfig
from gateway.pd.legs import FRESH
from gateway.proxy.app import GatewayApp, create_app
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.record import UsageRecord
from tests.pd_replica import P_CACHED, PdReplica
from tests.test_fault_hang import InProcessServer, free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me a story " * 40}],
        "max_tokens": 300, "min_tokens": 5}


@dataclass
class Gateway:
    url: str
    app: GatewayApp
    records: list[UsageRecord]

    def busy(self, name: str, n: int) -> None:
        """`name` gets `n` requests in flight by hand (ranks last under least_loaded)."""
        assert self.app.services is not None
        self.app.services.fleet.replicas[name].in_flight += n

    def mark_up(self, name: str) -> None:
        assert self.app.services is not None
        self.app.services.fleet.probe_result(name, True, time.time())

    def stats(self) -> dict[str, Any]:
        assert self.app.services is not None
        return self.app.stats(self.app.services)


@contextlib.asynccontextmanager
async def gateway(replicas: list[tuple[str, str, str]], pd: PdConfig | None = None,
                  ) -> AsyncIterator[Gateway]:
    """`replicas`: (name, url, role)."""
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=u, role=role, models=("m",))  # type: ignore[arg-type]
                       for n, u, role in replicas),
        server=ServerSettings(read_timeout_s=10, connect_timeout_s=5, health_timeout_s=5,
                              health_interval_s=60),
        routing=RoutingConfig(policy="least_loaded"),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=60),
        pd=pd or PdConfig(min_remote_prefill_tokens=16))
    async with served(settings) as gw:
        yield gw


@contextlib.asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[Gateway]:
    """A gateway with `settings` on a loopback port, its usage records kept."""
    app = create_app(settings)
    port = free_port()
    srv = InProcessServer(uvicorn.Config(app, host="127.0.0.1", port=port, loop="none",
                                         lifespan="on", log_config=None, access_log=False))
    task = asyncio.create_task(srv.serve())
    deadline = time.monotonic() + 10
    while not srv.started:
        assert not task.done() and time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.01)
    records: list[UsageRecord] = []
    assert app.services is not None
    recorder = app.services.recorder
    original = recorder.record

    def spy(rec: UsageRecord, departed: bool = False) -> None:
        records.append(rec)
        original(rec, departed)

    recorder.record = spy  # type: ignore[method-assign]
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app, records)
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def replicas(*specs: tuple[str, str]) -> AsyncIterator[list[PdReplica]]:
    """(name, mode) each."""
    started = [PdReplica(n, m) for n, m in specs]
    for r in started:
        await r.start()
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


def url(r: PdReplica) -> str:
    return f"http://127.0.0.1:{r.port}"


def sse_texts(raw: bytes) -> list[str]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            doc = orjson.loads(line[6:])
            out += [c["delta"].get("content", "") for c in doc.get("choices", [])]
            assert "usage" not in doc or doc["usage"] is None  # not asked: stripped
    return out


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


def reuse(**kw: Any) -> PdConfig:
    return PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True, **kw)


def next_turn(body: dict[str, Any], answer: str, user: str) -> dict[str, Any]:
    return {**body, "messages": [*body["messages"], {"role": "assistant", "content": answer},
                                 {"role": "user", "content": user}]}


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
