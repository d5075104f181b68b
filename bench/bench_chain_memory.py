"""Memory of the router's chain-hash checkpoints (`gateway.routing.blocks.TextChains`)
fed the overload soak's prompt shapes (bench/bench_soak.py): 4,000 live conversations
over 40 agent prompts of 300 words, a turn adding 20-80 words and a short reply, 12% of
requests starting a new conversation in place of a random one. Prints the hashes held
and the Python memory traced (tracemalloc) every 20,000 requests: how big the bounded
cache gets and after how many requests it stops growing.

    .venv/bin/python bench/bench_chain_memory.py --requests 200000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.routing.blocks import TextChains
from gateway.sim.generator import WORDS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200_000)
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--every", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prompts = [words(300) + f" Agent {i}." for i in range(40)]
    tracemalloc.start()
    chains = TextChains(64)  # the routing default block_bytes
    convs: list[list[str]] = []
    t0 = time.monotonic()
    for i in range(1, args.requests + 1):
        if len(convs) < args.conversations or rng.random() < 0.12:
            convs.append([rng.choice(prompts)])
            if len(convs) > args.conversations:
                convs.pop(rng.randrange(len(convs)))
        conv = rng.choice(convs)
        conv.append(words(rng.randint(20, 80)))
        conv.append(words(12))
        chains.hashes(" ".join(conv).encode(), 0)
        if i % args.every == 0:
            traced, _ = tracemalloc.get_traced_memory()
            print(f"{i:>8} requests  hashes held {chains.held:>8}  traced "
                  f"{traced / 2**20:6.1f} MiB  ({time.monotonic() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
