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
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.realvllm.gateways import fronted, records, wait_healthy
from tests.realvllm.pd import PREFILL_PARAMS, RECOMPUTE_THRESHOLD, PdPair, xfer_count
from tests.realvllm.vllm import MODEL_NAME, VllmOptions

pytestmark = pytest.mark.realvllm

# Answers longer than the engine's recompute threshold: only then is pulling a turn's
# generated tokens back from the decoder worth it to the engine.
ANSWER_TOKENS = RECOMPUTE_THRESHOLD + 32
# Equal computations gave equal logprobs (0.0) in most runs; with reuse_decoder_kv, turn 3
# (P pulled D's turn-2 KV) differed from D alone by 0.0155 in 3 of about 14 runs here, the
# tokens equal (not explained yet; the prompt length, which the uuid varies by a few
# tokens, is a suspect).
# KV for other tokens moved them by 0.03-0.05, above this bound.
LOGPROB_TOLERANCE = 0.02


def _post(base: str, path: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, headers={"X-Request-Id": request_id}, timeout=300)
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


def _same_chat(got: ChatCompletion, alone: ChatCompletion, where: str) -> None:
    a, b = got.choices[0], alone.choices[0]
    # token mode's gateway asks D for the ids the client did not ask: they come back null,
    # as D alone writes them
    assert (a.model_extra or {})["token_ids"] == (b.model_extra or {})["token_ids"], where
    assert (got.model_extra or {}).get("prompt_token_ids") == (alone.model_extra or {}).get(
        "prompt_token_ids"), where
    assert a.logprobs is not None and a.logprobs.content is not None
    assert b.logprobs is not None and b.logprobs.content is not None
    assert [x.token for x in a.logprobs.content] == [y.token for y in b.logprobs.content], where
    drift = max(abs(x.logprob - y.logprob)
                for x, y in zip(a.logprobs.content, b.logprobs.content, strict=True))
    assert drift <= LOGPROB_TOLERANCE, (where, drift)


Streamed = dict[str, Any]


def _stream(client: openai.OpenAI, messages: list[Any], create: dict[str, Any]
            ) -> tuple[Streamed, str]:
    """What a streamed answer says, over all its chunks (how many tokens one chunk carries
    depends on the engine's timing): the prompt ids and each choice field that is not
    null, the text, generated ids, logprob tokens and values joined, the finish reasons;
    and the text."""
    seen: Streamed = {"prompt_token_ids": [], "roles": [], "text": "", "token_ids": [],
                      "tokens": [], "finish": [], "logprobs": []}
    for chunk in client.chat.completions.create(messages=messages, stream=True, **create):
        top = (chunk.model_extra or {}).get("prompt_token_ids")
        if top is not None:
            seen["prompt_token_ids"].append(top)
        for c in chunk.choices:
            assert c.index == 0
            if c.delta.role:
                seen["roles"].append(c.delta.role)
            seen["text"] += c.delta.content or ""
            ids = (c.model_extra or {}).get("token_ids")
            if ids is not None:
                seen["token_ids"] += ids
            if c.finish_reason is not None:
                seen["finish"].append(c.finish_reason)
            lps = c.logprobs.content if c.logprobs and c.logprobs.content else []
            seen["tokens"] += [x.token for x in lps]
            seen["logprobs"] += [x.logprob for x in lps]
    return seen, seen["text"]


def _same_stream(got: Streamed, alone: Streamed) -> None:
    """The same stream as D alone's (the token-mode gateway's own ids hidden: none at all,
    as D alone sends), logprobs within the tolerance."""
    values = {k: v for k, v in got.items() if k != "logprobs"}
    assert values == {k: v for k, v in alone.items() if k != "logprobs"}
    assert len(got["tokens"]) == ANSWER_TOKENS
    drift = max(abs(x - y) for x, y in zip(got["logprobs"], alone["logprobs"], strict=True))
    assert drift <= LOGPROB_TOLERANCE, ("streamed", drift)


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_gateway_pd_conversation_equals_aggregated_and_pulls_the_decoder_kv_back(
    vllm_pd: PdPair, vllm_options: VllmOptions, tmp_path: Path, mode: str
) -> None:
    """Three turns through `gateway serve --prefill P --decode D` with the official client:
    every answer is the one D gives alone; D pulls the prompt on turn 1; with
    `reuse_decoder_kv` P pulls the last turn back from D on turns 2 and 3; a turn whose
    history the client edited is prefilled afresh (P pulls nothing) and still answers as
    D alone does. Turn 3 is streamed (as D alone streams it); vLLM 0.32 writes no
    params in a stream, so turn 4 is prefilled afresh. In token
    mode the next turn is checked by D's token ids, which the gateway asks for itself
    (the client here does not) and hides from the client."""
    pair, log = vllm_pd, tmp_path / "usage.jsonl"
    env = {
        "GATEWAY_PD__REUSE_DECODER_KV": "true",
        # every turn takes both legs, even when D holds all but the last message
        "GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "0",
    }
    extra_body: dict[str, Any] = {"min_tokens": ANSWER_TOKENS, "ignore_eos": True}
    if mode == "tokens":
        env |= {"GATEWAY_TOKENS__MODELS": f"{MODEL_NAME}={vllm_options.model_path}",
                "GATEWAY_TOKENS__BLOCK_SIZE": str(vllm_options.block_size)}
    else:
        extra_body["return_token_ids"] = True
    words = " ".join(f"g{i % 29} step {i}" for i in range(120))
    messages: list[Any] = [
        {"role": "system", "content": f"pd conversation {uuid.uuid4().hex}: {words}"},
        {"role": "user", "content": "Turn 1: go on."},
    ]
    create: dict[str, Any] = {
        "model": MODEL_NAME, "temperature": 0, "max_tokens": ANSWER_TOKENS, "logprobs": True,
        "extra_body": extra_body,
    }  # fmt: skip
    salted = {**create["extra_body"], "cache_salt": f"aggregated-{uuid.uuid4().hex}"}
    with (
        fronted([], log, "--prefill", pair.prefill, "--decode", pair.decode, env=env) as gw,
        openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=300) as client,
        openai.OpenAI(base_url=pair.decode + "/v1", api_key="x", max_retries=0,
                      timeout=300) as alone,
    ):  # fmt: skip
        wait_healthy(gw, 2)
        # token mode is on (else this would test text mode twice)
        assert ("token_mode" in httpx.get(gw + "/stats", timeout=30).json()) == (mode == "tokens")
        for turn in (1, 2, 3, 4):
            p0, d0 = xfer_count(pair.prefill), xfer_count(pair.decode)
            if turn == 3:  # streamed: P pulled turn 2 back all the same, and D's stream is
                # relayed as D alone streams it (in token mode, without the gateway's ids)
                chunks, answer = _stream(client, messages, create)
            else:
                got = client.chat.completions.create(messages=messages, **create)
            if turn == 1:  # D pulled the prompt P computed; P pulled nothing
                assert _count_reaches(pair.decode, d0 + 1) == d0 + 1
                assert xfer_count(pair.prefill) == p0
            elif turn == 4:  # vLLM 0.32 sends no params in a stream: turn 3 left none
                assert xfer_count(pair.prefill) == p0
            else:  # P pulled D's last turn back instead of recomputing it
                assert _count_reaches(pair.prefill, p0 + 1) == p0 + 1, f"turn {turn}"
            if turn == 3:
                ref_chunks, _ = _stream(alone, messages, {**create, "extra_body": salted})
                _same_stream(chunks, ref_chunks)
            else:
                ref = alone.chat.completions.create(
                    messages=messages, **{**create, "extra_body": salted})
                _same_chat(got, ref, f"turn {turn}")
                answer = got.choices[0].message.content or ""
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": f"Turn {turn + 1}: go on."}]  # fmt: skip

        # The client rewrites the last answer: D's KV no longer matches the history.
        edited = [*messages[:-2], {"role": "assistant", "content": "Edited. " * 60},
                  messages[-1]]  # fmt: skip
        p0 = xfer_count(pair.prefill)
        got = client.chat.completions.create(messages=edited, **create)
        ref = alone.chat.completions.create(messages=edited, **{**create, "extra_body": salted})
        assert xfer_count(pair.prefill) == p0  # read after D's reference: any pull is counted
        _same_chat(got, ref, "edited")

    recs = records(log)  # complete: the gateway has stopped
    assert len(recs) == 5
    # every turn took both legs, the edited one included (a fresh prefill, not D alone)
    names = (urlsplit(pair.decode).netloc, urlsplit(pair.prefill).netloc)  # serve's names
    assert [(r["replica"], r["prefill_replica"]) for r in recs] == [names] * 5


def _response_output(response: dict[str, Any]) -> tuple[list[Any], list[float]]:
    """A Responses answer's output items without their ids (drawn per response) or
    logprobs, and the logprobs of its text (asked with `include`). The one run of this
    test so far returned an empty `output` through the gateway (the transfer and the
    hidden params held): the items are compared whole, whatever the tier's model makes
    of them, beside the usage's token count."""
    items: list[Any] = []
    logprobs: list[float] = []
    for item in response["output"]:
        parts = []
        for part in item.get("content") or []:
            logprobs += [t["logprob"] for t in part.get("logprobs") or []]
            parts.append({k: v for k, v in part.items() if k != "logprobs"})
        items.append({**{k: v for k, v in item.items() if k != "id"}, "content": parts})
    return items, logprobs


def test_gateway_pd_responses_and_messages_equal_aggregated(
    vllm_pd: PdPair, tmp_path: Path
) -> None:
    """One Responses turn and one Messages turn through `gateway serve --prefill P
    --decode D` (both endpoints take `kv_transfer_params` in vLLM 0.32): D pulls each
    prompt once, and each answer is the one D gives alone (Responses: its output items
    and their logprobs; Messages, which returns no logprobs: its content), the client
    seeing no transfer params."""
    pair, log = vllm_pd, tmp_path / "usage.jsonl"
    env = {"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "0"}
    words = " ".join(f"r{i % 31} item {i}" for i in range(120))
    instructions = f"pd apis {uuid.uuid4().hex}: {words}"
    responses: dict[str, Any] = {
        "model": MODEL_NAME, "instructions": instructions, "input": "Go on.",
        "temperature": 0, "max_output_tokens": ANSWER_TOKENS, "ignore_eos": True,
        "top_logprobs": 0, "include": ["message.output_text.logprobs"], "store": False,
    }  # fmt: skip
    messages: dict[str, Any] = {
        "model": MODEL_NAME, "system": f"pd messages {uuid.uuid4().hex}: {words}",
        "messages": [{"role": "user", "content": "Go on."}], "temperature": 0,
        "max_tokens": ANSWER_TOKENS,
    }  # fmt: skip
    salt = {"cache_salt": f"aggregated-{uuid.uuid4().hex}"}
    with fronted([], log, "--prefill", pair.prefill, "--decode", pair.decode, env=env) as gw:
        wait_healthy(gw, 2)
        d0 = xfer_count(pair.decode)
        got = _post(gw, "/v1/responses", responses, "pd-responses")
        assert _count_reaches(pair.decode, d0 + 1) == d0 + 1
        assert "kv_transfer_params" not in got or got["kv_transfer_params"] is None
        ref = _post(pair.decode, "/v1/responses", {**responses, **salt}, "alone-responses")
        assert got["usage"]["output_tokens"] == ref["usage"]["output_tokens"] == ANSWER_TOKENS
        (items, logprobs), (ref_items, ref_logprobs) = _response_output(got), _response_output(ref)
        assert items == ref_items
        drift = max((abs(x - y) for x, y in zip(logprobs, ref_logprobs, strict=True)),
                    default=0.0)
        assert drift <= LOGPROB_TOLERANCE, drift

        d0 = xfer_count(pair.decode)
        got = _post(gw, "/v1/messages", messages, "pd-messages")
        assert _count_reaches(pair.decode, d0 + 1) == d0 + 1
        assert "kv_transfer_params" not in got
        ref = _post(pair.decode, "/v1/messages", {**messages, **salt}, "alone-messages")
        assert got["content"] == ref["content"]
        assert got["usage"]["output_tokens"] == ref["usage"]["output_tokens"]

    recs = records(log)
    names = (urlsplit(pair.decode).netloc, urlsplit(pair.prefill).netloc)
    assert [(r["endpoint"], r["replica"], r["prefill_replica"]) for r in recs] == [
        ("responses", *names), ("messages", *names)]
