"""Token mode in `gateway serve`, end to end on loopback: `gateway sim --kv-events`
replicas publish vLLM's KV events, the gateway discovers them through
`GET /kv_event_sources`, checks token parity, subscribes, and predicts each request's
cached tokens from the events; a replica without events stays in text mode."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.filler import words
from tests.servers import free_ports, gateway, sim

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

BLOCK = 16
TOKEN_ENV = {"GATEWAY_TOKENS__MODELS": "sim=sim"}


def chat(client: httpx.Client, url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    r = client.post(url + "/v1/chat/completions",
                    json={"model": "sim", "messages": messages, "max_tokens": 16})
    assert r.status_code == 200, r.text
    return r


def token_mode(client: httpx.Client, url: str) -> dict[str, Any]:
    got: dict[str, Any] = client.get(url + "/stats").json()["token_mode"]
    return got


def wait_live(client: httpx.Client, url: str, n: int) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        tm = token_mode(client, url)
        if sum(r.get("state") == "live" for r in tm["replicas"].values()) == n:
            return tm
        assert time.monotonic() < deadline, tm
        time.sleep(0.1)


def records(path: Path, n: int) -> list[dict[str, Any]]:
    """The first n chat usage records (the file sink writes them in the background)."""
    deadline = time.monotonic() + 10
    while True:
        text = path.read_text() if path.exists() else ""
        got = [json.loads(line) for line in text.splitlines() if line.strip()]
        got = [r for r in got if r.get("endpoint") == "chat"]
        if len(got) >= n:
            return got[:n]
        assert time.monotonic() < deadline, got
        time.sleep(0.05)


def test_events_drive_predictions_and_a_reset_is_seen(tmp_path: Path) -> None:
    log = tmp_path / "usage.jsonl"
    kv_port = free_ports(4)
    rng = random.Random(3)
    convs = [[{"role": "system", "content": f"You are agent {i}. " + words(rng, 300)},
              {"role": "user", "content": words(rng, 30)}] for i in range(3)]
    with (
        sim(2, ["--model", "sim", "--speed", "50", "--kv-events", "--kv-events-port",
                str(kv_port), "--dev-mode"]) as urls,
        gateway(urls, ["--policy", "prefix"],
                env={**TOKEN_ENV, "GATEWAY_USAGE__LOG_PATH": str(log)}) as url,
        httpx.Client(timeout=30) as client,
    ):
        tm = wait_live(client, url, 2)
        for name, rep in tm["replicas"].items():
            assert rep["parity"]["ok"], (name, rep)
            pub = kv_port + 2 * urls.index("http://" + name)
            assert rep["sources"] == [f"tcp://127.0.0.1:{pub}"]
        # Another client warms replica 1 directly: only its events can tell the gateway.
        warm = [{"role": "system", "content": "Shared prompt. " + words(rng, 300)},
                {"role": "user", "content": words(rng, 20)}]
        other = urls[1][len("http://"):]
        held = tm["replicas"][other]["held_blocks"]
        chat(client, urls[1], warm)
        deadline = time.monotonic() + 10
        while token_mode(client, url)["replicas"][other]["held_blocks"] <= held:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = chat(client, url, warm)
        assert r.headers["x-gateway-replica"] == other
        rec = records(log, 1)[0]
        assert rec["predicted_cached_tokens"] == rec["cached_tokens"] > 300

        where: dict[int, str] = {}
        for _turn in range(4):
            for i, msgs in enumerate(convs):
                r = chat(client, url, msgs)
                where[i] = r.headers["x-gateway-replica"]
                msgs += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words(rng, 30)}]
        recs = records(log, 13)
        off = [(r["predicted_cached_tokens"], r["cached_tokens"]) for r in recs
               if abs(r["predicted_cached_tokens"] - r["cached_tokens"]) >= BLOCK]
        assert not off, off
        assert sum(r["cached_tokens"] for r in recs) > 0.6 * sum(r["prompt_tokens"]
                                                                  for r in recs)

        # A prefix-cache reset: vLLM publishes AllBlocksCleared with its next engine step
        # (the simulator too), so the request that makes that step is still predicted from
        # the old blocks; from the request after, the index knows.
        target = where[0]
        deadline = time.monotonic() + 10  # refused while a block is in use (vLLM 0.32)
        while not client.post(f"http://{target}/reset_prefix_cache").json()["success"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(2):
            r = chat(client, url, convs[0])
            convs[0] += [{"role": "assistant",
                          "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": words(rng, 30)}]
        after = records(log, 15)[-2:]
        assert after[0]["replica"] == target and after[0]["cached_tokens"] == 0
        assert after[1]["predicted_cached_tokens"] == after[1]["cached_tokens"]
        assert token_mode(client, url)["replicas"][target]["cleared"] >= 1


def test_a_replica_without_events_is_routed_in_text_mode() -> None:
    rng = random.Random(4)
    msgs = [{"role": "system", "content": words(rng, 300)},
            {"role": "user", "content": words(rng, 20)}]
    with (
        sim(1, ["--model", "sim", "--speed", "50"]) as urls,
        gateway(urls, ["--policy", "prefix"], env=TOKEN_ENV) as url,
        httpx.Client(timeout=30) as client,
    ):
        first = chat(client, url, msgs)
        second = chat(client, url, msgs)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert first.headers["x-gateway-route"] == "cold"
        rep = token_mode(client, url)["replicas"][urls[0][len("http://"):]]
    assert rep["state"] == "text mode"
    assert "publishes no KV events" in rep["problem"]


def test_a_replica_whose_tokens_differ_stays_in_text_mode() -> None:
    """The tiny test model's tokenizer is not the simulator's: parity fails, and the
    replica is routed in text mode rather than by tokens that can never match."""
    model = Path(__file__).parent / "data" / "tiny-model"
    kv_port = free_ports(2)
    rng = random.Random(5)
    msgs = [{"role": "system", "content": words(rng, 200)},
            {"role": "user", "content": words(rng, 20)}]
    with (
        sim(1, ["--model", "sim", "--speed", "50", "--kv-events", "--kv-events-port",
                str(kv_port)]) as urls,
        gateway(urls, env={"GATEWAY_TOKENS__MODELS": f"sim={model}"}) as url,
        httpx.Client(timeout=30) as client,
    ):
        name = urls[0][len("http://"):]
        deadline = time.monotonic() + 20
        while "parity" not in (rep := token_mode(client, url)["replicas"][name]):
            assert time.monotonic() < deadline, rep
            time.sleep(0.05)
        chat(client, url, msgs)
        second = chat(client, url, msgs)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        rep = token_mode(client, url)["replicas"][name]
    assert rep["parity"]["ok"] is False and rep["parity"]["cause"] in ("template", "tokenizer")
    assert rep["state"] == "text mode"
    assert rep["problem"].startswith("token parity failed")
