"""`gateway sim --role prefill|decode` over loopback: the two legs as vLLM's NixlConnector
answers them (P's kv_transfer_params, D's pull, its usage and metrics), a pull that fails
(consumed or expired lease, unknown engine) answered as vLLM does with the policy "fail",
and the bidirectional turn: D's params, P pulling them back."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from tests.servers import sim
from tests.sim_http import FAST, MODEL, scrape

LONG = " ".join(f"word{i}" for i in range(300))  # a few hundred tokens
FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}
XFER = 'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"}'
FAILED = ('vllm:nixl_num_failed_transfers_total{engine="0",'
          'model_name="Qwen/Qwen2.5-7B-Instruct"}')


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[str]]:
    # 1 ms a token: a transfer's time stands out in the timings
    with sim(3, [*FAST, "--role", "prefill", "--role", "decode", "--role", "both",
                 "--kv-transfer-us-per-token", "1000"]) as urls:
        yield urls


@pytest.fixture(scope="module")
def bidirectional() -> Iterator[list[str]]:
    # The decoder's TTL is simulated time: at --speed 1000, 480 s would be half a second.
    # --stream-kv-params: a stream's final chunk carries D's params (vLLM 0.32's does not:
    # test_a_stream_carries_no_params_as_vllm_writes_it)
    with sim(2, [*FAST, "--role", "prefill", "--role", "decode", "--bidirectional-kv-xfer",
                 "--stream-kv-params", "--decoder-kv-ttl-s", "600000",
                 "--contract", "0.24"]) as urls:
        yield urls


def test_a_stream_carries_no_params_as_vllm_writes_it() -> None:
    """vLLM 0.32 writes kv_transfer_params on whole answers only (its chunk type has no
    such field), bidirectional or not: the simulator's default stream has none, and its
    whole answer has them."""
    with sim(2, [*FAST, "--role", "prefill", "--role", "decode",
                 "--bidirectional-kv-xfer"]) as (p, d):
        msgs = messages("no params in a stream " + LONG)
        for stream in (True, False):
            first = prefill(p, msgs, f"s-{stream}")
            body = decode_body(msgs, first["kv_transfer_params"], max_tokens=8, stream=stream,
                               stream_options={"include_usage": True} if stream else None)
            r = post(d, body, f"s-{stream}")
            assert r.status_code == 200
            if stream:
                assert all("kv_transfer_params" not in c for c in sse_chunks(r))
            else:
                assert r.json()["kv_transfer_params"]["do_remote_decode"] is True


def post(base: str, body: dict[str, Any], rid: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Request-Id": rid})


def messages(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def prefill(base: str, msgs: list[dict[str, Any]], rid: str,
            kv: dict[str, Any] | None = None) -> dict[str, Any]:
    r = post(base, {"model": MODEL, "messages": msgs, "max_tokens": 1, "stream": False,
                    "kv_transfer_params": kv or FRESH}, rid)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    body["timing"] = orjson.loads(r.headers["x-sim-timing"])  # FAST: --timing-comments
    return body


def decode_body(msgs: list[dict[str, Any]], kv: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": msgs, "max_tokens": 8, "kv_transfer_params": kv, **kw}


def cached(body: dict[str, Any]) -> int:
    n: int = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


def test_prefill_then_decode(fleet: list[str]) -> None:
    p, d, _ = fleet
    msgs = messages("legs " + LONG)
    start = scrape(d)
    before, before_sum = start.get(XFER, 0.0), start.get(XFER.replace("_count", "_sum"), 0.0)
    first = prefill(p, msgs, "pd-1")
    kv = first["kv_transfer_params"]
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 1 and cached(first) == 0
    assert set(kv) == {"do_remote_prefill", "do_remote_decode", "remote_block_ids",
                       "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                       "tp_size", "remote_num_tokens", "remote_prefill_cached_tokens"}
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_num_tokens"] == n and kv["remote_prefill_cached_tokens"] == 0
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == -(-n // 16)
    assert kv["remote_request_id"] == "chatcmpl-pd-1"
    r = post(d, decode_body(msgs, kv), "pd-1")
    assert r.status_code == 200, r.text
    out = r.json()
    # vLLM >= 0.32: P's cached count, not the transferred prompt; no params without
    # bidirectional transfer.
    assert out["usage"]["prompt_tokens"] == n and cached(out) == 0
    assert out["usage"]["completion_tokens"] == 8 and out["kv_transfer_params"] is None
    metrics = scrape(d)
    assert metrics[XFER] == before + 1
    assert metrics[XFER.replace("_count", "_sum")] - before_sum == pytest.approx(n * 0.001)
    # A benchmark's TTFT covers both legs and the transfer: P's time, n ms, D's step.
    p_time = first["timing"]["e2e_ms"]
    d_ttft = orjson.loads(r.headers["x-sim-timing"])["ttft_ms"]
    assert 0 < p_time + n < d_ttft < p_time + n + 100
    # The pulled blocks are D's cache now: the same prompt on D alone hits them.
    again = post(d, {"model": MODEL, "messages": msgs, "max_tokens": 2}, "pd-1b").json()
    assert cached(again) == (n - 1) // 16 * 16
    # P's second prefill of the prompt is a hit there, and D reports P's count.
    second = prefill(p, msgs, "pd-2")
    assert cached(second) == (n - 1) // 16 * 16
    assert second["kv_transfer_params"]["remote_prefill_cached_tokens"] == cached(second)
    r = post(d, decode_body(msgs, second["kv_transfer_params"]), "pd-2")
    assert cached(r.json()) == cached(second)


def failed_count(base: str) -> float:
    return scrape(base).get(FAILED, 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_consumed_lease_or_unknown_engine_fails(fleet: list[str], stream: bool) -> None:
    p, d, _ = fleet
    msgs = messages(f"fail {stream} " + LONG)
    kv = prefill(p, msgs, f"f-{stream}")["kv_transfer_params"]
    assert post(d, decode_body(msgs, kv), f"f-{stream}").status_code == 200
    before = failed_count(d)
    for bad in (kv, {**kv, "remote_engine_id": "no-such-engine"}):
        r = post(d, decode_body(msgs, bad, stream=stream), f"f-{stream}")
        if not stream:
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "InternalServerError" and err["code"] == 500
            assert "KV load failed" in err["message"]
        else:
            assert r.status_code == 200  # the stream's headers went first, as vLLM's
            events = r.text.split("\n\n")[:-1]
            assert events[-1] == "data: [DONE]" and len(events) == 2
            assert orjson.loads(events[0].removeprefix("data: "))["error"]["code"] == 500
    assert failed_count(d) == before + 2


def test_a_replica_without_a_connector_ignores_the_params(fleet: list[str]) -> None:
    both = fleet[2]
    body = post(both, {"model": MODEL, "messages": messages("plain"), "max_tokens": 1,
                       "kv_transfer_params": FRESH}, "plain").json()
    assert body["kv_transfer_params"] is None
    assert "vllm:nixl_xfer_time_seconds_count" not in httpx.get(both + "/metrics").text
    bad = post(fleet[0], {"model": MODEL, "messages": messages("x"),
                          "kv_transfer_params": {"do_remote_decode": 1}}, "bad")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"


def test_an_expired_lease_fails_the_pull() -> None:
    with sim(2, [*FAST, "--role", "prefill", "--role", "decode", "--kv-lease-s", "0"]) as urls:
        p, d = urls
        msgs = messages("expired " + LONG)
        kv = prefill(p, msgs, "exp")["kv_transfer_params"]
        r = post(d, decode_body(msgs, kv), "exp")
        assert r.status_code == 500 and "lease expired" in r.json()["error"]["message"]
        assert failed_count(d) == 1


def sse_chunks(r: httpx.Response) -> list[dict[str, Any]]:
    events = r.text.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    return [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]
            if e.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_bidirectional_turn_two_pulls_from_the_decoder(bidirectional: list[str],
                                                       stream: bool) -> None:
    p, d = bidirectional
    msgs = messages(f"agent {stream} " + LONG)
    first = prefill(p, msgs, f"t1-{stream}")
    n = first["usage"]["prompt_tokens"]
    body = decode_body(msgs, first["kv_transfer_params"], max_tokens=150, stream=stream,
                       stream_options={"include_usage": True} if stream else None)
    r = post(d, body, f"t1-{stream}")
    assert r.status_code == 200
    if stream:
        chunks = sse_chunks(r)
        assert all("kv_transfer_params" not in c for c in chunks[:-1])
        last = chunks[-1]
        assert last["choices"] == [] and "usage" in last  # the final chunk: usage
        usage, back = last["usage"], last["kv_transfer_params"]
        answer = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]
                         if c["choices"])
    else:
        out = r.json()
        usage, back = out["usage"], out["kv_transfer_params"]
        answer = out["choices"][0]["message"]["content"]
    # contract 0.24: D reports the pulled prompt as cached (older engines did).
    assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert back["do_remote_decode"] is True and back["do_remote_prefill"] is False
    assert back["remote_num_tokens"] == n + 150 - 1
    assert back["remote_blocks_expiry_time"] > 0
    before = scrape(p).get(XFER, 0.0)
    turn2 = [*msgs, {"role": "assistant", "content": answer},
             {"role": "user", "content": "and then?"}]
    second = prefill(p, turn2, f"t2-{stream}", kv=back)
    # P held the first prompt; it pulled D's answer instead of computing it.
    assert cached(second) > (n - 1) // 16 * 16 + 64
    assert scrape(p)[XFER] == before + 1
    # Used once: the decoder's lease is gone.
    third = post(p, {"model": MODEL, "messages": turn2, "max_tokens": 1,
                     "kv_transfer_params": back}, f"t3-{stream}")
    assert third.status_code == 500


@pytest.mark.parametrize(("lease_s", "pull"), [(60, True), (1, False)])
def test_a_prefill_waiting_for_room_runs_when_a_lease_is_released_or_expires(
        lease_s: int, pull: bool) -> None:
    """A lease pins P's blocks: a prefill that does not fit beside it waits, and runs once
    D pulls (the release wakes P; the 60 s lease would not) or the lease expires (P wakes
    itself)."""
    flags = [*FAST, "--kv-blocks", "40", "--role", "prefill", "--role", "decode",
             "--kv-lease-s", str(lease_s)]
    words = " ".join(f"w{i}" for i in range(150))  # 21 of the 39 blocks, one shared
    with sim(2, flags) as urls, ThreadPoolExecutor(1) as pool:
        p, d = urls
        msgs = messages(f"first {words}")
        kv = prefill(p, msgs, "room-a")["kv_transfer_params"]
        assert len(kv["remote_block_ids"][0]) == 21
        waiting = pool.submit(prefill, p, messages(f"second {words}"), "room-b")
        if pull:
            assert post(d, decode_body(msgs, kv), "room-a").status_code == 200
        # bounded: a P that is never woken answers nothing within it
        assert waiting.result(timeout=20)["usage"]["completion_tokens"] == 1
