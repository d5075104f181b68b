"""Prefill/decode disaggregation on a real vLLM CPU pair (`NixlConnector`, CPU buffer).

First the engine's own contract, the two legs sent by hand as every router sends them
(shared/real-vllm-pd.md): the decoder pulls the prompt's KV once (its
`vllm:nixl_xfer_time_seconds_count` rises by 1) and its greedy tokens equal the same replica
answering alone; the next turn's prefill leg, carrying the decoder's returned
`kv_transfer_params`, makes the prefiller pull the conversation back (its count rises by 1)
and the answer is still the aggregated one. This proves the pair before any gateway is in
front of it.

The aggregated reference is the decoder answering alone with a `cache_salt` of its own: the
salt keeps its prefix cache apart from the P/D traffic's (same tokens, other block hashes),
so the reference is computed from scratch and the P/D requests never find its blocks.

Answers are compared by token ids and by their logprobs: the tier's tiny random model
repeats one token whatever the context, so equal tokens alone would not show that the
pulled KV was the right one. Measured here: the same computation gives equal logprobs (the
largest difference 0.0; 2.3e-5 in shared/real-vllm-pd.md), a pull of KV computed for other
tokens moved them by 0.054.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from tests.realvllm.pd import PREFILL_PARAMS, RECOMPUTE_THRESHOLD, PdPair, xfer_count
from tests.realvllm.vllm import MODEL_NAME

pytestmark = pytest.mark.realvllm

# Answers longer than the engine's recompute threshold: only then is pulling a turn's
# generated tokens back from the decoder worth it to the engine.
ANSWER_TOKENS = RECOMPUTE_THRESHOLD + 32
LOGPROB_TOLERANCE = 1e-3


def _post(base: str, path: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, headers={"X-Request-Id": request_id}, timeout=120)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg as vLLM's reference proxy sends it: one token, not streamed."""
    leg = {**body, "kv_transfer_params": params, "stream": False, "max_tokens": 1}
    leg.pop("min_tokens", None)
    leg.pop("stream_options", None)
    return leg


def _two_legs(pair: PdPair, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Prefill on P with `params`, then decode on D with P's answer's transfer params."""
    rid = f"pd-{uuid.uuid4().hex}"
    prefilled = _post(pair.prefill, "/v1/completions", _prefill_body(body, params), rid)
    handed = prefilled["kv_transfer_params"]
    assert handed["do_remote_prefill"] is True, handed
    return _post(pair.decode, "/v1/completions", {**body, "kv_transfer_params": handed}, rid)


def _count_reaches(base: str, target: float, timeout: float = 30.0) -> float:
    """The replica's pull count once it reaches `target` (metrics follow the engine's step
    loop, a moment after the answer), or the last value read at the deadline."""
    deadline = time.monotonic() + timeout
    seen = xfer_count(base)
    while seen < target and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = xfer_count(base)
    return seen


def _same_answer(got: dict[str, Any], alone: dict[str, Any]) -> None:
    a, b = got["choices"][0], alone["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    drift = max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"],
                                           b["logprobs"]["token_logprobs"], strict=True))
    assert drift <= LOGPROB_TOLERANCE, drift


def _tokenize(base: str, text: str) -> list[int]:
    r = httpx.post(base + "/tokenize", json={"model": MODEL_NAME, "prompt": text}, timeout=60)
    r.raise_for_status()
    tokens: list[int] = r.json()["tokens"]
    return tokens


def test_engine_pulls_prompt_to_decoder_then_conversation_back_to_prefiller(
    vllm_pd: PdPair,
) -> None:
    pair = vllm_pd
    # A prompt of its own (~800 tokens): nothing of it is cached on either replica yet.
    words = " ".join(f"e{i % 23} block {i}" for i in range(120))
    text = f"engine contract {uuid.uuid4().hex}: {words}"
    prompt = _tokenize(pair.decode, text)
    body: dict[str, Any] = {
        "model": MODEL_NAME, "prompt": prompt, "temperature": 0, "return_token_ids": True,
        "logprobs": 0, "max_tokens": ANSWER_TOKENS, "min_tokens": ANSWER_TOKENS, "ignore_eos": True,
    }  # fmt: skip
    salted = {"cache_salt": f"aggregated-{uuid.uuid4().hex}"}

    p0, d0 = xfer_count(pair.prefill), xfer_count(pair.decode)
    turn1 = _two_legs(pair, body, PREFILL_PARAMS)
    assert _count_reaches(pair.decode, d0 + 1) == d0 + 1  # one pull of the whole prompt
    alone1 = _post(pair.decode, "/v1/completions", {**body, **salted}, "aggregated-1")
    tokens1 = turn1["choices"][0]["token_ids"]
    assert len(tokens1) == ANSWER_TOKENS
    _same_answer(turn1, alone1)
    assert xfer_count(pair.prefill) == p0  # P only held the KV; it pulled nothing

    # Turn two extends turn one exactly (prompt + answer + more), as only a router that
    # kept the token ids can guarantee: the decoder's params go with the prefill leg.
    back = turn1["kv_transfer_params"]
    assert back["do_remote_decode"] is True and back["remote_num_tokens"] > 0, back
    body2 = {**body, "prompt": [*prompt, *tokens1, *_tokenize(pair.decode, " and then")]}
    turn2 = _two_legs(pair, body2, back)
    assert _count_reaches(pair.prefill, p0 + 1) == p0 + 1  # P pulled D's tokens back
    alone2 = _post(pair.decode, "/v1/completions", {**body2, **salted}, "aggregated-2")
    _same_answer(turn2, alone2)
