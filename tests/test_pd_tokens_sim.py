"""`[pd] reuse_decoder_kv` in token mode on loopback: `gateway serve --prefill --decode` in
front of the simulator's P and D (`gateway sim --role`, bidirectional) with `[tokens]`
naming the model (`sim`: the simulator's own template and tokenizer), two tenants.

The gateway asks D for its token ids and checks the next turn by them: turn 2 of a
conversation carries D's params (P's transfer count rises), whole and streamed; the
client never sees ids it did not ask for (and gets those it asked for); tenant B's
identical turn 2 in a session of the same name is never given tenant A's params."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.servers import gateway, sim
from tests.sim_http import FAST

XFER = re.compile(r'^vllm:nixl_xfer_time_seconds_count\{[^}]*\} (\S+)$', re.M)
LISTS = re.compile(rb'"(?:prompt_)?token_ids":\[')
KEYS = {"alice": "ka", "bob": "kb", "ops": "kops"}


def transfers(base: str) -> float:
    return sum(float(v) for v in XFER.findall(httpx.get(base + "/metrics", timeout=10).text))


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str, str]]:
    """(gateway, P, D)."""
    with sim(2, [*FAST, "--model", "sim", "--role", "prefill", "--role", "decode",
                 "--bidirectional-kv-xfer", "--stream-kv-params",
                 "--decoder-kv-ttl-s", "600000"]) as (p, d), \
            gateway([], ["--prefill", p, "--decode", d],
                    env={"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "64",
                         "GATEWAY_PD__REUSE_DECODER_KV": "true",
                         "GATEWAY_TOKENS__MODELS": "sim=sim",
                         "GATEWAY_AUTH__KEYS": "ka=alice,kb=bob,kops=ops",
                         "GATEWAY_AUTH__ADMIN_TENANTS": "ops"}) as gw:
        yield gw, p, d


def ask(gw: str, tenant: str, session: str, msgs: list[dict[str, Any]], *, stream: bool = False,
        **extra: Any) -> tuple[bytes, str]:
    """The answer's bytes as the client got them, and its text."""
    body = {"model": "sim", "messages": msgs, "max_tokens": 96, "min_tokens": 96,
            "ignore_eos": True, "temperature": 0, "stream": stream, **extra}
    headers = {"x-session-id": session, "authorization": f"Bearer {KEYS[tenant]}"}
    r = httpx.post(gw + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return r.content, r.json()["choices"][0]["message"]["content"]
    text = ""
    for line in r.content.split(b"\n\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return r.content, text


def turns(tag: str) -> tuple[list[dict[str, Any]], str]:
    return ([{"role": "user", "content": " ".join(f"{tag}{i}" for i in range(400))}],
            " ".join(f"more{i}" for i in range(200)))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_turn_two_pulls_back_by_token_ids_and_the_client_sees_none(
        stack: tuple[str, str, str], stream: bool) -> None:
    gw, p, _ = stack
    first, more = turns("s" if stream else "j")
    data, answer = ask(gw, "alice", f"c-{stream}", first, stream=stream)
    assert not LISTS.search(data) and b"kv_transfer_params" not in data
    # the fields are there as vLLM writes them without the flag
    assert b'"token_ids":null' in data
    before = transfers(p)
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": more}]
    data, _ = ask(gw, "alice", f"c-{stream}", second, stream=stream)
    assert transfers(p) == before + 1  # P pulled turn 1 back from D
    assert not LISTS.search(data)


def test_the_clients_own_ids_are_left_and_an_edited_turn_is_fresh(
        stack: tuple[str, str, str]) -> None:
    gw, p, _ = stack
    first, more = turns("own")
    data, answer = ask(gw, "alice", "c-own", first, return_token_ids=True)
    doc = orjson.loads(data)
    assert doc["prompt_token_ids"] and doc["choices"][0]["token_ids"]
    before = transfers(p)
    # (an answer the client only extended is still D's ids: that is an extension)
    edited = [*first, {"role": "assistant", "content": "So: " + answer},
              {"role": "user", "content": more}]
    ask(gw, "alice", "c-own", edited, return_token_ids=True)
    assert transfers(p) == before  # the history D holds was left: prefilled afresh


def handed_out(gw: str) -> int:
    """Prefill legs sent a decoder's params (/stats, the admin's view)."""
    stats = httpx.get(gw + "/stats", timeout=10,
                      headers={"authorization": f"Bearer {KEYS['ops']}"}).json()
    return int(stats["pd"]["decoder_kv"]["pulled_back"])


def test_another_tenants_identical_turn_never_gets_the_params(
        stack: tuple[str, str, str]) -> None:
    """Bob sends a turn 2 that extends alice's turn 1 exactly (he knows her answer) under
    her session's name: not sent her params (P pulls nothing); alice's own turn 2 after it
    still is (bob took nothing of hers). The engines' caches are shared (no tenant salt):
    the chain seed, and so the check, is the same for both."""
    gw, p, _ = stack
    first, more = turns("t")
    _, answer = ask(gw, "alice", "c-shared", first)
    history = [*first, {"role": "assistant", "content": answer}]
    before, sent = transfers(p), handed_out(gw)
    ask(gw, "bob", "c-shared", [*history, {"role": "user", "content": more}])
    assert (transfers(p), handed_out(gw)) == (before, sent)
    ask(gw, "alice", "c-shared", [*history, {"role": "user", "content": "and " + more}])
    assert handed_out(gw) == sent + 1
