"""Token-mode decision cost: the new turn of a 32k-token conversation, tokenization cache
warm.

    .venv/bin/python bench/bench_tokens.py [--rounds N] [--tokens 32768] [--replicas 4]
        [--reply-words 60] [--question-words 200]

A conversation is grown turn by turn (user ~400 tokens, assistant ~120) until it renders to
`--tokens` tokens with the test model's tokenizer and ChatML template
(tests/data/tiny-model, the model real vLLM serves in the tests). Every replica's KV index
holds the conversation's blocks from its events, as after earlier turns. Each round adds two
fresh turns (an assistant reply and a user question) and times, interleaved:

- `decide`: the whole routing decision for a new turn in token mode (render the template,
  tokenize what follows the longest checkpoint the conversation's earlier requests left,
  chain-hash the new blocks at block size 32, match on every live replica; the text-mode
  work beside it, the policy, and recording the send), through the router's protocol;
- `lookup`: TokenMode.lookup alone, for another new turn;
- `cold`: lookup with an empty tokenization cache (for scale; 20 rounds, after the others);
- parts of `lookup`: `render` (the chat template alone) and `new_turn` (the tokenizer on
  the new turn's two pieces alone, what the cache cannot save).

Median and p90 over N rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from router_calls import decide, finish

from gateway.events.decode import BlockStored
from gateway.events.kvindex import KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.sim.generator import WORDS
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

MODEL = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny-model"
BLOCK = 32


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def renderer() -> TokenRenderer:
    return TokenRenderer("tiny", load_template(MODEL),
                         TokenizerCache.from_file(MODEL / "tokenizer.json"), BLOCK)


def conversation(r: TokenRenderer, rng: random.Random, tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 60)}]
    while True:
        messages.append({"role": "user", "content": text(rng, 200)})
        if len(r.token_ids({"messages": messages}, "chat")) >= tokens:
            return messages
        messages.append({"role": "assistant", "content": text(rng, 60)})


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--reply-words", type=int, default=60)
    ap.add_argument("--question-words", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(7)
    r = renderer()
    history = conversation(r, rng, args.tokens)
    ids = r.token_ids({"messages": history}, "chat")
    index = KVIndex()
    names = [f"r{i}" for i in range(args.replicas)]
    full = len(ids) // BLOCK
    for i, name in enumerate(names):
        index.add_replica(name, "tiny", BLOCK)
        index.set_connected(name, True, 0.0)
        held = full if i == 0 else full // (i + 1)  # the conversation's home, and others
        index.apply(name, [BlockStored(tuple(range(held)), None, tuple(ids[: held * BLOCK]),
                                       BLOCK)], 0.0)
    mode = TokenMode({"tiny": r}, index)
    router = Router(RoutingConfig(seed=1), mode)
    states = [ReplicaState(n, 0) for n in names]
    times: dict[str, list[float]] = {"decide": [], "lookup": [], "cold": [], "render": [],
                                     "new_turn": []}
    matched = 0
    for k in range(args.rounds):
        def fresh() -> dict[str, Any]:
            reply, question = text(rng, args.reply_words), text(rng, args.question_words)
            return {"model": "tiny", "messages": [*history,
                                                  {"role": "assistant", "content": reply},
                                                  {"role": "user", "content": question}]}
        body, other = fresh(), fresh()  # two new turns: one decided, one looked up
        for name in names:  # events keep flowing (else the sends make replicas stale)
            index.apply(name, [], 1.0 + k)
        r.tokenizer.encode("")  # keep the interpreter warm identically for all of them
        t0 = time.perf_counter()
        got = mode.lookup(other, "chat", "tiny", names, 1.0 + k)
        t1 = time.perf_counter()
        plan = decide(router, body, "tiny", states, 1.0 + k)
        t2 = time.perf_counter()
        # The request completes (as requests do: the router's in-flight set stays small).
        finish(router, plan, plan.decision.replica, plan.decision.estimated_prompt_tokens,
               plan.decision.predicted_cached_tokens, 1.0 + k, 1.0 + k, None, None)
        assert r.template is not None
        t5 = time.perf_counter()
        r.template.render(body["messages"])
        t6 = time.perf_counter()
        piece = r.tokenizer._encode_piece
        piece(f"assistant\n{body['messages'][-2]['content']}<|im_end|>")
        piece(f"user\n{body['messages'][-1]['content']}<|im_end|>")
        t7 = time.perf_counter()
        times["render"].append((t6 - t5) * 1e3)
        times["new_turn"].append((t7 - t6) * 1e3)
        times["lookup"].append((t1 - t0) * 1e3)
        times["decide"].append((t2 - t1) * 1e3)
        assert got is not None
        matched = got.matched[names[0]]
    # Cold lookups apart: 15 ms of tokenizing each would evict the CPU caches the timed
    # decisions above run in.
    for k in range(min(args.rounds, 20)):
        cold = TokenMode({"tiny": TokenRenderer("tiny", r.template, TokenizerCache.from_file(
            MODEL / "tokenizer.json"), BLOCK)}, index)
        t3 = time.perf_counter()
        cold.lookup(body, "chat", "tiny", names, 1.0 + args.rounds + k)
        times["cold"].append((time.perf_counter() - t3) * 1e3)
    print(f"conversation: {len(ids)} tokens, {len(history)} messages; new turn ~"
          f"{len(r.token_ids(body, 'chat')) - len(ids)} tokens; replicas {args.replicas}; "
          f"home replica matched {matched}/{full} blocks")
    for name, xs in times.items():
        print(f"{name:8s} p50 {statistics.median(xs):7.3f} ms   p90 {pct(xs, 0.9):7.3f} ms   "
              f"(n={len(xs)})")


if __name__ == "__main__":
    main()
