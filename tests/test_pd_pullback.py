"""[pd] reuse_decoder_kv's bookkeeping around the reuse map (gateway.pd.pullback): which
conversation a request is, the bytes D's KV covers as the next turn renders them, and
entries of a replica that restarted, left or was replaced are never handed out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.pd.config import PdConfig
from gateway.pd.pullback import PullBack, conversation_key, template_tag, turn_bytes
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.normalize import canonical_bytes
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[7]], "remote_num_tokens": 40}
SYSTEM = {"role": "system", "content": "You are terse. " * 20}


def chat(*messages: dict[str, str]) -> dict[str, Any]:
    return {"model": "m", "messages": [SYSTEM, *messages]}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


FIRST = chat(user("hello"))


def setup(enabled: bool = True) -> tuple[Fleet, Router, PullBack]:
    fleet = Fleet([ReplicaSettings(name="d1", url="http://d1:1", role="decode")])
    fleet.probe_result("d1", True, time.time())
    router = Router(RoutingConfig())
    return fleet, router, PullBack(PdConfig(reuse_decoder_kv=enabled), fleet, router)


def decide(router: Router, fleet: Fleet, body: dict[str, Any], session: str | None,
           tenant: str | None = None, kind: str = "chat") -> RoutePlan:
    # routed among the replicas the test began with (one may have left since)
    return router.decide(body, kind, "m", session,  # type: ignore[arg-type]
                         [ReplicaState("d1", 0)], time.time(), tenant=tenant)


@pytest.mark.parametrize(("session", "tenant", "conversation", "key"), [
    ("s-1", None, None, "\x1fss-1"),
    ("s-1", "team-a", 7, "team-a\x1fss-1"),  # the session wins over the conversation
    (None, "team-a", 7, "team-a\x1fc7"),
    (None, None, 7, "\x1fc7"),
    (None, None, None, None),  # no conversation: never given another's params
])
def test_conversation_key(session: str | None, tenant: str | None, conversation: int | None,
                          key: str | None) -> None:
    plan = RoutePlan(decision=None, model="m", session=session,  # type: ignore[arg-type]
                     conversation=conversation, data=b"", seed=0, hashes=[], matched={},
                     predicted={}, estimated_tokens=0.0, tenant=tenant)
    assert conversation_key(plan) == key


def test_the_turn_bytes_begin_the_next_turns_prompt_exactly() -> None:
    fleet, router, _ = setup()
    first = chat(user("hello"))
    plan = decide(router, fleet, first, "s")
    turn = turn_bytes(plan, "chat", "hi there")
    tag = template_tag(plan)
    assert (tag + canonical_bytes(chat(user("hello"), assistant("hi there"), user("more")),
                                  "chat")).startswith(turn)
    for edited in (chat(user("hello"), assistant("hi there!"), user("more")),
                   chat(user("hello!"), assistant("hi there"), user("more"))):
        assert not (tag + canonical_bytes(edited, "chat")).startswith(turn)
    done = decide(router, fleet, {"model": "m", "prompt": "abc " * 30}, "c",
                  kind="completions")
    nxt = canonical_bytes({"model": "m", "prompt": "abc " * 30 + "xyz and on"}, "completions")
    assert (template_tag(done) + nxt).startswith(turn_bytes(done, "completions", "xyz"))


def _turn_two(router: Router, fleet: Fleet, back: PullBack, session: str | None = "s",
              ) -> dict[str, Any] | None:
    plan = decide(router, fleet, FIRST, session)
    back.remember(plan, "chat", "d1", "hi there", PARAMS, time.time())
    nxt = decide(router, fleet, chat(user("hello"), assistant("hi there"), user("more")),
                 session)
    return back.take(nxt, time.time())


@pytest.mark.parametrize(("field", "taken"), [
    (None, True), ({"truncate_prompt_tokens": 40}, False), ({"truncation_side": "left"}, False),
    ({"reasoning_effort": "low"}, False), ({"add_special_tokens": True}, False),
])
def test_text_mode_never_reuses_for_a_turn_whose_ids_vllm_shifts(
        field: dict[str, Any] | None, taken: bool) -> None:
    """Text mode too: a turn that vLLM truncates, renders with a reasoning effort or gives
    special tokens is not the bytes' ids; it is prefilled afresh (review of token mode)."""
    fleet, router, back = setup()
    plan = decide(router, fleet, FIRST, "s")
    back.remember(plan, "chat", "d1", "hi there", PARAMS, time.time())
    body = {**chat(user("hello"), assistant("hi there"), user("more")), **(field or {})}
    nxt = decide(router, fleet, body, "s")
    assert (back.take(nxt, time.time(), body) == PARAMS) is taken


def test_an_exact_next_turn_takes_the_params_once() -> None:
    fleet, router, back = setup()
    assert _turn_two(router, fleet, back) == PARAMS
    fleet2, router2, back2 = setup()
    assert _turn_two(router2, fleet2, back2, session=None) == PARAMS  # implicit too


@pytest.mark.parametrize("change", ["restarted", "replaced", "departed", "off"])
def test_a_decoder_that_changed_is_never_pulled_from(change: str) -> None:
    fleet, router, back = setup(enabled=change != "off")
    plan = decide(router, fleet, chat(user("hello")), "s")
    back.remember(plan, "chat", "d1", "hi there", PARAMS, time.time())
    if change == "restarted":
        router.replica_restarted("d1", time.time())
    elif change == "replaced":
        fleet.remove("d1")
        fleet.add(ReplicaSettings(name="d1", url="http://d1:2", role="decode"))
        fleet.probe_result("d1", True, time.time())
    elif change == "departed":
        fleet.remove("d1")
    nxt = decide(router, fleet, chat(user("hello"), assistant("hi there"), user("more")), "s")
    assert back.take(nxt, time.time()) is None


def test_another_tenants_conversation_is_not_given_the_params() -> None:
    fleet, router, back = setup()
    plan = decide(router, fleet, chat(user("hello")), "s", tenant="team-a")
    back.remember(plan, "chat", "d1", "hi there", PARAMS, time.time())
    nxt = decide(router, fleet, chat(user("hello"), assistant("hi there"), user("more")), "s",
                 tenant="team-b")
    assert back.take(nxt, time.time()) is None


# What renders the bytes into tokens: a next turn under another template is never given
# D's params (review F3); a turn without the generation prompt never begins the next one
# (its bytes lack the assistant's header the next turn renders before the answer).
@pytest.mark.parametrize(("first", "second", "taken"), [
    ({}, {}, True),
    ({}, {"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {}, False),
    ({}, {"chat_template": "{{ messages }}"}, False),
    ({}, {"continue_final_message": True, "add_generation_prompt": False}, False),
    ({}, {"cache_salt": "other"}, False),
    ({"add_generation_prompt": False}, {}, False),
    ({"continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True, "add_generation_prompt": False}, False),
    ({"add_generation_prompt": True}, {}, True),
])
def test_a_template_switch_is_a_fresh_prefill(first: dict[str, Any], second: dict[str, Any],
                                              taken: bool) -> None:
    fleet, router, back = setup()
    body = {**FIRST, **first}
    plan = decide(router, fleet, body, "s")
    back.remember(plan, "chat", "d1", "hi there", PARAMS, time.time())
    nxt = decide(router, fleet, {**chat(user("hello"), assistant("hi there"), user("more")),
                                 **second}, "s")
    assert (back.take(nxt, time.time()) == PARAMS) is taken


TINY = Path(__file__).parent / "data" / "tiny-model"


def tiny_tokens() -> TokenizerCache:
    return TokenizerCache.from_file(TINY / "tokenizer.json")


def token_pullback(token_mode: bool) -> tuple[Fleet, Router, PullBack]:
    fleet = Fleet([ReplicaSettings(name="d1", url="http://d1:1", role="decode")])
    fleet.probe_result("d1", True, time.time())
    renderer = TokenRenderer("m", load_template(TINY), tiny_tokens(), 32)
    tokens = TokenMode({"m": renderer}, KVIndex(KVConfig())) if token_mode else None
    router = Router(RoutingConfig(), tokens)
    return fleet, router, PullBack(PdConfig(reuse_decoder_kv=True), fleet, router)


def test_a_boundary_where_bytes_match_but_ids_differ_exists() -> None:
    """Why token mode checks ids, not bytes: D's KV holds the ids it generated; the same
    answer's bytes re-tokenized by the next turn are other ids (the tokenizer merges what
    was sampled piece by piece: "hell" + "o" are not the ids of "hello"), so the byte
    check would hand out KV for other tokens (tests/test_pd_tokens.py: the id check)."""
    tok = tiny_tokens()
    sampled = tok.encode("hell") + tok.encode("o")  # what D may have generated
    assert sampled != tok.encode("hello")  # what the next prompt's ids hold


# The next turn extends the last one's bytes exactly in every row: text mode hands the
# params out; token mode keeps nothing for an answer without its token ids (a byte match
# proves nothing there: tests/test_pd_tokens.py has the check by ids).
@pytest.mark.parametrize(("token_mode", "reused"), [(False, True), (True, False)])
def test_token_mode_never_reuses_on_a_byte_match(token_mode: bool, reused: bool) -> None:
    fleet, router, pull = token_pullback(token_mode)
    first = decide(router, fleet, FIRST, "s-1")
    kept = pull.remember(first, "chat", "d1", "hello", PARAMS, time.time())
    assert kept is reused
    nxt = decide(router, fleet, chat(user("hello"), assistant("hello"), user("again")), "s-1")
    assert (pull.take(nxt, time.time()) == PARAMS) is reused
