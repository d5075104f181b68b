"""The parity self-check, as a table over the causes it names, plus the recorded real vLLM
probe (tokens and first event) that must pass."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgpack
import pytest

from gateway.events.decode import BlockStored, decode_message
from gateway.events.parity import check
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

DATA = Path(__file__).parent / "data"
MODEL = DATA / "tiny-model"
VOCAB = {1: "a", 2: "b", 3: "c", 4: "ab", 5: "x"}


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def ev(tokens: tuple[int, ...], size: int = 2) -> BlockStored:
    return BlockStored(tuple(range(len(tokens) // size)), None, tokens, size)


@pytest.mark.parametrize(("ours", "theirs", "event", "ok", "cause"), [
    ([1, 2, 3, 1], [1, 2, 3, 1], ev((1, 2, 3, 1)), True, None),
    ([1, 2, 3, 1], [1, 2, 3, 1], None, True, None),
    ([1, 2, 3, 1], None, ev((1, 2)), True, None),
    ([1, 2, 3, 1], [4, 3, 1], None, False, "tokenizer"),  # "abca" both, other ids
    ([1, 2, 3, 1], [1, 5, 3, 1], None, False, "template"),  # "axca": other text
    ([1, 2, 3, 1], [1, 2, 3, 1, 2], None, False, "length"),
    ([1, 2, 3, 1], [1, 2, 3, 1], ev((1, 2, 3, 1), 4), False, "block_size"),
    ([1, 2, 3, 1], None, ev((1, 5)), False, "template"),
    ([1, 2, 3, 1], None, None, False, None),
])
def test_parity_table(ours: list[int], theirs: list[int] | None, event: BlockStored | None,
                      ok: bool, cause: str | None) -> None:
    got = check("abca", ours, 2, theirs, event, decode)
    assert (got.ok, got.cause) == (ok, cause), got.message


def test_recorded_real_probe_passes() -> None:
    tok = TokenizerCache.from_file(MODEL / "tokenizer.json")
    template = load_template(MODEL)
    r = TokenRenderer("tiny", template, tok, 32)
    body = json.loads((DATA / "kv_events_vllm032.requests.json").read_text())[1]
    rendered = template.render(body["messages"])
    theirs = json.loads((DATA / "kv_events_vllm032.tokenize1.json").read_text())["tokens"]
    frames = msgpack.unpackb((DATA / "kv_events_vllm032.msgpack").read_bytes())
    first = next(e for e in decode_message(frames[0]).events if isinstance(e, BlockStored))
    ours = r.token_ids(body, "chat")
    assert check(rendered, ours, 32, theirs, first).ok
    assert check(rendered, ours, 16, theirs, first).cause == "block_size"
    # A template that drops Qwen's default system prompt: caught as a template mismatch.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    other = rendered.replace("You are Qwen", "You are Bob")
    other_ids = raw.encode(other, add_special_tokens=False).ids
    got = check(other, other_ids, 32, theirs, first,
                lambda ids: raw.decode(list(ids), skip_special_tokens=False))
    assert (got.ok, got.cause) == (False, "template")
