"""gateway.pd.reuse: the decoder-KV memory hands params out only for a prompt that extends
the remembered turn exactly, fresh, once; bounded by count (LRU) and time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.pd.reuse import DIGEST_BYTES, DecoderKvMemory

TURN = b"<system>be brief<user>hi<assistant>hello there"
PARAMS = {"do_remote_decode": True, "remote_engine_id": "d-1", "remote_num_tokens": 40}


def memory(max_entries: int = 8, ttl_s: float = 100.0) -> DecoderKvMemory:
    m = DecoderKvMemory(max_entries, ttl_s)
    m.remember("conv", "d0", TURN, PARAMS, now=10.0)
    return m


@pytest.mark.parametrize(
    ("key", "prompt", "now", "expect"),
    [
        ("conv", TURN + b"<user>more", 10.0, ("d0", PARAMS)),  # extends it
        ("conv", TURN, 50.0, ("d0", PARAMS)),  # the very same bytes
        ("conv", TURN + b"<user>more", 109.999, ("d0", PARAMS)),  # just before the TTL
        ("conv", TURN + b"<user>more", 110.0, None),  # expired at the TTL
        ("conv", TURN[:-1] + b"<user>more", 10.0, None),  # the answer was cut
        ("conv", b"x" + TURN, 10.0, None),  # something before it
        ("conv", TURN.replace(b"hi", b"ho") + b"<user>more", 10.0, None),  # edited history
        ("conv", TURN[:10], 10.0, None),  # shorter than the turn
        ("other", TURN + b"<user>more", 10.0, None),  # another conversation
    ],
)
def test_take_table(key: str, prompt: bytes, now: float,
                    expect: tuple[str, dict[str, object]] | None) -> None:
    assert memory().take(key, prompt, now) == expect


def test_an_entry_is_used_once_and_a_mismatch_drops_it() -> None:
    m = memory()
    assert m.take("conv", TURN + b"!", 11.0) == ("d0", PARAMS)
    assert m.take("conv", TURN + b"!", 11.0) is None
    m = memory()
    assert m.take("conv", b"edited", 11.0) is None
    assert m.take("conv", TURN + b"!", 11.0) is None and len(m) == 0


def test_params_are_copies() -> None:
    params = dict(PARAMS)
    m = DecoderKvMemory(4, 10.0)
    m.remember("c", "d0", TURN, params, 0.0)
    params["remote_engine_id"] = "changed"
    taken = m.take("c", TURN, 1.0)
    assert taken is not None and taken[1]["remote_engine_id"] == "d-1"


def test_bounded_lru_and_expiry_on_remember() -> None:
    m = DecoderKvMemory(3, 100.0)
    for i in range(5):
        m.remember(f"c{i}", "d0", TURN, PARAMS, float(i))
    assert len(m) == 3
    assert m.take("c0", TURN, 5.0) is None and m.take("c1", TURN, 5.0) is None
    assert m.take("c4", TURN, 5.0) is not None
    # Remembering again moves a key to the end: c2 survives c5 and c6, c3 does not.
    m.remember("c2", "d0", TURN, PARAMS, 6.0)
    m.remember("c5", "d0", TURN, PARAMS, 6.0)
    m.remember("c6", "d0", TURN, PARAMS, 6.0)
    assert m.take("c3", TURN, 7.0) is None and m.take("c2", TURN, 7.0) is not None
    # Expired entries leave at the next remember, whatever the count.
    m.remember("late", "d0", TURN, PARAMS, 500.0)
    assert len(m) == 1


def test_forget_replica_and_empty_turn() -> None:
    m = DecoderKvMemory(8, 100.0)
    m.remember("a", "d0", TURN, PARAMS, 0.0)
    m.remember("b", "d1", TURN, PARAMS, 0.0)
    m.forget_replica("d0")
    assert m.take("a", TURN, 1.0) is None and m.take("b", TURN, 1.0) is not None
    m.remember("e", "d0", b"", PARAMS, 0.0)
    assert len(m) == 0 and m.take("e", b"anything", 1.0) is None


@pytest.mark.parametrize(("max_entries", "ttl_s"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_bad_bounds(max_entries: int, ttl_s: float) -> None:
    with pytest.raises(ValueError):
        DecoderKvMemory(max_entries, ttl_s)


@given(
    history=st.binary(min_size=2, max_size=200),
    data=st.data(),
    suffix=st.binary(max_size=50),
)
def test_edits_in_the_middle_never_match(history: bytes, data: st.DataObject,
                                         suffix: bytes) -> None:
    at = data.draw(st.integers(0, len(history) - 1))
    kind = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    if kind == "replace":
        byte = data.draw(st.integers(0, 255).filter(lambda b: b != history[at]))
        edited = history[:at] + bytes([byte]) + history[at + 1:]
    elif kind == "insert":
        edited = history[:at] + data.draw(st.binary(min_size=1, max_size=8)) + history[at:]
    else:
        edited = history[:at] + history[at + 1:]
    m = DecoderKvMemory(4, 60.0)
    m.remember("k", "d0", history, PARAMS, 0.0)
    prompt = edited + suffix
    # An insertion or deletion can reproduce the history by chance (inserting a byte
    # equal to its neighbour): only a prompt that truly extends it may match.
    expected = ("d0", PARAMS) if prompt.startswith(history) else None
    assert m.take("k", prompt, 1.0) == expected
    if kind == "replace":
        assert expected is None


def _related_prompt(turn: bytes, data: st.DataObject) -> bytes:
    """A prompt near `turn`: the turn extended, cut, edited at one byte, or unrelated."""
    how = data.draw(st.sampled_from(["extend", "same", "cut", "flip", "other"]))
    if how == "extend":
        return turn + data.draw(st.binary(max_size=40))
    if how == "same":
        return turn
    if how == "cut":
        return turn[:data.draw(st.integers(0, len(turn) - 1))]
    if how == "flip":
        at = data.draw(st.integers(0, len(turn) - 1))
        return turn[:at] + bytes([turn[at] ^ 1]) + turn[at + 1:] + data.draw(st.binary(max_size=8))
    return data.draw(st.binary(max_size=len(turn) + 8))


@given(turn=st.binary(min_size=1, max_size=300), data=st.data())
def test_digest_accepts_exactly_what_the_byte_comparison_accepted(
        turn: bytes, data: st.DataObject) -> None:
    """The entry keeps a length and a digest, not the bytes: `take` must agree with
    `prompt.startswith(turn)` (the check it replaced) on every prompt."""
    prompt = _related_prompt(turn, data)
    m = DecoderKvMemory(4, 60.0)
    m.remember("k", "d0", turn, PARAMS, 0.0)
    expected = ("d0", PARAMS) if prompt.startswith(turn) else None
    assert m.take("k", prompt, 1.0) == expected


def test_an_entry_keeps_no_bytes_of_its_turn() -> None:
    """Memory is bounded per entry whatever the turn's length: a 1 MiB turn leaves a
    16-byte digest and its length, not the turn."""
    big = bytes(range(256)) * 4096
    m = DecoderKvMemory(4, 60.0)
    m.remember("k", "d0", big, PARAMS, 0.0)
    entry = m._entries["k"]
    kept = [v for v in vars_of(entry) if isinstance(v, (bytes, bytearray, memoryview))]
    assert all(len(v) == DIGEST_BYTES for v in kept) and kept
    assert m.take("k", big + b"next", 1.0) == ("d0", PARAMS)


def vars_of(entry: object) -> list[object]:
    return [getattr(entry, name) for name in entry.__slots__]  # type: ignore[attr-defined]
