"""Work resumed from the longest prefix seen before (checkpoints.py): the text-mode chain
(`TextChains`) and the token-mode prompt (`PromptChains`) give exactly what computing the
whole prompt gives, for any history of earlier prompts; and the store keeps its bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.checkpoints import Checkpoints, Run
from gateway.routing.blocks import TextChains, chain_hashes
from gateway.tokens.chain import chain_token_hashes
from gateway.tokens.prompts import PromptChains
from gateway.tokens.tokenize import TokenizerCache

MODEL = Path(__file__).parent / "data" / "tiny-model"
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def tokenizer() -> TokenizerCache:
    return TokenizerCache.from_file(MODEL / "tokenizer.json")


# the store ------------------------------------------------------------------------------
def test_keys_name_whole_stride_prefixes() -> None:
    cp: Checkpoints[str] = Checkpoints(4, 100)
    assert cp.keys(b"abc", 1) == []
    a, b = cp.keys(b"abcdefgh", 1), cp.keys(b"abcdefghij", 1)
    assert len(a) == 2 and a == b  # the partial stride is not keyed
    assert cp.keys(b"abcdefgh", 2)[0] != a[0]  # seeded
    assert cp.keys(b"abcXefgh", 1)[1] != a[1]  # chained: an early byte changes later keys


@pytest.mark.parametrize(("stored", "asked", "found"), [
    ([], 3, 0),
    ([0], 3, 1),
    ([0, 1], 3, 2),
    ([2], 3, 3),
    ([0, 2], 2, 1),  # key 2 is beyond what was asked
])
def test_find_returns_the_longest_stored_prefix(stored: list[int], asked: int,
                                                  found: int) -> None:
    cp: Checkpoints[int] = Checkpoints(4, 100)
    keys = cp.keys(b"x" * 12 + b"abcdefghijklmnop", 7)
    for k in stored:
        cp.put(keys[k], k, Run([1]))
    j, state = cp.find(keys[:asked])
    assert j == found and state == (found - 1 if found else None)


def test_budget_counts_a_shared_run_once_and_evicts_oldest() -> None:
    cp: Checkpoints[int] = Checkpoints(1, budget=10, max_entries=100)
    one, two = Run([0] * 6), Run([0] * 6)
    for k in range(5):
        cp.put(k, k, one)  # five states, one run of 6 hashes
    assert (len(cp), cp.held) == (5, 6)
    cp.put(10, 10, two)  # 12 > 10: the oldest go until `one` is released
    assert (len(cp), cp.held) == (1, 6)
    assert cp.find([10]) == (1, 10) and cp.find([4]) == (0, None)
    cp.put(10, 11, two)  # replacing a state keeps the count right
    assert (len(cp), cp.held) == (1, 6)


def test_a_run_is_extended_only_from_its_last_checkpoint() -> None:
    cp: Checkpoints[int] = Checkpoints(1, budget=100)
    run = Run([1, 2])
    cp.put(1, 0, run)
    run.reach = 2
    assert cp.run_for(run, 2, [1, 2, 3]) is run  # resumed at its end: grown in place
    assert run.hashes == [1, 2, 3] and cp.held == 3
    fork = cp.run_for(run, 1, [1, 9])  # resumed earlier: a run of its own
    assert fork is not run and run.hashes == [1, 2, 3] and fork.hashes == [1, 9]
    assert cp.run_for(None, 0, [5]).hashes == [5]


def test_max_entries_bound() -> None:
    cp: Checkpoints[int] = Checkpoints(1, budget=1 << 30, max_entries=3)
    for k in range(10):
        cp.put(k, k, Run([k]))
    assert len(cp) == 3 and cp.held == 3


# text mode ------------------------------------------------------------------------------
prompts = st.lists(st.binary(max_size=40), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(turns=prompts, forks=st.lists(st.integers(0, 7), max_size=6),
       block=st.sampled_from([1, 4, 8]), stride_blocks=st.sampled_from([1, 2, 3]))
def test_text_chains_equal_hashing_the_whole(turns: list[bytes], forks: list[int], block: int,
                                            stride_blocks: int) -> None:
    chains = TextChains(block, stride_blocks, budget=64)  # small: eviction happens too
    history = b""
    for i, turn in enumerate(turns):
        history += turn
        for data in (history, history[: len(history) // 2] + b"fork%d" % i):
            assert chains.hashes(data, 3) == chain_hashes(data, 3, block)
    for f in forks:  # revisit earlier prefixes
        data = history[: f * 7]
        assert chains.hashes(data, 3) == chain_hashes(data, 3, block)


# token mode -----------------------------------------------------------------------------
words = st.sampled_from(["hi", "the", "café", "日本", " ", "\n", "x1", "<|im", "end|>", "  a",
                         *SPECIALS])
texts = st.lists(words, max_size=30).map("".join)


def turn_text(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@settings(max_examples=150, deadline=None)
@given(contents=st.lists(texts, min_size=1, max_size=8), cuts=st.lists(st.floats(0, 1),
       max_size=5), stride=st.sampled_from([1, 8, 16, 64]), block=st.sampled_from([2, 4, 32]),
       revisit=st.lists(st.integers(0, 7), max_size=4))
def test_prompt_chains_equal_tokenizing_the_whole(
        tokenizer: TokenizerCache, contents: list[str], cuts: list[float], stride: int,
        block: int, revisit: list[int]) -> None:
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    chains = PromptChains(tokenizer, block, stride=stride, budget_hashes=200)
    full = "".join(turn_text("user" if i % 2 == 0 else "assistant", c)
                   for i, c in enumerate(contents))
    # Growing prompts, some cut anywhere (mid-word, after no special token: what follows
    # may tokenize together with their end), then earlier ones again.
    seen = [full[: round(c * len(full))] for c in sorted(cuts)] + [full]
    for text in seen + [seen[k % len(seen)] for k in revisit]:
        ids = whole.encode(text, add_special_tokens=False).ids
        assert chains.encode(text, 5) == (len(ids), chain_token_hashes(ids, 5, block))


def test_a_text_end_that_is_no_cut_is_not_resumed_from(tokenizer: TokenizerCache) -> None:
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    chains = PromptChains(tokenizer, 4, stride=1)  # a checkpoint after every byte
    first = turn_text("user", "hello there") + "<|im_start|>a"
    longer = first + "b<|im_end|>\n"  # "ab" is one token, not "a" + "b"
    for text in (first, longer):
        ids = whole.encode(text, add_special_tokens=False).ids
        assert chains.encode(text, 0) == (len(ids), chain_token_hashes(ids, 0, 4))


def test_a_follow_up_tokenizes_only_its_new_turn(tokenizer: TokenizerCache) -> None:
    cache = TokenizerCache.from_file(MODEL / "tokenizer.json")
    chains = PromptChains(cache, 32, stride=64)
    history = "".join(turn_text("user", f"turn {i} " + "w " * 40) for i in range(20))
    chains.encode(history, 1)
    hits, misses = cache.hits, cache.misses
    chains.encode(history + turn_text("assistant", "a fresh reply"), 1)
    # Resumed at the last checkpoint: of the 41 pieces before the new turn only those
    # after it (within one stride, 64 bytes, and the piece it cuts) are looked up again;
    # only the new turn's piece is tokenized.
    assert cache.hits - hits <= 3 and cache.misses - misses == 1


def test_a_growing_conversation_keeps_one_hash_list(tokenizer: TokenizerCache) -> None:
    text_chains = TextChains(8, stride_blocks=4)
    prompt_chains = PromptChains(tokenizer, 4, stride=32)
    history = ""
    for i in range(60):
        history += turn_text("user" if i % 2 == 0 else "assistant", f"turn {i} " + "w " * 9)
        hashes = text_chains.hashes(history.encode(), 1)
        _, token_hashes = prompt_chains.encode(history, 1)
    # Each conversation is one run extended in place: one list each is
    # referenced (with a list per turn, about 30x as many hashes were).
    assert text_chains.held == len(hashes)
    assert prompt_chains.held == len(token_hashes)
