"""A second outside review of P/D (issue 35): the accounting of a prefill leg's report
(gateway.pd.accounting), Responses/Messages legs and `[pd] reuse_decoder_kv`'s check, on
tables and on loopback against the vLLM-like double (tests/pd_replica.py).

Tests that fail on main are findings (the review's report names their suspected causes);
the others pin a decision that a mutation changed with every P/D test before them still
passing: `reported - local > threshold` (for >=) in read_prefill, _account passing 64
for `[pd] kv_recompute_threshold`, _account using a fixed block for P's scraped one, and
_account judging a P replaced while its leg ran. Each was seen failing here."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.pd.accounting import PrefillReport, read_prefill
from gateway.pd.answer import MAX_EVENT_BYTES, StreamAnswer
from gateway.pd.config import PdConfig
from gateway.pd.pullback import PullBack
from gateway.pd.reuse import DecoderKvMemory
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache
from gateway.usage.record import UsageRecord
from tests.pd_gateway import CHAT, gateway, next_turn, replicas, url
from tests.pd_replica import PROMPT_TOKENS
from tests.test_pd_review import until

MODEL = Path(__file__).parent / "data" / "tiny-model"
PARAMS = {"do_remote_decode": True, "remote_block_ids": [[7]], "remote_num_tokens": 22,
          "remote_engine_id": "d1-engine", "remote_request_id": "r1",
          "remote_host": "127.0.0.1", "remote_port": 5600}


# 1. The reuse check in token mode: bytes that match, tokens that do not -----------------

def _token_mode() -> tuple[Fleet, Router, PullBack, TokenRenderer]:
    renderer = TokenRenderer("tiny", load_template(MODEL),
                             TokenizerCache.from_file(MODEL / "tokenizer.json"), 32)
    index = KVIndex(KVConfig(predict_ttl_s=2.0))
    index.add_replica("d1", "tiny", 32)
    index.set_connected("d1", True, 0.0)
    fleet = Fleet([ReplicaSettings(name="d1", url="http://d1:1", role="decode")])
    fleet.probe_result("d1", True, time.time())
    router = Router(RoutingConfig(seed=1), TokenMode({"tiny": renderer}, index))
    return fleet, router, PullBack(PdConfig(reuse_decoder_kv=True), fleet, router), renderer


CUT = "Once upon a time the cat sat on the ma"
WHOLE = "Once upon a time the cat sat on the mat."


@pytest.mark.parametrize(("prompt", "reply", "rest", "same_tokens"), [
    # " ma" + "t" re-tokenizes as " mat": the first prompt's last token changes
    (CUT, "t", " and slept.", False),
    (WHOLE, " wor", "ld is big", False),  # an answer cut mid-word, continued by the client
    (WHOLE, " It", " slept well.", True),  # these extend, but D may have sampled others
], ids=["merged-last-token", "cut-mid-word", "tokens-extend"])
def test_token_mode_never_sends_params_where_bytes_match(
        prompt: str, reply: str, rest: str, same_tokens: bool) -> None:
    """Issue 35: the next turn extends the last one 'in token mode by token ids'. The
    bytes extend it exactly here; the tokens do not in the first two rows: D's KV holds
    the tokens of the first prompt then the answer's, at positions where the new prompt
    has other tokens, and the engine loads it unchecked (real-vllm-pd.md). Found on the
    branch point of this review (47582fa); main then kept nothing in token mode
    (700d4dd), and now keeps a turn only with the answer's token ids (none here: the
    byte-level remember passes none), checked by ids (tests/test_pd_tokens.py)."""
    _, router, back, renderer = _token_mode()
    first = {"model": "tiny", "prompt": prompt}
    second = {"model": "tiny", "prompt": prompt + reply + rest}
    states = [ReplicaState("d1", 0)]
    plan = router.decide(first, "completions", "tiny", "s", states, 1.0)
    assert plan.tokens is not None  # token mode is live for this request
    back.remember(plan, "completions", "d1", reply, PARAMS, 1.0)
    nxt = router.decide(second, "completions", "tiny", "s", states, 2.0)
    assert nxt.tokens is not None
    # what D's KV covers (the first prompt's tokens, then the answer's) begins the second
    # prompt's tokens or not: the precondition of the case
    turn = renderer.token_ids(first, "completions") + renderer.token_ids(
        {"model": "tiny", "prompt": reply}, "completions")
    assert (renderer.token_ids(second, "completions")[:len(turn)] == turn) is same_tokens
    assert back.take(nxt, 2.0) is None


def test_no_prompt_of_the_turns_length_with_other_bytes_is_taken() -> None:
    """The reuse map keeps a turn's length and digest, not its bytes (f1fc4d3): 2,000
    prompts whose first `length` bytes differ from the turn's in their last 8 are never
    handed the params. Mutation DIGEST_BYTES = 1 survived test_pd_reuse and
    test_pd_pullback (a 1-in-256 collision hands another history's KV to P)."""
    memory = DecoderKvMemory(max_entries=1, ttl_s=10.0)
    turn = b"the conversation so far " * 4
    taken = 0
    for i in range(2000):
        memory.remember("k", "d1", turn, PARAMS, 0.0)
        other = turn[:-8] + i.to_bytes(8, "big")
        taken += memory.take("k", other + b" and the next turn", 0.0) is not None
    assert taken == 0
    memory.remember("k", "d1", turn, PARAMS, 0.0)
    assert memory.take("k", turn + b" and the next turn", 0.0) is not None


# 2. The accounting's decisions that the P/D tests before let change unnoticed ------------

@pytest.mark.parametrize(("reported", "predicted", "expected"), [
    # vLLM's pull scheduler skips only `count < kv_recompute_threshold`: a count equal to
    # the threshold is pulled (pull_scheduler.py), so P held 936 and pulled 64
    (1000, 936, PrefillReport(1000, 64, False, "under_only")),
    (1000, 937, PrefillReport(1000, 0, False, "under_only")),
])
def test_a_pull_of_exactly_the_threshold_is_a_pull(reported: int, predicted: int,
                                                   expected: PrefillReport) -> None:
    """Mutation `reported - local > threshold` (for >=) survived the P/D tests."""
    assert read_prefill(reported, predicted, sent=True, level=1000, engine_block=16,
                        threshold=64) == expected


async def _reused_turn(pd: PdConfig, prefill_cached: int,
                       block: int | None = None) -> UsageRecord:
    """Turn 1 through P/D, then turn 2 sent the decoder's params, P reporting
    `prefill_cached` (its hits and any pulled); `block`: P's engine block as a scrape
    would set it. The second record."""
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], pd) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        if block is not None:
            assert gw.app.services is not None
            gw.app.services.router.set_capacity("p1", None, engine_block_size=block)
        p.prefill_cached = prefill_cached
        r2 = await client.post(gw.url + "/v1/chat/completions", headers=headers,
                               json=next_turn(CHAT, answer, "and then? " * 40))
        assert r2.status_code == 200
        second = gw.records[1]
        assert second.cached_from == "decoder_kv"
        return second


@pytest.mark.parametrize("threshold", [0, 10_000])
async def test_the_configured_recompute_threshold_decides_the_pulled_estimate(
        threshold: int) -> None:
    """P reports the pull level (the decoder's 151 tokens capped at the 150-token prompt):
    what P held is its prediction, the rest was pulled if at least `[pd]
    kv_recompute_threshold`. Mutation: _account passing 64 whatever the setting survived."""
    second = await _reused_turn(PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True,
                                         kv_recompute_threshold=threshold), PROMPT_TOKENS)
    assert second.prefill_cached_tokens == PROMPT_TOKENS and second.pulled_exact is False
    gap = PROMPT_TOKENS - min(second.predicted_cached_tokens or 0, PROMPT_TOKENS)
    assert gap > 0  # P was not predicted to hold the whole prompt: there was room to pull
    assert second.pulled_tokens == (gap if gap >= threshold else 0)


async def test_ps_scraped_block_size_is_the_room_below_the_pull_level() -> None:
    """P's engine has 64-token blocks (its scrape), the configured default is 16: a report
    40 tokens below the pull level (150) is within one of P's blocks, so it may include a
    pull (not exact). Mutation: _account using a fixed 16 for P's block survived."""
    second = await _reused_turn(PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True),
                                PROMPT_TOKENS - 40, block=64)
    assert second.pulled_exact is False


# 3. A Responses stream's response.completed longer than the held-event bound ------------

def _completed(text_chars: int, params: dict[str, Any] | None) -> bytes:
    """vLLM's last Responses event: the whole response object (its output text, and with
    `top_logprobs` each token's alternatives, so about 1 KiB a token), then the field
    `kv_transfer_params` (null without a connector: protocol.py writes it on every one)."""
    doc = {"type": "response.completed", "sequence_number": 7,
           "response": {"id": "resp_1", "object": "response", "status": "completed",
                        "output": [{"type": "message", "role": "assistant", "content": [
                            {"type": "output_text", "text": "x" * text_chars,
                             "annotations": []}]}],
                        "usage": {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30,
                                  "input_tokens_details": {"cached_tokens": 0}},
                        "kv_transfer_params": params}}
    return b"event: response.completed\ndata: " + orjson.dumps(doc) + b"\n\n"


HEAD = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"sequence_number":1,"delta":"x"}\n\n')


def _relayed(stream: bytes, piece: int = 65536) -> bytes:
    answer = StreamAnswer(collect=False)
    out = b"".join(answer.feed(stream[i:i + piece]) for i in range(0, len(stream), piece))
    return out + answer.finish()


@pytest.mark.parametrize("chars", [1000, 2 * MAX_EVENT_BYTES], ids=["short", "over-1MiB"])
def test_a_responses_completed_event_with_null_params_reaches_the_client_as_sent(
        chars: int) -> None:
    """answer.py: a null `kv_transfer_params` is left as the engine sent it (vLLM's
    api_router writes each event with model_dump_json, nulls included). An event still
    partial past MAX_EVENT_BYTES is let go in part, then its rest (which holds the key,
    after the output) is not an event `_doc` can parse and is dropped: the client gets
    half a JSON line and never the end of response.completed (a Responses stream with
    top_logprobs and a 2,000-token answer is that long). Every stream, P/D or not, goes
    through StreamAnswer (relay.py)."""
    stream = HEAD + _completed(chars, None)
    assert _relayed(stream) == stream


@pytest.mark.parametrize("chars", [1000, 2 * MAX_EVENT_BYTES], ids=["short", "over-1MiB"])
def test_a_long_decode_legs_completed_event_loses_its_params_not_its_answer(chars: int) -> None:
    """D's own params in response.completed are removed; the event the client gets is
    still the response, whole, as JSON."""
    out = _relayed(HEAD + _completed(chars, {"do_remote_decode": True,
                                             "remote_engine_id": "d1-engine",
                                             "remote_block_ids": [[7, 8]]}))
    assert b"d1-engine" not in out
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3
    last = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.completed"
    assert last["response"]["output"][0]["content"][0]["text"] == "x" * chars


# 4. A prefill replica without prompt_tokens_details on a decoder_kv turn ------------------

async def test_a_pull_is_not_counted_as_hits_when_p_omits_prompt_tokens_details() -> None:
    """P runs without `--enable-prompt-tokens-details` (D with it): P's answer has no
    cached count, so _account returns early (pd_path.py) and the record keeps no
    prefill_cached_tokens. D's usage still reports P's count, its own hits and what it
    pulled back from D together (vLLM 0.32 copies `remote_prefill_cached_tokens`, which
    the scheduler sets on every prefill), and cache_split counts all of it as hits: the
    150 tokens P pulled back become cache hits in /stats and /metrics, against the rule
    that tokens pulled from the decoder are neither hits nor misses. Either the count is
    read as P's report (it is one) or it is left out as unknown."""
    pd = PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True)
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], pd) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        p.prefill_details = False
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        p.prefill_cached = PROMPT_TOKENS  # turn 2: P pulls D's turn (the pull level)
        r2 = await client.post(gw.url + "/v1/chat/completions", headers=headers,
                               json=next_turn(CHAT, answer, "and then? " * 40))
        assert r2.status_code == 200
        second = gw.records[1]
        assert second.cached_from == "decoder_kv"
        assert second.cached_tokens == PROMPT_TOKENS  # D's copy of P's count
        predicted = second.predicted_cached_tokens or 0
        assert predicted < PROMPT_TOKENS  # P was not predicted to hold it all itself
        hits = second.cache_split()[1]
        assert second.prefill_cached_tokens == PROMPT_TOKENS or hits is None, (
            f"{hits} cached tokens counted as P's own hits")


async def test_a_prefill_replica_replaced_while_its_leg_ran_is_not_judged() -> None:
    """A new server under P's name while the prefill leg ran holds none of this prompt:
    the old one's report judges nothing (pd_path.py, `Fleet.current`). Mutation: the
    `not self.fleet.current(pre.instance)` guard in _account dropped survived the P/D
    tests."""
    pd = PdConfig(min_remote_prefill_tokens=16)
    async with replicas(("p1", "ok"), ("p1-new", "ok"), ("d1", "ok")) as (p, new, d), \
            gateway([("p1", url(p), "prefill"), ("d1", url(d), "decode")], pd) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        assert gw.app.services is not None
        router, fleet = gw.app.services.router, gw.app.services.fleet
        judged: list[str] = []
        original = router.judged

        def spy(plan: Any, replica: str, delivered: int, outcome: Any) -> None:
            judged.append(replica)
            original(plan, replica, delivered, outcome)

        router.judged = spy  # type: ignore[method-assign]
        p.hold = asyncio.Event()
        sent = asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=CHAT))
        await until(p.holding.is_set, "the prefill leg reached p1")
        fleet.remove("p1")
        fleet.add(ReplicaSettings(name="p1", url=url(new), role="prefill", models=("m",)))
        fleet.probe_result("p1", True, time.time())
        p.hold.set()
        r = await sent
        assert r.status_code == 200 and p.legs() == ["prefill"]
        assert judged == []
