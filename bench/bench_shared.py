"""Shared routing state: how long a fact one instance publishes takes to be applied by
another, at 1,000 routing decisions a second.

    .venv/bin/python bench/bench_shared.py [--rate 1000] [--seconds 10] [--blocks 32]

Starts a real redis-server on a free loopback port. Instance A (this process) publishes,
per routing decision, what the router publishes for one request: a `Sent` fact with the
prompt's block hashes (`--blocks`, 32 = a 2 KB prompt) and, when the answer is in, a
`Reply` with the reply's blocks, through `SharedState.publish` at `--rate` decisions a
second, paced against the clock. Instance B, a separate process with its own event loop,
runs its own `SharedState` and applies every fact to a real `Router` (the index, sessions
and conversations of a 4-replica fleet); it records publish-to-applied delay per fact from
the fact's own publish time (one host, one clock). Reported: facts applied, p50/p90/p99/max
delay, and how far A's publishing fell behind its schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.routing.affinity import ResponseAffinity  # noqa: E402
from gateway.routing.config import RoutingConfig  # noqa: E402
from gateway.routing.facts import Fact, Reply, Sent  # noqa: E402
from gateway.routing.router import Router  # noqa: E402
from gateway.shared.config import RedisSettings  # noqa: E402
from gateway.shared.redis_state import SharedState  # noqa: E402

REPLICAS = ["r0", "r1", "r2", "r3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def receiver(url: str, expected: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    delays: list[float] = []

    async def main() -> None:
        router = Router(RoutingConfig(seed=1))
        for name in REPLICAS:
            router.add_replica(name)

        def apply(fact: Fact, now: float) -> None:
            router.apply(fact, now)

        shared = SharedState(RedisSettings(url=url), apply, ResponseAffinity(), time.time,
                             instance="B")
        original = shared._receive

        def timed(fields: dict[bytes, bytes]) -> None:
            original(fields)
            at = float(fields[b"a"])
            delays.append(time.time() - at)

        shared._receive = timed  # type: ignore[method-assign]
        await shared.start()
        out.put("ready")
        deadline = time.monotonic() + seconds + 10
        # The reader task fills `delays`; a poll every 50 ms bounds this wait simply.
        while len(delays) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await shared.aclose()

    asyncio.run(main())
    out.put(delays)


async def publisher(url: str, rate: float, seconds: float, blocks: int) -> tuple[int, float]:
    shared = SharedState(RedisSettings(url=url), lambda f, n: None, ResponseAffinity(),
                         time.time, instance="A")
    await shared.start()
    rng = random.Random(0)
    n = int(rate * seconds)
    start = time.perf_counter()
    worst_lag = 0.0
    for i in range(n):
        due = start + i / rate
        lag = time.perf_counter() - due
        if lag < 0:
            await asyncio.sleep(-lag)
        else:
            worst_lag = max(worst_lag, lag)
            if i % 50 == 0:
                await asyncio.sleep(0)  # let the writer run
        replica = REPLICAS[i % len(REPLICAS)]
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        shared.publish(Sent(replica, hashes, f"s{i % 500}"))
        shared.publish(Reply(replica, [*hashes, rng.getrandbits(64)], blocks))
    await asyncio.sleep(1.0)  # let the writer flush
    await shared.aclose()
    return 2 * n, worst_lag


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="routing decisions a second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--blocks", type=int, default=32, help="prompt blocks per decision")
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
        expected = 2 * int(args.rate * args.seconds)
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        child = ctx.Process(target=receiver, args=(url, expected, args.seconds, out))
        child.start()
        assert out.get(timeout=60) == "ready"
        sent, lag = asyncio.run(publisher(url, args.rate, args.seconds, args.blocks))
        delays: list[float] = out.get(timeout=args.seconds + 60)
        child.join(timeout=30)
    finally:
        redis.terminate()
        redis.wait(timeout=10)
    ms = [d * 1000 for d in delays]
    print(f"decisions/s {args.rate:g} for {args.seconds:g} s, {args.blocks} blocks each: "
          f"{sent} facts published, {len(ms)} applied by the other instance")
    print(f"delay ms: p50 {statistics.median(ms):.2f}  p90 {pct(ms, 0.9):.2f}  "
          f"p99 {pct(ms, 0.99):.2f}  max {max(ms):.2f}   (publisher's worst lag behind its "
          f"schedule {lag * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
