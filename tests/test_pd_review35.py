"""A second outside review of P/D (issue 35): the accounting of a prefill leg's report
(gateway.pd.accounting), Responses/Messages legs and `[pd] reuse_decoder_kv`'s check.

Tests that fail on main are findings (the review's report names their suspected causes);
the others pin a decision that a mutation let through unnoticed by the P/D tests before
them (each says which)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.pd.accounting import PrefillReport, read_prefill
from gateway.pd.config import PdConfig
from gateway.pd.pullback import PullBack
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

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
    (WHOLE, " It", " slept well.", True),  # the tokens extend too: the params go
], ids=["merged-last-token", "cut-mid-word", "tokens-extend"])
def test_token_mode_never_sends_params_for_a_prompt_whose_tokens_differ(
        prompt: str, reply: str, rest: str, same_tokens: bool) -> None:
    """Issue 35: the next turn extends the last one 'in token mode by token ids'. Here the
    bytes extend it exactly but the tokens do not: D's KV holds the tokens of the first
    prompt then the answer's, at positions where the new prompt has other tokens, and the
    engine loads it unchecked (real-vllm-pd.md)."""
    fleet, router, back, renderer = _token_mode()
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
    assert (back.take(nxt, 2.0) is not None) is same_tokens
