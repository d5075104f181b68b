"""`[pd] reuse_decoder_kv` in token mode, by token ids (gateway.pd.tokenids,
gateway.pd.pullback): which turns are handed D's params (tables on the tiny model's
tokenizer), and the token ids the gateway asks of the decode leg, hidden again from the
client (the simulator's vLLM-shaped bytes, whole and streamed, cut anywhere)."""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
import pytest

from gateway.pd.answer import StreamAnswer, strip_json
from gateway.pd.pullback import PullBack
from gateway.pd.tokenids import IdsNuller, StreamIds, answer_ids, asks_ids, ids_only
from gateway.sim.responses import ChunkWriter, chat_body, completion_body
from tests.test_pd_pullback import (
    TINY,
    assistant,
    chat,
    decide,
    tiny_tokens,
    token_pullback,
    user,
)

IM_END, ENDOFTEXT = 2, 0  # the tiny model's <|im_end|> (its EOS) and <|endoftext|>
PARAMS = {"do_remote_decode": True, "remote_block_ids": [[7]], "remote_engine_id": "d1-e"}
FIRST = chat(user("hello"))
NEXT = chat(user("hello"), assistant("hello there"), user("more"))


def _ids(text: str) -> list[int]:
    return tiny_tokens().encode(text)


# (what D generated, remote_num_tokens less the turn's ids (None: not sent), the next turn
# and its own fields, whether P is sent the params)
ROWS: list[tuple[str, list[int], int | None, dict[str, Any], bool]] = [
    # D's ids are the next prompt's ids after the first prompt's: the turn extends
    ("extends", [*_ids("hello there"), IM_END], -1, NEXT, True),
    # the same bytes, sampled piece by piece: "hell" + "o" are not the ids of "hello"
    ("bytes-match-ids-differ", _ids("hell") + _ids("o there") + [IM_END], -1, NEXT, False),
    # D stopped on another end token than the template renders: its KV does not hold the
    # last sampled token (remote_num_tokens), so the ids that matter extend exactly
    ("last-token-not-held", [*_ids("hello there"), ENDOFTEXT], -1, NEXT, True),
    # ... but a count that says it does (or more): the ids differ where P would load
    ("last-token-held", [*_ids("hello there"), ENDOFTEXT], 0, NEXT, False),
    ("count-past-the-ids", [*_ids("hello there"), IM_END], 1, NEXT, False),
    ("no-count", [*_ids("hello there"), IM_END], None, NEXT, False),
    # the client went back and edited the history: a fork
    ("fork", [*_ids("hello there"), IM_END], -1,
     chat(user("hello!"), assistant("hello there"), user("more")), False),
    ("edited-answer", [*_ids("hello there"), IM_END], -1,
     chat(user("hello"), assistant("hello world"), user("more")), False),
    # a template switch: another namespace (cache_salt) or template in the chain seed
    ("salt-switch", [*_ids("hello there"), IM_END], -1, {**NEXT, "cache_salt": "x"}, False),
    ("template-switch", [*_ids("hello there"), IM_END], -1,
     {**NEXT, "chat_template_kwargs": {"enable_thinking": False}}, False),
]


@pytest.mark.parametrize(("generated", "count", "nxt", "reused"),
                         [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_token_mode_reuses_only_ids_that_extend_exactly(
        generated: list[int], count: int | None, nxt: dict[str, Any], reused: bool) -> None:
    fleet, router, pull = token_pullback(True)
    renderer = router._tokens._renderers["m"]  # type: ignore[union-attr]
    prompt = renderer.token_ids(FIRST, "chat")
    turn = prompt + generated
    params = dict(PARAMS) if count is None else {**PARAMS, "remote_num_tokens": len(turn) + count}
    first = decide(router, fleet, FIRST, "s")
    kept = pull.remember(first, "chat", "d1", "hello there", params, time.time(), turn)
    assert kept is (count is not None and count <= 0)
    plan = decide(router, fleet, nxt, "s")
    assert (pull.take(plan, time.time(), nxt, "chat") == params) is reused
    assert len(pull.memory) == 0  # used once, matched or not


def test_bytes_match_where_the_ids_do_not() -> None:
    """The precondition of the row above: the text extends, the ids do not."""
    assert _ids("hell") + _ids("o there") != _ids("hello there")
    assert "hell" + "o there" == "hello there"


def test_a_body_the_renderer_does_not_render_as_vllm_is_never_handed_params() -> None:
    """Both turns carry the same own `chat_template` (the same chain seed): the renderer
    renders the model's template, vLLM the body's, so the ids prove nothing."""
    fleet, router, pull = token_pullback(True)
    renderer = router._tokens._renderers["m"]  # type: ignore[union-attr]
    own = {"chat_template": (TINY / "chat_template.jinja").read_text()}
    turn = renderer.token_ids(FIRST, "chat") + _ids("hello there") + [IM_END]
    params = {**PARAMS, "remote_num_tokens": len(turn) - 1}
    first = decide(router, fleet, {**FIRST, **own}, "s")
    assert pull.remember(first, "chat", "d1", "hello there", params, time.time(), turn)
    nxt = {**NEXT, **own}
    assert pull.take(decide(router, fleet, nxt, "s"), time.time(), nxt, "chat") is None


@pytest.mark.parametrize(("reply", "ids"), [(None, [1, 2, 3]), ("hi", None)],
                         ids=["no-text", "no-ids"])
def test_nothing_is_kept_without_the_answers_ids_or_text(reply: str | None,
                                                        ids: list[int] | None) -> None:
    """Ids unknown (the answer carried none), or no text (tool calls, n > 1, reasoning:
    relay's reply is None): nothing kept."""
    fleet, router, pull = token_pullback(True)
    first = decide(router, fleet, FIRST, "s")
    assert not pull.remember(first, "chat", "d1", reply, {**PARAMS, "remote_num_tokens": 2},
                             time.time(), ids)
    assert len(pull.memory) == 0


def test_text_mode_ignores_the_ids() -> None:
    fleet, router, pull = token_pullback(False)
    first = decide(router, fleet, FIRST, "s")
    assert pull.remember(first, "chat", "d1", "hello there", PARAMS, time.time(), None)
    assert isinstance(pull, PullBack) and len(pull.memory) == 1


@pytest.mark.parametrize(("body", "asks"), [
    ({"messages": []}, True),
    ({"return_token_ids": True}, False),  # the client's own: left in its answer
    ({"echo": True}, False),  # vLLM then skips detokenizing the echoed prompt
    ({"n": 2}, False),
    ({"n": 1}, True),
])
def test_the_decode_leg_asks_ids_only_where_the_answer_stays_the_same(
        body: dict[str, Any], asks: bool) -> None:
    assert asks_ids(body) is asks


# -- the answer the client gets ------------------------------------------------------------

PROMPT, GEN = [151644, 8948, 198, 2610], [9707, 0, 151645]
KV = {"do_remote_decode": True, "remote_num_tokens": 6, "remote_host": "10.0.0.9"}


@pytest.mark.parametrize("kv", [None, KV], ids=["no-params", "params"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_whole_answer_is_the_one_without_ids(kind: str, kv: dict[str, Any] | None) -> None:
    build = chat_body if kind == "chat" else completion_body
    usage = {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    # a message quoting the key never matches: its quotes are escaped in JSON
    text = 'it said "token_ids":[1,2] and {"prompt_token_ids":[3]}'
    asked = build("id-1", 1, "m", text, "stop", usage, kv_transfer=kv, ids=(PROMPT, GEN))
    plain = build("id-1", 1, "m", text, "stop", usage, kv_transfer=kv)
    assert answer_ids(orjson.loads(asked)) == PROMPT + GEN
    assert answer_ids(orjson.loads(plain)) is None
    assert strip_json(asked, ids=True) == strip_json(plain)
    if kv is None:
        assert strip_json(asked, ids=True) == plain  # vLLM's bytes, not re-serialized
    assert strip_json(asked) != strip_json(plain)  # the client's own ask: ids left


def _stream(kind: str, ids: bool, held_back: bool = False) -> bytes:
    """A vLLM-shaped stream; `held_back`: the chunk vLLM sends only with ids asked (a
    token held back by a stop string, empty delta)."""
    w = ChunkWriter(kind, "id-1", 1, "m")  # type: ignore[arg-type]
    out = w.role(None, PROMPT if ids else None) if kind == "chat" else b""
    texts = ["Hello", ' "token_ids":[9]', ""]
    for i, (token, text) in enumerate(zip(GEN, texts, strict=True)):
        last = i == len(GEN) - 1
        if last:
            w.set_kv_transfer(KV)
        if held_back and ids and i == 1 and kind == "chat":
            out += w.delta({}, None, None).replace(b'"token_ids":null', b'"token_ids":[77]')
        out += w.content(text, "stop" if last else None, None, last=last,
                         token_ids=[token] if ids else None,
                         prompt_ids=PROMPT if ids and i == 0 and kind != "chat" else None)
    return out + w.DONE


def _through(answer: StreamAnswer, data: bytes, seed: int) -> bytes:
    rng = random.Random(seed)
    out, i = b"", 0
    while i < len(data):
        n = rng.randint(1, 40)
        out += answer.feed(data[i:i + n])
        i += n
    return out + answer.finish()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_stream_is_the_one_without_ids(kind: str, seed: int) -> None:
    """Cut anywhere: each id list written null as vLLM writes it without the flag, the
    chunk that only the flag makes vLLM send dropped, D's params removed; the ids read."""
    plain = _through(StreamAnswer(collect=False), _stream(kind, False), seed)
    answer = StreamAnswer(collect=True, strip_ids=True, collect_ids=True)
    got = _through(answer, _stream(kind, True, held_back=True), seed)
    assert got == plain and b"remote_host" not in got
    expected = PROMPT + ([*GEN[:1], 77, *GEN[1:]] if kind == "chat" else GEN)
    assert answer.token_ids == expected and answer.params == KV


def test_a_stream_keeps_the_ids_the_client_asked_for() -> None:
    answer = StreamAnswer(collect=True, collect_ids=True)
    got = _through(answer, _stream("chat", True, held_back=True), 1)
    assert got.count(b'"token_ids":[') == len(GEN) + 1 and b'"prompt_token_ids":[' in got
    assert answer.token_ids is not None


def test_an_event_past_the_bound_still_loses_its_ids() -> None:
    """A first chunk whose prompt ids pass max_event_bytes goes on in pieces: the ids are
    written null as they pass, and none are kept (they cannot be told)."""
    big = list(range(100_000, 100_400))
    w = ChunkWriter("chat", "id-1", 1, "m")
    data = w.role(None, big) + w.content("x", "stop", None, last=True, token_ids=[5]) + w.DONE
    plain = w.role(None) + w.content("x", "stop", None, last=True) + w.DONE
    answer = StreamAnswer(collect=True, strip_ids=True, collect_ids=True, max_event_bytes=512)
    assert _through(answer, data, 3) == plain
    assert answer.token_ids is None


def test_ids_only_is_the_empty_chunk_alone() -> None:
    chunk = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [4]}]}
    assert ids_only(chunk)
    for other in ({"delta": {"content": "a"}}, {"finish_reason": "stop"},
                  {"logprobs": {"content": []}}, {"token_ids": None}):
        assert not ids_only({**chunk, "choices": [{**chunk["choices"][0], **other}]})
    assert not ids_only({**chunk, "object": "text_completion"})


@pytest.mark.parametrize(("docs", "ids"), [
    ([{"prompt_token_ids": [1], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
      {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [2, 3]}]}], [1, 2, 3]),
    # a chunk with text and no ids: not all of them are here
    ([{"prompt_token_ids": [1], "choices": []},
      {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": None}]}], None),
    ([{"choices": [{"index": 0, "text": "a", "prompt_token_ids": [1], "token_ids": [2]}]},
      {"choices": [{"index": 1, "text": "b", "token_ids": [3]}]}], None),  # n > 1
    ([{"choices": [{"index": 0, "text": "a", "token_ids": [2]}]}], None),  # no prompt ids
    ([{"choices": [{"index": 0, "text": "a", "prompt_token_ids": [1] * 9, "token_ids": [2]}]}],
     None),  # past max_ids
])
def test_stream_ids(docs: list[dict[str, Any]], ids: list[int] | None) -> None:
    got = StreamIds(max_ids=8)
    for doc in docs:
        got.read(doc)
    assert got.ids == ids


def test_the_nuller_cut_anywhere() -> None:
    """Only keys: a string's text quoting one, and a key that ends with one (its quote
    escaped: a completion's top_logprobs are keyed by token text), are left."""
    data = (b'{"a":[1],"prompt_token_ids":[1,2,3],"x":"\\"token_ids\\":[4]",'
            b'"q\\"token_ids":[6],"token_ids":[5]}')
    want = (b'{"a":[1],"prompt_token_ids":null,"x":"\\"token_ids\\":[4]",'
            b'"q\\"token_ids":[6],"token_ids":null}')
    assert orjson.loads(data)['q"token_ids'] == [6]
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1, 7):
            n = IdsNuller()
            assert n.feed(data[:cut]) + n.feed(data[cut:cut2]) + n.feed(data[cut2:]) \
                + n.finish() == want
