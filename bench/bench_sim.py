"""Throughput of `gateway sim`: one simulator process, N replicas, many clients.

Starts `gateway sim` as a subprocess on 127.0.0.1 (4 replicas, high --speed so the engine's
simulated time is negligible and the run is CPU-bound), then drives it from this process
with aiohttp: a fixed concurrency of workers send chat completions with ~2 KB prompts
(distinct per request, sharing the system block) round-robin over the replicas, for a bounded
time and count. Reports achieved requests/s and the simulator process's CPU per request,
read from /proc/<pid>/stat (utime + stime) before and after the measured window.

    .venv/bin/python bench/bench_sim.py [--seconds 10] [--concurrency 64] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.sim.generator import WORDS  # noqa: E402
from tests.servers import free_ports, running, script  # noqa: E402


def prompt(i: int, size: int = 2048) -> str:
    words = []
    n = 0
    k = i * 7919
    while n < size:
        w = WORDS[k % len(WORDS)]
        k = k * 1103515245 + 12345 & 0x7FFFFFFF
        words.append(w)
        n += len(w) + 1
    return f"Request {i}: " + " ".join(words)[: size - 16]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    urls: list[str], seconds: float, concurrency: int, max_tokens: int, stream: bool, pid: int
) -> dict[str, float]:
    count = 0
    errors = 0
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> None:
            nonlocal count, errors
            body = {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt(i)}],
                "stream": stream,
            }
            t0 = time.perf_counter()
            async with session.post(urls[i % len(urls)] + "/v1/chat/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
            latencies.append(time.perf_counter() - t0)
            count += 1

        # Warm-up: connections and memo.
        await asyncio.gather(*(one(i) for i in range(concurrency)))
        count = 0
        latencies.clear()
        deadline = time.perf_counter() + seconds
        next_id = 1000

        async def worker() -> None:
            nonlocal next_id
            while time.perf_counter() < deadline and next_id < 1_000_000:
                next_id += 1
                await one(next_id)

        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(pid) - cpu0
    return {
        "requests": count,
        "errors": errors,
        "seconds": elapsed,
        "rps": count / elapsed,
        "cpu_ms_per_req": cpu / max(count, 1) * 1000,
        "sim_cpu_util": cpu / elapsed,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--speed", type=float, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_ports(args.replicas)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(args.replicas)]
    argv = [
        *script("gateway"),
        "sim",
        "--replicas",
        str(args.replicas),
        "--port",
        str(port),
        "--speed",
        str(args.speed),
        "--kv-blocks",
        "16384",
        "--log-interval",
        "3600",
    ]
    print(f"sim: {' '.join(argv[1:])}")
    with running(argv, [u + "/health" for u in urls]) as proc:
        for stream in (False, True):
            results = [
                asyncio.run(
                    drive(urls, args.seconds, args.concurrency, args.max_tokens, stream, proc.pid)
                )
                for _ in range(args.rounds)
            ]
            rps = statistics.median(r["rps"] for r in results)
            cpu = statistics.median(r["cpu_ms_per_req"] for r in results)
            util = statistics.median(r["sim_cpu_util"] for r in results)
            p50 = statistics.median(r["p50_ms"] for r in results)
            errs = sum(r["errors"] for r in results)
            print(
                f"stream={stream!s:5} max_tokens={args.max_tokens} c={args.concurrency}: "
                f"median {rps:.0f} req/s, sim CPU {cpu:.2f} ms/req (util {util:.2f}), "
                f"p50 latency {p50:.1f} ms, errors {errs}, rounds "
                f"{[round(r['rps']) for r in results]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
