"""`HygieneAnalyzer.scan` per request on growing agent conversations (bench_peers' `grow`
cases, without the proxy): 32 conversations under a shared 2 KiB system prompt, each turn
the previous prompt plus its answer and a new ~10 KiB user tail of prose with numbers, up
to `--size` KiB; every body is decoded fresh (orjson) before its scan, as the proxy does.

    .venv/bin/python bench/bench_hygiene_grow.py [--baseline REF] [--rounds N] [--session]

With `--baseline REF` the hygiene package at REF runs beside the working tree's, the two
alternating round by round; the figure is the median over rounds of the mean scan time
per request (CPU time, `time.process_time`), over all requests and over the last turn's,
and the findings of both must be equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import orjson
from bench_hygiene import Factory, load_baseline
from peers_load import KIB, conversations
from proxy_servers import sized_completion

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig

NOW = 1717250602.0
CONVERSATIONS = 32  # peers_load.conversations


def bodies(size_kib: int, turns: int, salt: int) -> list[bytes]:
    """Every request of the conversations, turn t of each before turn t + 1."""
    feeds = conversations(size_kib * KIB, turns, salt)
    answers: list[bytes | None] = [None] * len(feeds)
    out: list[bytes] = []
    while True:
        sent = 0
        for i, f in enumerate(feeds):
            b = f.next(answers[i])
            if b is None:
                continue
            out.append(b)
            answers[i] = sized_completion(b)
            sent += 1
        if not sent:
            return out


def one_round(make: Factory, reqs: list[bytes],
              session: bool) -> tuple[float, float, list[Any]]:
    """(ms per request over all turns, ms per request of the last turn, the findings)."""
    a = make()
    cpu = last = 0.0
    found: list[Any] = []
    for i, raw in enumerate(reqs):
        body = orjson.loads(raw)
        s = f"s{i % CONVERSATIONS}" if session else None
        t0 = time.process_time()
        f = a.scan(body, "chat", s, NOW, validated=True)
        dt = time.process_time() - t0
        cpu += dt
        if i >= len(reqs) - CONVERSATIONS:
            last += dt
        found.append([(x.kind, x.severity, x.message_index, x.char_offset) for x in f])
    return cpu / len(reqs) * 1e3, last / CONVERSATIONS * 1e3, found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=256, help="KiB at the last turn")
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--session", action="store_true", help="requests carry a session id")
    args = ap.parse_args()
    impls: dict[str, Factory] = {}
    if args.baseline:
        impls["before"] = load_baseline(args.baseline)
    impls["after" if args.baseline else "now"] = lambda: HygieneAnalyzer(HygieneConfig())
    reqs = bodies(args.size, args.turns, 10)
    ms: dict[str, list[float]] = {k: [] for k in impls}
    tail: dict[str, list[float]] = {k: [] for k in impls}
    for r in range(args.rounds):
        results = {}
        for name in (list(impls) if r % 2 == 0 else list(reversed(impls))):
            every, last, results[name] = one_round(impls[name], reqs, args.session)
            ms[name].append(every)
            tail[name].append(last)
        first = next(iter(results.values()))
        assert all(v == first for v in results.values()), "findings differ"
    for name, xs in ms.items():
        print(f"{name}: scan ms/req median {statistics.median(xs):.4f} over all "
              f"{len(reqs)} requests (rounds: {' '.join(f'{x:.4f}' for x in xs)}); "
              f"last turn {statistics.median(tail[name]):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
