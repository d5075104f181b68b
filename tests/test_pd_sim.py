"""P/D end to end: `gateway serve --prefill URL --decode URL` in front of the simulator's
prefill and decode roles (`gateway sim --role`, faithful to vLLM 0.32's NixlConnector),
both as processes. Turn 1 takes two legs and D pulls the prompt (its transfer count rises);
with `[pd] reuse_decoder_kv`, turn 2 (an exact extension) sends D's params with the
prefill leg and P pulls the conversation back (P's transfer count rises); an edited turn
is prefilled afresh (P's does not). The answers, the records and /stats say so."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.usage.logfile import read_records
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


def engines(gw: str, p: str) -> dict[str, Any]:
    """P's own split in /stats `pd`, once a scrape after turn 2 shows its pull (bounded)."""
    name = p.removeprefix("http://")
    deadline = time.monotonic() + 30
    while True:
        split = httpx.get(gw + "/stats", timeout=10).json()["pd"]["prefill_engines"][name]
        if split["external_kv_transfer"] or time.monotonic() > deadline:
            return split
        time.sleep(0.1)


def test_the_usage_log_says_what_p_found_and_what_it_pulled_back(tmp_path: Path) -> None:
    """Turn 1: P cold (its own report 0, nothing pulled back); turn 2 with the decoder's
    params: P's report is its own hits plus what it pulled from D; the record splits them
    (estimated from P's prediction: gateway.pd.accounting) and /stats counts the pulled
    apart from the hits; P's engine split (`vllm:prompt_tokens_by_source`) gives the exact
    figure in /stats `pd`."""
    log = tmp_path / "usage.jsonl"
    long = " ".join(f"word{i}" for i in range(400))
    with sim(2, [*FAST, "--role", "prefill", "--role", "decode", "--bidirectional-kv-xfer",
                 "--decoder-kv-ttl-s", "600000"]) as (p, d), \
            gateway([], ["--prefill", p, "--decode", d],
                    env={"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "64",
                         "GATEWAY_PD__REUSE_DECODER_KV": "true",
                         "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.2",
                         "GATEWAY_USAGE__LOG_PATH": str(log)}) as gw:
        turn1 = [{"role": "user", "content": long}]
        answer = ask(gw, turn1).json()["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": answer},
                 {"role": "user", "content": " ".join(f"more{i}" for i in range(200))}]
        ask(gw, turn2)
        assert transfers(p) == 1  # P pulled turn 1's conversation back from D
        split = engines(gw, p)
        stats = httpx.get(gw + "/stats", timeout=10).json()
    first, second = list(read_records(log.read_bytes().splitlines()))
    assert (first.cached_from, first.prefill_cached_tokens) == ("prefill", 0)
    assert first.pulled_tokens is None and first.pulled_exact is None
    assert first.cached_tokens == 0  # D's copy of P's report
    assert second.cached_from == "decoder_kv"
    own, predicted = second.prefill_cached_tokens, second.predicted_cached_tokens
    assert own is not None and predicted is not None and second.cached_tokens == own
    # P's report is at the pull level (turn 1's prompt and answer): a pull cannot be told
    # from P's own hits, so the count is the report less P's prediction, an estimate
    assert second.pulled_exact is False
    assert second.pulled_tokens == (own - min(predicted, own)
                                    if own - min(predicted, own) >= 64 else 0)
    pulled = second.pulled_tokens
    window = stats["windows"]["all"]
    assert window["pulled_tokens"] == pulled == stats["pd"]["decoder_kv"]["pulled_tokens"]
    # pulled tokens are neither hits nor misses
    assert window["cached_tokens"] == own - pulled
    assert window["cached_ratio"] == pytest.approx(
        (own - pulled) / (first.prompt_tokens + second.prompt_tokens - pulled))
    # the engine's exact split: P loaded D's answer at least (over the threshold), and its
    # own hits and the loaded make up what it reported on the two prefill legs
    assert split["external_kv_transfer"] >= 64
    # one conversation on a quiet P: P's prediction (turn 1's prompt, not D's answer) is
    # what it held, so the estimate is the engine's own count
    assert pulled == split["external_kv_transfer"]
    assert split["local_cache_hit"] + split["external_kv_transfer"] == own
