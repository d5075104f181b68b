"""Filler text for routing tests: seeded random words, with the punctuation-carrying pieces
("dog,", "result:", "42.") that make tokenization less uniform than plain words."""

from __future__ import annotations

import random

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "orange",
    "table",
    "window",
    "seven",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog,",
    "result:",
    "value",
    "=",
    "42.",
    "function",
    "call",
    "returns",
    "data",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))
