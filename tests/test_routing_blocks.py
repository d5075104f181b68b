"""Chained block hashing: golden vectors pin the algorithm (xxh3_64, seed = parent)."""

from __future__ import annotations

import pytest
import xxhash

from gateway.routing.blocks import chain_hashes, tail_hash

GOLDEN_512 = [
    7027844749552840021, 11088363689162993231, 7433216822090919449, 256914705335664562,
    14364391403593340504, 10878401153400742614, 6473049670743475384, 11044299899346895831,
]


@pytest.mark.parametrize(
    ("data", "seed", "block", "expected"),
    [
        (b"", 0, 64, []),
        (b"a" * 63, 0, 64, []),  # partial blocks are never hashed
        (bytes(range(256)) * 2, 0, 64, GOLDEN_512),
        (b"abcdefgh" * 2 + b"x", 42, 8, [6582224532482612904, 6956129310267411041]),
    ],
)
def test_golden(data: bytes, seed: int, block: int, expected: list[int]) -> None:
    assert chain_hashes(data, seed, block) == expected


def test_each_hash_is_seeded_by_its_parent() -> None:
    hs = chain_hashes(b"x" * 24, 7, 8)
    assert hs[0] == xxhash.xxh3_64_intdigest(b"x" * 8, 7)
    assert hs[1] == xxhash.xxh3_64_intdigest(b"x" * 8, hs[0])
    assert len(set(hs)) == 3  # equal blocks at different depths differ


def test_an_early_difference_changes_every_later_hash() -> None:
    a = chain_hashes(b"A" + b"x" * 63, 0, 8)
    b = chain_hashes(b"B" + b"x" * 63, 0, 8)
    assert not set(a) & set(b)
    c = chain_hashes(b"x" * 56 + b"y" * 8, 0, 8)
    d = chain_hashes(b"x" * 64, 0, 8)
    assert c[:7] == d[:7] and c[7] != d[7]


def test_tail_hash_covers_only_the_partial_block() -> None:
    data = b"x" * 16 + b"tail"
    hs = chain_hashes(data, 0, 8)
    assert tail_hash(data, 2, 8, hs[-1]) == xxhash.xxh3_64_intdigest(b"tail", hs[-1])
