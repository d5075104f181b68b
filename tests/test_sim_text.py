"""Simulator tokenizer, Qwen2.5 chat template and generated text (pure)."""

from __future__ import annotations

import time

import pytest

from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.template import DEFAULT_SYSTEM, render_chat
from gateway.sim.tokenizer import IM_END_ID, Tokenizer

PROSE = (
    "In computing, a cache is a hardware or software component that stores data so that "
    "future requests for that data can be served faster; the data stored in a cache might be "
    "the result of an earlier computation or a copy of data stored elsewhere. A cache hit "
    "occurs when the requested data can be found in a cache, while a cache miss occurs when "
    "it cannot. Cache hits are served by reading data from the cache, which is faster than "
    "recomputing a result or reading from a slower data store."
)


@pytest.mark.parametrize(
    "text",
    [
        PROSE,
        "héllo wörld 日本語テキスト 🎉 \x00 a\n\n  b\t\tc  ",
        "def f(x):\n    return x**2\n",
        "<|im_start|>user\nhi<|im_end|>\n",
        " ",
        "",
        "a  b",
        "x.<|im_end|>",
        "\uff46\uff55\uff4c\uff4c width",
    ],
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = Tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < 2**64 for i in ids)
    assert "".join(tok.pieces(ids)) == text


def test_tokenizer_is_bpe_like_on_prose() -> None:
    tok = Tokenizer()
    ratio = len(PROSE) / len(tok.encode(PROSE))
    assert 3.5 <= ratio <= 4.6


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        (
            "<|im_start|>user\nHi<|im_end|>\n",
            ["<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n"],
        ),
        ("a  b", ["a", " ", " b"]),
        ("\nThe cat.", ["\n", "The", " cat", "."]),
        ("international", ["intern", "ationa", "l"]),
    ],
)
def test_tokenizer_pieces(text: str, pieces: list[str]) -> None:
    tok = Tokenizer()
    assert tok.pieces(tok.encode(text)) == pieces


def test_special_tokens_have_qwen_ids() -> None:
    tok = Tokenizer()
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [151643, 151644, 151645]


def test_tokenizer_is_fast() -> None:
    tok = Tokenizer()
    text = (PROSE * 5)[:2048]
    tok.encode(text)
    start = time.perf_counter()
    for _ in range(200):
        tok.encode(text)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 0.002  # generous bound for a loaded CI box; the benchmark has the figure
    big = PROSE * 300
    start = time.perf_counter()
    assert tok.decode(tok.encode(big)) == big
    assert time.perf_counter() - start < 1.0


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("messages", "tools", "expected"),
    [
        (
            USER,
            None,
            f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            [{"role": "system", "content": "Be brief."}, *USER],
            None,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            [*USER, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Q"}],
            None,
            f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            USER,
            [
                {
                    "type": "function",
                    "function": {"name": "f", "description": None, "parameters": {"b": 1, "a": 2}},
                }
            ],
            f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n# Tools\n\nYou may call one or more "
            "functions to assist with the user query.\n\nYou are provided with function "
            "signatures within "
            '<tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "f", '
            '"description": null, "parameters": {"b": 1, "a": 2}}}\n</tools>\n\nFor each function '
            "call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [
                *USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get", "arguments": {"city": "Zürich"}},
                        }
                    ],
                },
                {"role": "tool", "content": "12C"},
                {"role": "tool", "content": "sunny"},
            ],
            None,
            f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "get", "arguments": {"city": "Zürich"}}'
            "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n12C\n</tool_response>\n"
            "<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
    ],
)
def test_qwen25_template(
    messages: list[dict[str, object]], tools: list[dict[str, object]] | None, expected: str
) -> None:
    assert render_chat(messages, tools) == expected


def test_continue_final_message_leaves_it_open() -> None:
    msgs = [*USER, {"role": "assistant", "content": "Sure, "}]
    out = render_chat(msgs, None, add_generation_prompt=False, continue_final_message=True)
    assert out.endswith("<|im_start|>assistant\nSure, ")


def test_generated_reply_retokenizes_and_multi_turn_reuse_extends_through_it() -> None:
    tok = Tokenizer()
    engine = Engine(EngineConfig(output_len=60), tok)
    turn1 = [{"role": "user", "content": PROSE}]
    p1 = tok.encode(render_chat(turn1))
    req = engine.new_request("a", p1, None, 0.0, IM_END_ID)
    engine.add(req)
    t = 0.0
    while engine.has_work():
        plan, d = engine.plan_step(0.5, t)
        t += d
        engine.finish_step(plan, t)
    assert req.finish_reason == "stop"
    reply_ids = req.output_ids[:-1]
    reply = tok.decode(reply_ids)
    assert tok.encode(reply) == reply_ids
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    p2 = tok.encode(render_chat(turn2))
    assert p2[: req.num_tokens] == req.token_ids  # the prompt extends prompt + reply + <|im_end|>
    second = engine.new_request("b", p2, 1, t, IM_END_ID)
    engine.add(second)
    while engine.has_work():
        plan, d = engine.plan_step(0.5, t)
        t += d
        engine.finish_step(plan, t)
    # Every block computed during turn 1 (the last sampled token was never computed) is hit.
    assert second.num_cached_tokens == (req.num_tokens - 1) // 16 * 16
