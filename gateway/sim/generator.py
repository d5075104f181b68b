"""Deterministic pseudo-text for generated tokens.

The reply to a prompt is drawn from a ``random.Random`` keyed on (simulator seed, prompt
token ids), so the same prompt gets the same reply on every replica and every run, like
greedy decoding. Tokens are words of at most six ASCII letters (capitalised without a
leading space at the start and after a full stop, " word" otherwise) and single "," or "."
pieces never back to back. Every token is one piece of ``Tokenizer``, so the reply text
re-tokenizes to exactly the generated ids when a client sends it back as the next turn's
assistant message: multi-turn reuse then extends through the previous reply as in vLLM.

Length: with ``max_tokens`` given the reply runs to it (finish_reason "length"); without it
the natural length is ``output_len`` scaled by a seeded factor in [0.5, 1.5] and the reply
ends with the stop token (finish_reason "stop").
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import xxhash

from gateway.sim.tokenizer import Tokenizer

# the reply vocabulary; the benches reuse it for filler prompts
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "from",
    "have",
    "or",
    "by",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "number",
    "great",
    "tell",
    "help",
    "every",
    "line",
    "set",
    "own",
    "under",
    "read",
    "last",
    "never",
    "us",
    "left",
    "end",
    "along",
    "while",
    "might",
    "next",
    "sound",
    "below",
    "saw",
    "cache",
    "block",
    "prefix",
    "token",
    "engine",
    "batch",
    "model",
    "server",
    "router",
    "replica",
    "memory",
    "compute",
]


class OutputGenerator:
    def __init__(self, tokenizer: Tokenizer, seed: int, output_len: int) -> None:
        self._seed = seed
        self.output_len = max(1, output_len)
        enc = tokenizer.encode
        self._lower = [enc(" " + w)[0] for w in WORDS]
        self._capital_first = [enc(w.capitalize())[0] for w in WORDS]
        self._capital = [enc(" " + w.capitalize())[0] for w in WORDS]
        self._comma = enc(",")[0]
        self._stop = enc(".")[0]

    def rng_for(self, prompt_ids: Sequence[int]) -> random.Random:
        key = xxhash.xxh3_64_intdigest(array("Q", prompt_ids).tobytes(), seed=self._seed)
        return random.Random(key)

    def natural_len(self, rng: random.Random) -> int:
        return max(1, round(self.output_len * (0.5 + rng.random())))

    def next_token(self, rng: random.Random, previous: int | None) -> int:
        if previous is None:
            return rng.choice(self._capital_first)
        if previous == self._stop:
            return rng.choice(self._capital)
        if previous == self._comma:
            return rng.choice(self._lower)
        r = rng.random()
        if r < 0.06:
            return self._comma
        if r < 0.12:
            return self._stop
        return self._lower[int(r * 1_000_003) % len(self._lower)]
