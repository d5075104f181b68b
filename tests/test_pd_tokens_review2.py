"""Outside review of `[pd] reuse_decoder_kv` in token mode (gateway.pd.tokenids,
gateway.pd.pullback, gateway.pd.answer): ways P could be sent D's params for other tokens,
and ways the client's bytes differ from what D alone would have sent. (JSON with
whitespace is out of scope: only vLLM returns the decoder's params, in compact JSON.)

The check's premise: the ids the gateway's renderer computes for the next prompt are the
ids P will compute. vLLM 0.32 feeds its renderer and tokenizer more of the body than the
gateway's renderer reads (chat_completion/protocol.py `build_chat_params`,
`build_tok_params`): `truncate_prompt_tokens` (the prompt cut from the left, by default),
and `reasoning_effort` (passed to the template, and as `enable_thinking`). A next prompt
that sets one of them renders to other ids on P while the gateway's ids still begin with
the turn's: P is handed params whose KV is for other tokens, which the engine loads
unchecked (real-vllm-pd.md).

The tests marked "kills a mutation" pass on main: each fails under a mutation of one
decision that no other test caught (named in its docstring).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.pd.answer import StreamAnswer
from gateway.pd.config import PdConfig
from gateway.pd.pullback import PullBack
from gateway.pd.tokenids import StreamIds, answer_ids, ids_only, renders_alike
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.sim.responses import ChunkWriter
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import ChatTemplate, load_template
from tests.test_pd_pullback import TINY, assistant, chat, decide, tiny_tokens, user

IM_END = 2  # the tiny model's <|im_end|>
PARAMS = {"do_remote_decode": True, "remote_block_ids": [[7]], "remote_engine_id": "d1-e"}
FIRST = chat(user("hello"))
NEXT = chat(user("hello"), assistant("hello there"), user("more"))

# A template that reads what vLLM passes it besides the messages (as SmolLM3's puts
# `/think` or `/no_think` in its system line): `enable_thinking`, which vLLM derives from
# `reasoning_effort` (`build_chat_params`), and `reasoning_effort` itself
THINKING = (
    "{{- '<|im_start|>system\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '/no_think' }}"
    "{%- else %}{{- '/think' }}{%- endif %}"
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "{{- ' effort:' + reasoning_effort }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def pullback(template: ChatTemplate | None = None
             ) -> tuple[Fleet, Router, PullBack, TokenRenderer]:
    """tests.test_pd_pullback's token_pullback, with the template chosen."""
    fleet = Fleet([ReplicaSettings(name="d1", url="http://d1:1", role="decode")])
    fleet.probe_result("d1", True, time.time())
    renderer = TokenRenderer("m", template or load_template(TINY), tiny_tokens(), 32)
    router = Router(RoutingConfig(), TokenMode({"m": renderer}, KVIndex(KVConfig())))
    return fleet, router, PullBack(PdConfig(reuse_decoder_kv=True), fleet, router), renderer


def remember_turn_one(fleet: Fleet, router: Router, pull: PullBack,
                      renderer: TokenRenderer) -> list[int]:
    """Turn 1 answered "hello there" by D, its ids as vLLM reports them (the prompt's, then
    the generated, the stop token's KV not held); the ids D's KV holds."""
    turn = renderer.token_ids(FIRST, "chat") + tiny_tokens().encode("hello there") + [IM_END]
    params = {**PARAMS, "remote_num_tokens": len(turn) - 1}
    assert pull.remember(decide(router, fleet, FIRST, "s"), "chat", "d1", "hello there",
                         params, time.time(), turn)
    return turn[:-1]


# -- the check: the ids P computes are not the ids the gateway computes ---------------------

@pytest.mark.parametrize("side", [None, "left"], ids=["default-side", "left"])
def test_a_truncated_next_prompt_is_never_handed_the_turns_params(side: str | None) -> None:
    """`truncate_prompt_tokens` on turn 2: vLLM keeps the prompt's last k ids (the left
    side is cut, its default), so P's prompt begins one token later than the gateway's
    rendering, which still begins with turn 1's ids: P would load D's KV of turn 1 at
    positions that hold other tokens. Suspected cause: gateway/pd/tokenids.py
    `_RENDER_FIELDS`/`renders_alike` (and gateway/tokens/render.py `token_ids`) ignore
    `truncate_prompt_tokens`; gateway/pd/pullback.py `take` hands the params out."""
    fleet, router, pull, renderer = pullback()
    held = remember_turn_one(fleet, router, pull, renderer)
    full = renderer.token_ids(NEXT, "chat")
    nxt: dict[str, Any] = {**NEXT, "truncate_prompt_tokens": len(full) - 1}
    if side is not None:
        nxt["truncation_side"] = side
    on_p = full[1:]  # what vLLM tokenizes turn 2 into (renderers/params.py truncation)
    assert full[:len(held)] == held and on_p[:len(held)] != held  # the premise
    assert pull.take(decide(router, fleet, nxt, "s"), time.time(), nxt, "chat") is None


@pytest.mark.parametrize(("fields", "template_kwargs"), [
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
    ({"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
], ids=["effort-none", "effort-high"])
def test_a_template_variable_vllm_sets_from_the_body_is_never_skipped(
        fields: dict[str, Any], template_kwargs: dict[str, Any]) -> None:
    """Turn 2 sends `reasoning_effort`: vLLM renders the template with it (and with
    `enable_thinking` derived from it), here in the system line, so P's ids differ from the
    first line on; the gateway renders without it, its ids begin with turn 1's, and P is
    handed the params. Suspected cause: gateway/pd/tokenids.py `_RENDER_FIELDS` lacks
    `reasoning_effort` (the chain seed, gateway/routing/normalize.py `chain_seed`, too)."""
    template = ChatTemplate.from_source(THINKING)
    fleet, router, pull, renderer = pullback(template)
    held = remember_turn_one(fleet, router, pull, renderer)
    nxt = {**NEXT, **fields}
    on_p = tiny_tokens().encode(template.render(nxt["messages"], None, True,
                                                **template_kwargs))
    assert renderer.token_ids(nxt, "chat")[:len(held)] == held  # the premise
    assert on_p[:len(held)] != held
    assert pull.take(decide(router, fleet, nxt, "s"), time.time(), nxt, "chat") is None


# -- tests that kill a mutation no other test caught (they pass on main) --------------------

PROMPT = [151644, 8948, 198, 2610]

@pytest.mark.parametrize("body", [
    {**NEXT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
    {**NEXT, "documents": [{"title": "a", "text": "b"}]},
    {**NEXT, "mm_processor_kwargs": {"fps": 1}},
    {**NEXT, "continue_final_message": True},
    {**NEXT, "chat_template_kwargs": {"enable_thinking": False}},
    {**NEXT, "messages": "hello"},
], ids=["image", "documents", "mm-kwargs", "continue", "template-kwargs", "not-a-list"])
def test_renders_alike_refuses_what_the_renderer_does_not_render(body: dict[str, Any]) -> None:
    """Kills a mutation: `renders_alike`'s non-text content test dropped (an image's
    pixels are not in its placeholder ids: two images, one set of ids), or any of its
    fields (only `chat_template` was tested)."""
    assert not renders_alike(body)
    assert renders_alike(NEXT) and renders_alike({"prompt": "x"})
    assert renders_alike({**NEXT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}]})


def test_a_count_of_zero_keeps_nothing() -> None:
    """Kills a mutation: `token_turn`'s `0 < held` made `0 <= held` (an empty id span
    would then match every next prompt of the template)."""
    fleet, router, pull, renderer = pullback()
    turn = [*renderer.token_ids(FIRST, "chat"), IM_END]
    assert not pull.remember(decide(router, fleet, FIRST, "s"), "chat", "d1", "", {
        **PARAMS, "remote_num_tokens": 0}, time.time(), turn)
    assert len(pull.memory) == 0


def test_a_first_chunk_is_never_taken_for_a_chunk_only_the_flag_sent() -> None:
    """Kills a mutation: `ids_only`'s `prompt_token_ids is not None` test dropped (a chat
    stream's first chunk carries the prompt's ids; with an empty delta it is still one
    the client gets)."""
    chunk = {"object": "chat.completion.chunk", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [4]}]}
    assert not ids_only(chunk)
    assert ids_only({k: v for k, v in chunk.items() if k != "prompt_token_ids"})


def test_a_whole_answer_of_two_choices_tells_no_ids() -> None:
    """Kills a mutation: `answer_ids`' `len(choices) != 1` dropped (a client's own
    `return_token_ids` with `n: 2`, or a completions batch of two prompts: choice 0's ids
    are not the turn's alone)."""
    choice = {"index": 0, "text": "a", "prompt_token_ids": [1], "token_ids": [2]}
    assert answer_ids({"choices": [choice]}) == [1, 2]
    assert answer_ids({"choices": [choice, {**choice, "index": 1}]}) is None


def test_a_stream_with_prompt_ids_twice_tells_no_ids() -> None:
    """Kills a mutation: `StreamIds._take_prompt`'s "twice" test dropped (a second prompt's
    ids, a completions batch's, would replace the first's)."""
    got = StreamIds(max_ids=64)
    got.read({"prompt_token_ids": [1], "choices": []})
    got.read({"choices": [{"index": 0, "text": "a", "prompt_token_ids": [9], "token_ids": [2]}]})
    assert got.ids is None


def test_a_stream_with_tool_calls_keeps_no_ids() -> None:
    """Kills a mutation: `StreamAnswer.token_ids` without its `_whole` test (a tool call's
    arguments render otherwise in the next turn)."""
    w = ChunkWriter("chat", "id-1", 1, "m")
    call = {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]}
    data = (w.role(None, PROMPT)
            + w.delta({"content": "a"}, None, None).replace(b'"token_ids":null', b'"token_ids":[5]')
            + w.delta(call, None, None).replace(b'"token_ids":null', b'"token_ids":[6]')
            + w.DONE)
    answer = StreamAnswer(collect=True, strip_ids=True, collect_ids=True)
    answer.feed(data)
    answer.finish()
    assert answer.reply is None and answer.token_ids is None
