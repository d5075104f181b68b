"""The block index's cost per request: recording a prompt (32 prompts sharing 90% prefixes,
each with a fresh tail, as the router records it at `sent`) and its reply, at a few chain
lengths, with a capacity that holds everything or one that makes every request evict as
much as it adds. Before/after: run it against another tree with `PYTHONPATH=SRC`.

    .venv/bin/python bench/bench_index.py
    PYTHONPATH=/tmp/base .venv/bin/python bench/bench_index.py
"""

from __future__ import annotations

import random
import time

from gateway.routing.index import BlockIndex

CASES = ((32, 4, 2_000), (1024, 100, 50_000), (4096, 400, 200_000))  # blocks, tail, small cap


def workload(blocks: int, tail: int, requests: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(1)
    prefixes = [[rng.getrandbits(63) for _ in range(blocks - tail)] for _ in range(32)]
    out = []
    for i in range(requests):
        prompt = prefixes[i % 32] + [rng.getrandbits(63) for _ in range(tail)]
        out.append((prompt, prompt + [rng.getrandbits(63) for _ in range(2)]))
    return out


def per_request_us(load: list[tuple[list[int], list[int]]], capacity: int) -> float:
    idx = BlockIndex(capacity)
    t0 = time.perf_counter()
    for prompt, reply in load:
        idx.record("r", prompt, len(prompt), idx.matched("r", prompt))
        idx.record("r", reply, len(reply), len(prompt))
    return (time.perf_counter() - t0) / len(load) * 1e6


def main() -> None:
    print("| blocks | no eviction µs/request | every request evicts µs/request |")
    print("|---|---|---|")
    for blocks, tail, small in CASES:
        load = workload(blocks, tail, 2000 if blocks < 4000 else 1000)
        roomy = min(per_request_us(load, 10**8) for _ in range(3))
        tight = min(per_request_us(load, small) for _ in range(3))
        print(f"| {blocks} | {roomy:.1f} | {tight:.1f} |")


if __name__ == "__main__":
    main()
