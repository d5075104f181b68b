"""Token mode: rendering + tokenizing as the replica does (checked against real vLLM 0.32's
recorded `/tokenize` and event token ids), the piece cache, and namespaced chain hashes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gateway.events.decode import BlockStored, decode_message
from gateway.tokens.chain import chain_token_hashes, namespace
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import ChatTemplate, TemplateError, load_template
from gateway.tokens.tokenize import TokenizerCache

DATA = Path(__file__).parent / "data"
MODEL = DATA / "tiny-model"


@pytest.fixture(scope="module")
def renderer() -> TokenRenderer:
    return TokenRenderer("tiny", load_template(MODEL),
                         TokenizerCache.from_file(MODEL / "tokenizer.json"), 32)


def bodies() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads((DATA / "kv_events_vllm032.requests.json").read_text())
    return out


def stored(i: int) -> BlockStored:
    raw = msgpack.unpackb((DATA / "kv_events_vllm032.msgpack").read_bytes())
    return next(e for e in decode_message(raw[i]).events if isinstance(e, BlockStored))


def test_tokens_equal_vllm_tokenize(renderer: TokenRenderer) -> None:
    expected = json.loads((DATA / "kv_events_vllm032.tokenize1.json").read_text())["tokens"]
    assert renderer.token_ids(bodies()[1], "chat") == expected


def test_tokens_equal_event_token_ids(renderer: TokenRenderer) -> None:
    first = renderer.token_ids(bodies()[0], "chat")
    ev = stored(0)
    assert tuple(first[: len(ev.token_ids)]) == ev.token_ids
    # Turn 2's event carries the blocks after turn 1's: they line up with turn 2's tokens.
    second = renderer.token_ids(bodies()[1], "chat")
    ev2 = stored(1)
    assert tuple(second[len(ev.token_ids) : len(ev.token_ids) + len(ev2.token_ids)]) == \
        ev2.token_ids


def test_piece_cache_tokenizes_only_the_new_turn(renderer: TokenRenderer) -> None:
    tok = TokenizerCache.from_file(MODEL / "tokenizer.json")
    r = TokenRenderer("tiny", renderer.template, tok, 32)
    r.token_ids(bodies()[0], "chat")
    misses = tok.misses
    r.token_ids(bodies()[1], "chat")
    # Everything of turn 1 (system, user, the generation prompt) is cached: only the
    # reply and the new user message are tokenized.
    assert tok.misses - misses == 2
    assert tok.hits >= 2


@pytest.mark.parametrize("text", [
    "", "plain", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|><|im_end|>b", "<|endoftext|>x<|im_start|>",
])
def test_split_pieces_tokenize_like_the_whole(text: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    cache = TokenizerCache.from_file(MODEL / "tokenizer.json")
    assert "".join(cache.split(text)) == text
    assert cache.encode(text) == tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(("a", "b"), [
    (("m", None, None), ("m2", None, None)),
    (("m", None, None), ("m", "adapter", None)),
    (("m", None, None), ("m", None, "salt")),
    (("m", "x", None), ("m", None, "x")),
    (("m", "ab", None), ("m", "a", "b")),
])
def test_namespaces_differ(a: tuple[str, str | None, str | None],
                           b: tuple[str, str | None, str | None]) -> None:
    assert namespace(*a) != namespace(*b)


def test_chain_full_blocks_and_resume() -> None:
    ids = list(range(100))
    seed = namespace("m", None, None)
    hashes = chain_token_hashes(ids, seed, 32)
    assert len(hashes) == 3  # 100 tokens: 3 full blocks of 32
    assert chain_token_hashes(ids, hashes[0], 32, start=1) == hashes[1:]
    changed = chain_token_hashes([1, *ids[1:]], seed, 32)
    assert all(x != y for x, y in zip(hashes, changed, strict=True))


def test_salt_and_completions(renderer: TokenRenderer) -> None:
    body = bodies()[0]
    plain = renderer.prompt(body, "chat")
    salted = renderer.prompt({**body, "cache_salt": "tenant-a"}, "chat")
    assert plain.tokens == salted.tokens and plain.hashes[0] != salted.hashes[0]
    assert renderer.token_ids({"prompt": [1, 2, 3]}, "completions") == [1, 2, 3]
    assert renderer.token_ids({"prompt": "hello"}, "completions")


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": ["x"]}, {}])
def test_bad_bodies(renderer: TokenRenderer, body: dict[str, Any]) -> None:
    with pytest.raises(TemplateError):
        renderer.token_ids(body, "chat")


def test_template_errors() -> None:
    t = ChatTemplate.from_source("{{ raise_exception('no tools here') }}")
    with pytest.raises(TemplateError, match="no tools"):
        t.render([])
    with pytest.raises(TemplateError, match="failed"):
        ChatTemplate.from_source("{{ messages[0].content + 1 }}").render([{"content": "a"}])
    assert ChatTemplate.from_source("{{ x | tojson }}").render([], x="é<") == '"é<"'
