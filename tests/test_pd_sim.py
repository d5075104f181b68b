"""P/D end to end: `gateway serve --prefill URL --decode URL` in front of the simulator's
prefill and decode roles (`gateway sim --role`, faithful to vLLM 0.32's NixlConnector),
both as processes. Turn 1 takes two legs and D pulls the prompt (its transfer count rises);
with `[pd] reuse_decoder_kv`, turn 2 (an exact extension) sends D's params with the
prefill leg and P pulls the conversation back (P's transfer count rises); an edited turn
is prefilled afresh (P's does not). The answers, the records and /stats say so."""

from __future__ import annotations

import re
from typing import Any

import httpx

from tests.servers import gateway, sim
from tests.sim_http import FAST, MODEL

XFER = re.compile(r'^vllm:nixl_xfer_time_seconds_count\{[^}]*\} (\S+)$', re.M)


def transfers(base: str) -> float:
    found = XFER.findall(httpx.get(base + "/metrics", timeout=10).text)
    return sum(float(v) for v in found)


def ask(gw: str, msgs: list[dict[str, Any]]) -> httpx.Response:
    r = httpx.post(gw + "/v1/chat/completions", timeout=60, headers={"x-session-id": "c-1"},
                   json={"model": MODEL, "messages": msgs, "max_tokens": 96, "min_tokens": 96,
                         "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_two_legs_and_the_decoders_kv_pulled_back_on_the_simulator() -> None:
    long = " ".join(f"word{i}" for i in range(400))
    with sim(2, [*FAST, "--role", "prefill", "--role", "decode", "--bidirectional-kv-xfer",
                 "--decoder-kv-ttl-s", "600000"]) as (p, d), \
            gateway([], ["--prefill", p, "--decode", d],
                    env={"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "64",
                         "GATEWAY_PD__REUSE_DECODER_KV": "true"}) as gw:
        turn1 = [{"role": "user", "content": long}]
        r = ask(gw, turn1)
        assert (r.headers["x-gateway-replica"], r.headers["x-gateway-prefill"]) == (
            d.removeprefix("http://"), p.removeprefix("http://"))
        assert transfers(d) == 1 and transfers(p) == 0  # D pulled the prompt from P
        answer = r.json()["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer},
                 {"role": "user", "content": " ".join(f"more{i}" for i in range(200))}]
        ask(gw, turn2)
        assert transfers(p) == 1  # P pulled turn 1's conversation back from D
        assert transfers(d) == 2
        edited = [*turn1, {"role": "assistant", "content": "an answer D never gave"},
                  {"role": "user", "content": " ".join(f"other{i}" for i in range(200))}]
        ask(gw, edited)
        assert transfers(p) == 1  # afresh: nothing pulled back
        stats = httpx.get(gw + "/stats", timeout=10).json()["pd"]
        assert stats["two_legs"] == 3 and stats["decoder_kv"]["pulled_back"] == 1
        assert stats["transfer_failures"] == {"prefill": {}, "decode": {}}
