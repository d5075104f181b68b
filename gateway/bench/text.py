"""Deterministic synthetic text for workloads and trace replay.

Text is made of pseudo-words drawn from a seeded `random.Random`; the seed is a string
(Python hashes string seeds with SHA-512, so the output is identical across processes and
runs, unlike `hash()`). Sizes are given in approximate tokens: these pseudo-words come out
at ~4.6 characters per token with BPE-like tokenizers (measured with the simulator's); the
engine's own count is what the reports use.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 4.6

_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "st")


def _vocabulary() -> tuple[str, ...]:
    rng = random.Random("gateway-bench-vocabulary")
    words: set[str] = set()
    while len(words) < 600:
        syllables = rng.choice((1, 1, 2, 2, 3))
        words.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return tuple(sorted(words))


VOCABULARY = _vocabulary()


def words(seed: str, tokens: int) -> str:
    """About `tokens` tokens of text, a pure function of (seed, tokens)."""
    if tokens <= 0:
        return ""
    rng = random.Random(seed)
    target = int(tokens * CHARS_PER_TOKEN)
    out: list[str] = []
    size = 0
    sentence = 0
    while size < target:
        word = rng.choice(VOCABULARY)
        sentence += 1
        if sentence >= rng.randint(8, 16):
            word += "."
            sentence = 0
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def identifier(seed: str) -> str:
    """A short snake_case name (tool names, parameter names)."""
    rng = random.Random(seed)
    return "_".join(rng.choice(VOCABULARY) for _ in range(2))
