"""Properties of normalization and block hashing on arbitrary input: either a canonical
stream or a NormalizeError (the proxy's 400), never another exception; hashes name
prefixes (the basis of prefix routing)."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.blocks import chain_hashes
from gateway.routing.normalize import END, START, NormalizeError, canonical_bytes, chain_seed
from tests.props import chat_body, completion_body, plain_message, text

GENERATION_PROMPT = f"{START}assistant\n".encode()


def _render(body: Any, endpoint: Any) -> bytes | None:
    try:
        return canonical_bytes(body, endpoint)
    except NormalizeError:
        return None


@settings(max_examples=300, deadline=None)
@given(chat_body)
def test_chat_bodies_render_or_raise_normalize_error(body: dict[str, Any]) -> None:
    first = _render(body, "chat")
    assert first == _render(body, "chat")  # deterministic
    with contextlib.suppress(NormalizeError):
        chain_seed(body, "chat", "m")


@settings(max_examples=200, deadline=None)
@given(completion_body)
def test_completion_bodies_render_or_raise_normalize_error(body: dict[str, Any]) -> None:
    out = _render(body, "completions")
    assert out is None or isinstance(out, bytes)


@settings(max_examples=200, deadline=None)
@given(st.lists(plain_message, min_size=1, max_size=6), plain_message)
def test_a_follow_up_extends_the_previous_prompt(
    history: list[dict[str, Any]], new: dict[str, Any]
) -> None:
    """A conversation's next request renders as the previous one (minus the generation
    prompt) followed by the new turn: what lets a follow-up match its history's blocks."""
    before = canonical_bytes({"messages": history}, "chat")
    after = canonical_bytes({"messages": [*history, new]}, "chat")
    assert before.endswith(GENERATION_PROMPT)
    stem = before[: -len(GENERATION_PROMPT)]
    assert after.startswith(stem)
    assert after[len(stem):].endswith(END.encode() + GENERATION_PROMPT)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 2**64 - 1), st.sampled_from([1, 7, 64]))
def test_hashes_name_prefixes(data: bytes, seed: int, block: int) -> None:
    hashes = chain_hashes(data, seed, block)
    assert len(hashes) == len(data) // block
    for k in range(len(hashes) + 1):
        assert chain_hashes(data[: k * block], seed, block) == hashes[:k]


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=64, max_size=640), st.data())
def test_a_changed_byte_changes_its_block_and_every_later_one(data: bytes, draw: Any) -> None:
    block = 64
    at = draw.draw(st.integers(0, len(data) // block * block - 1))
    changed = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
    a, b = chain_hashes(data, 0, block), chain_hashes(changed, 0, block)
    first = at // block
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


@settings(max_examples=100, deadline=None)
@given(text, text)
def test_cache_salt_separates_chains(salt_a: str, salt_b: str) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    a = chain_seed({**body, "cache_salt": salt_a}, "chat", "m")
    b = chain_seed({**body, "cache_salt": salt_b}, "chat", "m")
    assert (a == b) == (salt_a == salt_b)
