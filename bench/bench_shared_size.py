"""Shared routing state at agent prompt sizes: Redis bytes per follow-up fact, and the time
a (re)starting instance takes to be ready under a full stream.

    .venv/bin/python bench/bench_shared_size.py sizes [--ktokens 8 32 100]
    .venv/bin/python bench/bench_shared_size.py restart [--ktokens 32] [--max-mib 256]

Both start a real redis-server on a free loopback port (no persistence).

`sizes`: a real Router publishes through a real SharedState, as the gateway does, for 20
conversations of N k tokens (about 4 canonical bytes a token): each turn is a `Sent`
with the prompt and a `Reply` with the answer's blocks; a follow-up adds a ~800-token
tool result and a ~200-token answer. Reported: Redis bytes per follow-up fact (MEMORY
USAGE of the stream before and after the follow-ups, over the facts they added), and a
whole fact of the same conversation for comparison (what every fact cost before).

`restart`: fills the stream to its byte bound with synthetic agent traffic of that shape
(conversations of N k tokens, a turn every 8 s each, over the last 9 minutes of
simulated time so that all of it is within `replay_s`), written by a real SharedState
(whole chains every `rebase_s`, deltas otherwise, trimmed by its own byte accounting);
then starts another instance (a Router of 32 replicas of 1M tokens and its SharedState)
and reports how long `start()` took (it applies the newest `catch_up_facts` facts of
the last `replay_s` before it returns), how many facts it applied, and how many deltas it
could not resolve (their chain came before what it read).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.routing.affinity import ResponseAffinity  # noqa: E402
from gateway.routing.config import RoutingConfig  # noqa: E402
from gateway.routing.decision import ReplicaState  # noqa: E402
from gateway.routing.facts import Reply, Sent  # noqa: E402
from gateway.routing.router import Router  # noqa: E402
from gateway.shared.config import RedisSettings  # noqa: E402
from gateway.shared.redis_state import SharedState  # noqa: E402

# 1,000 live 32k-token conversations need ~32 replicas of 1M tokens of KV cache each.
REPLICAS = [f"r{i}" for i in range(32)]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda",
         "sigma", "omega", "file", "line", "function", "returns", "value", "error", "test",
         "build", "module", "import", "class", "method"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


async def written(shared: SharedState, n: int) -> None:
    """Wait (2 minutes at most) until the writer task has written n facts."""
    deadline = time.monotonic() + 120.0
    while shared.written < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{shared.written} of {n} facts written")
        await asyncio.sleep(0.05)


async def sizes(url: str, ktokens: int, conversations: int = 20, turns: int = 5
                ) -> dict[str, float]:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    await client.delete("gateway:routing")
    shared = SharedState(RedisSettings(url=url), lambda f, t: None, ResponseAffinity(),
                         time.time, instance="bench-a")
    router = Router(RoutingConfig(seed=1, default_capacity_tokens=4_000_000),
                    publish=shared.publish)
    await shared.start()
    rng = random.Random(ktokens)
    states = [ReplicaState(n, 0) for n in REPLICAS]
    convs = [[{"role": "system", "content": text(rng, ktokens * 4000)},
              {"role": "user", "content": text(rng, 400)}] for _ in range(conversations)]
    now = time.time()

    def turn(msgs: list[dict[str, Any]]) -> None:
        nonlocal now
        now += 0.01
        plan = router.decide({"model": "m", "messages": msgs}, "chat", "m", None, states, now)
        reply = text(rng, 800)
        o = plan.outcome
        o.replica, o.first_token_at, o.ok = plan.decision.replica, now, True
        o.prompt_tokens, o.cached_tokens = len(plan.data) // 4, None  # no feedback
        o.completion_tokens, o.reply_text = 200, reply
        router.report(plan, now)
        msgs += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": text(rng, 3200)}]

    for msgs in convs:
        turn(msgs)
    n0 = 2 * conversations
    await written(shared, n0)
    whole = await client.memory_usage("gateway:routing", samples=0) or 0
    first: Any = await client.xrange("gateway:routing", count=1)
    whole_fact = sum(len(k) + len(v) for k, v in first[0][1].items())
    for _ in range(turns):
        for msgs in convs:
            turn(msgs)
    n1 = n0 + 2 * conversations * turns
    await written(shared, n1)
    after = await client.memory_usage("gateway:routing", samples=0) or 0
    length = await client.xlen("gateway:routing")
    await shared.aclose()
    await client.aclose()
    assert length == n1, (length, n1)
    return {"ktokens": ktokens, "whole_fact_fields_bytes": whole_fact,
            "first_turn_redis_bytes_per_fact": whole / n0,
            "follow_up_redis_bytes_per_fact": (after - whole) / (n1 - n0)}


async def fill(url: str, ktokens: int, max_bytes: int) -> tuple[int, float]:
    """Synthetic agent traffic until the stream holds its bound; (facts written, s)."""
    from redis.asyncio import Redis

    span = 540.0
    sim = [time.time() - span]
    settings = RedisSettings(url=url, stream_max_bytes=max_bytes)
    shared = SharedState(settings, lambda f, t: None, ResponseAffinity(), lambda: sim[0],
                         instance="bench-a")
    await shared.start()
    client = Redis.from_url(url)
    rng = random.Random(1)
    blocks = ktokens * 4000 // 64
    chains: list[list[int]] = []
    t0 = time.perf_counter()
    published = 0
    # Fill to the bound and a tenth more (so trimming is in force), in simulated time.
    while True:
        used = await client.memory_usage("gateway:routing", samples=0) or 0
        if published and shared.written_bytes >= 1.1 * max_bytes:
            break
        if published % 100_000 == 0:
            print(f"  {published} facts, {shared.written_bytes / 2**20:.0f} MiB counted, "
                  f"{used / 2**20:.0f} MiB in Redis", flush=True)
        for _ in range(2000):
            if len(chains) < 1000:
                chains.append([rng.getrandbits(64) for _ in range(blocks)])
                i = len(chains) - 1
            else:
                i = rng.randrange(len(chains))
            chain = chains[i]
            chain += [rng.getrandbits(64) for _ in range(52)]
            replica = REPLICAS[i % len(REPLICAS)]
            shared.publish(Sent(replica, list(chain), None, True))
            held = len(chain)
            chain += [rng.getrandbits(64) for _ in range(13)]
            shared.publish(Reply(replica, list(chain), held))
            if len(chain) > blocks * 1.25:
                chains[i] = [rng.getrandbits(64) for _ in range(blocks)]  # a new one
            published += 2
            # 1000 conversations, a turn every 8 s each: 125 turns a simulated second.
            sim[0] += 1 / 125
        await written(shared, published)
    seconds = time.perf_counter() - t0
    print(f"filled: {published} facts written ({shared.written_bytes / 2**20:.0f} MiB "
          f"counted), stream now {used / 2**20:.0f} MiB in Redis, "
          f"{await client.xlen('gateway:routing')} facts, {seconds:.0f} s; simulated "
          f"span {sim[0] - (time.time() - span):.0f} s", flush=True)
    await shared.aclose()
    await client.aclose()
    return published, seconds


async def restart(url: str, ktokens: int, max_bytes: int) -> dict[str, float]:
    await fill(url, ktokens, max_bytes)
    router = Router(RoutingConfig(seed=2))
    for name in REPLICAS:
        router.set_capacity(name, 1_000_000)
    shared = SharedState(RedisSettings(url=url, stream_max_bytes=max_bytes), router.apply,
                         ResponseAffinity(), time.time, instance="bench-b")
    t0 = time.perf_counter()
    await shared.start()
    ready = time.perf_counter() - t0
    caught_up = shared.caught_up
    applied_at_ready = shared.applied
    unresolved = shared._m_facts.labels("in", "unresolved")._value.get()
    await shared.aclose()
    return {"ready_s": ready, "caught_up_at_ready": caught_up,
            "applied_at_ready": applied_at_ready, "unresolved": unresolved,
            "blocks": sum(router.indexed_blocks(n) for n in REPLICAS)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["sizes", "restart"])
    ap.add_argument("--ktokens", type=int, nargs="*", default=None)
    ap.add_argument("--max-mib", type=int, default=RedisSettings().stream_max_bytes >> 20)
    args = ap.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 1
    port = free_port()
    redis = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}/0"
        if args.mode == "sizes":
            for k in args.ktokens or [8, 32, 100]:
                r = asyncio.run(sizes(url, k))
                print(f"{k:>4}k tokens: follow-up fact {r['follow_up_redis_bytes_per_fact']:.0f} "
                      f"B in Redis; first turn {r['first_turn_redis_bytes_per_fact']:.0f} B "
                      f"a fact; a whole fact's fields {r['whole_fact_fields_bytes']} B",
                      flush=True)
        else:
            for k in args.ktokens or [32]:
                r = asyncio.run(restart(url, k, args.max_mib << 20))
                print(f"{k}k-token conversations, bound {args.max_mib} MiB: ready after "
                      f"{r['ready_s']:.2f} s (caught up: {r['caught_up_at_ready']}, "
                      f"{r['applied_at_ready']} facts applied, {r['unresolved']:.0f} deltas "
                      f"unresolved, {r['blocks']} blocks indexed)", flush=True)
    finally:
        redis.terminate()
        redis.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
