"""bench_peers.py's load: the cases, the prompts (deterministic prose with numbers, shared
prefixes plus fresh tails, growing conversations that repeat the answers they got) and
the feeds the workers take request bodies from."""

from __future__ import annotations

import random
from collections.abc import Callable

import orjson

KIB = 1024
CONCURRENCY = 32
PREFIXES = 32

# case -> (kind, prompt bytes, requests per round at --scale 1)
CASES: dict[str, tuple[str, int, int]] = {
    "2k": ("fixed", 2 * KIB, 3000),
    "16k": ("fixed", 16 * KIB, 1500),
    "64k": ("fixed", 64 * KIB, 800),
    "256k": ("fixed", 256 * KIB, 300),
    "grow64k": ("grow", 64 * KIB, 0),
    "grow256k": ("grow", 256 * KIB, 0),
    "stream": ("stream", 2 * KIB, 1500),
}


# -- prompts ----------------------------------------------------------------------------------

_WORDS = (  # noqa: SIM905 (prose reads better than a list of words)
    "the function returns a list of records for each request and the caller checks the "
    "status before it writes the result to the cache; if the file is missing we raise an "
    "error with the path and line number so the agent can retry with another tool call "
    "config value index buffer stream token model router replica prefix block hash table "
    "parse render encode decode commit branch test build deploy review patch diff merge"
).split()


class Text:
    """Deterministic prose with a few numbers in it (agent prompts are code, logs and
    tool output: numbers are common, and the hygiene scanner looks at every digit)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, size: int) -> str:
        rng = self.rng
        out = rng.choices(_WORDS, k=size // 5 + 8)
        for i in range(0, len(out), 25):  # about one number every 25 words
            out[i] = f"line {rng.randrange(1, 999)}"
        text = " ".join(out)
        while len(text) < size:
            text += " " + text
        return text[:size]


def body(messages: list[dict[str, str]], stream: bool) -> bytes:
    doc: dict[str, object] = {"model": "bench", "max_tokens": 16, "messages": messages}
    if stream:
        doc["stream"] = True
    return orjson.dumps(doc)


def fixed_bodies(size: int, n: int, salt: int, stream: bool) -> list[bytes]:
    """n prompts of ~size bytes: one of 32 shared prefixes (~90%) plus a fresh tail."""
    shared = Text(size)
    prefixes = [f"Project {i} instructions. " + shared(int(size * 0.9)) for i in range(PREFIXES)]
    fresh = Text(salt)
    tail = max(16, size - int(size * 0.9))
    return [body([{"role": "system", "content": prefixes[i % PREFIXES]},
                  {"role": "user", "content": f"Task {salt}-{i}: " + fresh(tail)}], stream)
            for i in range(n)]


class Feed:
    """What one client worker sends next, given the answer to what it sent last."""

    def next(self, answer: bytes | None) -> bytes | None:
        raise NotImplementedError


class Queue(Feed):
    """Bodies taken in order by however many workers share this feed."""

    def __init__(self, bodies: list[bytes]) -> None:
        self._it = iter(bodies)

    def next(self, answer: bytes | None) -> bytes | None:
        return next(self._it, None)


class Conversation(Feed):
    """A conversation under a shared 2 KiB system prompt: every turn repeats the previous
    prompt and the answer it got (as a client does) and adds a new user tail, reaching
    about `size` bytes at its last turn."""

    def __init__(self, size: int, turns: int, salt: int, system: str) -> None:
        self.turns = turns
        self.tail = max(64, (size - 2 * KIB) // turns - 64)
        self.text = Text(salt)
        self.name = f"Conversation {salt}"
        self.messages = [{"role": "system", "content": system}]

    def next(self, answer: bytes | None) -> bytes | None:
        turn = sum(m["role"] == "user" for m in self.messages)
        if turn >= self.turns:
            return None
        if answer is not None:
            doc = orjson.loads(answer)
            self.messages.append({"role": "assistant",
                                  "content": doc["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"{self.name}, step {turn}: "
                              + self.text(self.tail)})
        return body(self.messages, False)


def conversations(size: int, turns: int, salt: int) -> list[Feed]:
    system = Text(7)(2 * KIB)
    return [Conversation(size, turns, salt * 1000 + c, system) for c in range(CONCURRENCY)]


def shared_queue(bodies: list[bytes]) -> list[Feed]:
    """CONCURRENCY workers taking the next body from one list."""
    return [Queue(bodies)] * CONCURRENCY


def plan(case: str, scale: float, turns: int) -> tuple[Callable[[int], list[Feed]], int]:
    """(streams for a salt, requests per round) of a case."""
    kind, size, n = CASES[case]
    if kind == "grow":
        return (lambda salt: conversations(size, turns, salt)), CONCURRENCY * turns
    count = max(CONCURRENCY, int(n * scale))
    stream = kind == "stream"
    return (lambda salt: shared_queue(fixed_bodies(size, count, salt, stream))), count
