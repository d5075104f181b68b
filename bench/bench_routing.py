"""Routing hot path and index memory.

    .venv/bin/python bench/bench_routing.py [--rounds N]

1. Decision time: `Router.route` (normalize + hash + index lookup on every replica + token
   estimate + policy) for a 128 KiB and a 2 KiB chat prompt, 8 replicas whose indexes hold
   the prompt's conversation history on some replicas and other traffic everywhere.
   Median and p90 over N rounds (interleaved, so machine noise hits both sizes alike).
2. The parts of the 128 KiB decision separately (normalize, hash).
3. Index memory: tracemalloc around filling one replica's index with one million blocks
   (hash ints included, as the index is their only holder once requests are done).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from typing import Any

from gateway.routing.blocks import chain_hashes
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.index import BlockIndex
from gateway.routing.normalize import canonical_bytes, chain_seed
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.sim.generator import WORDS


def words(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def body_of(rng: random.Random, nbytes: int) -> dict[str, Any]:
    """A multi-turn agent conversation of about `nbytes` canonical bytes."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": words(rng, min(4096, nbytes // 4))}]
    while sum(len(m["content"]) for m in msgs) < nbytes - 600:
        msgs.append({"role": "user", "content": words(rng, 400)})
        msgs.append({"role": "assistant", "content": words(rng, 200)})
    msgs.append({"role": "user", "content": words(rng, 300)})
    return {"model": "m", "messages": msgs, "temperature": 0.7, "max_tokens": 256}


def _finish(router: Router, plan: RoutePlan, replica: str, prompt_tokens: int,
            now: float) -> None:
    o = plan.outcome
    o.replica, o.first_token_at, o.ok, o.prompt_tokens, o.cached_tokens = (
        replica, now, True, prompt_tokens, 0)
    router.report(plan, now)


def warm_router(bodies: list[dict[str, Any]], replicas: list[str]) -> Router:
    router = Router(RoutingConfig())
    rng = random.Random(2)
    states = [ReplicaState(name=r, in_flight=rng.randint(0, 4)) for r in replicas]
    now = 0.0
    # Other traffic on every replica so the indexes are not trivially small.
    for i in range(400):
        other = body_of(rng, 8192)
        plan = router.decide(other, "chat", "m", f"o{i}", states, now)
        _finish(router, plan, plan.decision.replica, len(plan.data) // 4, now)
    # The benchmarked conversations' history (all but the last message) on two replicas.
    for body in bodies:
        history = {**body, "messages": body["messages"][:-2]}
        for r in replicas[:2]:
            plan = router.decide(history, "chat", "m", "s", states, now)
            _finish(router, plan, r, len(plan.data) // 4, now)
    return router


def time_route(router: Router, body: dict[str, Any], states: list[ReplicaState]) -> float:
    t0 = time.perf_counter()
    router.decide(body, "chat", "m", "s", states, 1.0)
    return time.perf_counter() - t0


def decision_times(rounds: int) -> dict[str, list[float]]:
    rng = random.Random(1)
    replicas = [f"replica-{i}" for i in range(8)]
    big, small = body_of(rng, 128 * 1024), body_of(rng, 2 * 1024)
    router = warm_router([big, small], replicas)
    states = [
        ReplicaState(name=r, in_flight=i % 3, engine_waiting=float(i % 2))
        for i, r in enumerate(replicas)
    ]
    out: dict[str, list[float]] = {"128k": [], "2k": [], "normalize_128k": [], "hash_128k": []}
    for _ in range(rounds):
        out["128k"].append(time_route(router, big, states))
        out["2k"].append(time_route(router, small, states))
        t0 = time.perf_counter()
        data = canonical_bytes(big, "chat")
        t1 = time.perf_counter()
        chain_hashes(data, chain_seed(big, "chat", "m"), 64)
        t2 = time.perf_counter()
        out["normalize_128k"].append(t1 - t0)
        out["hash_128k"].append(t2 - t1)
    return out


def index_bytes_per_block(blocks: int) -> float:
    rng = random.Random(3)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = BlockIndex(blocks)
    chain = 256  # record in request-sized chains, as the router does
    for start in range(0, blocks, chain):
        n = min(chain, blocks - start)
        hashes = [rng.getrandbits(64) | (1 << 63) for _ in range(n)]
        idx.record("r", hashes, n, 0)
        del hashes
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert idx.size("r") == blocks
    return used / blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    times = decision_times(args.rounds)
    print("| measure | median | p90 |")
    print("|---|---|---|")
    for name, values in times.items():
        values.sort()
        med = statistics.median(values) * 1e6
        p90 = values[int(len(values) * 0.9)] * 1e6
        print(
            f"| route {name} (8 replicas) | {med:.0f} us | {p90:.0f} us |"
            if name in ("128k", "2k")
            else f"| {name} | {med:.0f} us | {p90:.0f} us |"
        )
    print(
        f"| index memory at {args.blocks:,} blocks | "
        f"{index_bytes_per_block(args.blocks):.0f} B/block | |"
    )


if __name__ == "__main__":
    main()
