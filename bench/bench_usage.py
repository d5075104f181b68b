"""CPU cost per request of usage accounting: `UsageRecorder.record` (metrics + stats
windows + encoding + sink hand-off) with the file sink on, including the sink's drain and
write to disk (process CPU time covers the writer thread too).

    .venv/bin/python bench/bench_usage.py [--records 100000] [--runs 5]

Prints the median over runs of CPU microseconds per record for the whole path and, side
by side in the same run, for its parts. Target: <= 30 us per request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.usage.config import UsageConfig
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.record import UsageRecord
from gateway.usage.recorder import UsageRecorder
from gateway.usage.stats import UsageWindows


def make_records(n: int, seed: int = 1) -> list[UsageRecord]:
    rng = random.Random(seed)
    t0 = 1_700_000_000.0
    out = []
    for i in range(n):
        prompt = rng.randint(200, 30_000)
        out.append(
            UsageRecord(
                ts=t0 + i * 0.01, request_id=f"req-{i}", tenant=rng.choice(["a", "b", "c", None]),
                model=rng.choice(["llama-8b", "qwen-7b"]), replica=f"r{rng.randrange(4)}",
                route=rng.choice(["prefix", "load", "session", "cold"]), stream=rng.random() < 0.7,
                status=rng.choice([200] * 18 + [499, 502]), prompt_tokens=prompt,
                cached_tokens=rng.choice([0, prompt // 2, prompt - 16, None]),
                predicted_cached_tokens=prompt // 2, best_available_tokens=prompt - 16,
                completion_tokens=rng.randint(1, 500), ttft_ms=rng.uniform(10, 2000),
                latency_ms=rng.uniform(2000, 20_000), session=f"s{rng.randrange(200)}",
                hygiene=rng.randrange(3),
            )
        )  # fmt: skip
    return out


def _each(fn: Callable[[UsageRecord], None], records: list[UsageRecord]) -> None:
    for r in records:
        fn(r)


def cpu_us(fn: Callable[[], None], n: int) -> float:
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) / n * 1e6


async def full_path(records: list[UsageRecord], log_path: str) -> float:
    # The loop below offers records far faster than any request rate; a queue that holds
    # them all keeps the figure about CPU, not about drops.
    cfg = UsageConfig(log_path=log_path, queue_size=len(records))
    recorder = UsageRecorder(cfg, GatewayMetrics())
    await recorder.start()
    t0 = time.process_time()
    for i, rec in enumerate(records):
        recorder.record(rec)
        if i % 256 == 255:
            await asyncio.sleep(0)  # let the drain task run, as between requests
    await recorder.aclose()  # everything written and flushed
    us = (time.process_time() - t0) / len(records) * 1e6
    assert recorder.pumps[0].written == len(records), "records were dropped"
    return us


def main() -> None:
    logging.getLogger("gateway.usage").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    records = make_records(args.records)
    n = len(records)
    results: dict[str, list[float]] = {"record() total, file sink": [], "metrics.observe": [],
                                       "windows.add": [], "no sinks record()": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        for run in range(args.runs):
            path = str(Path(d) / f"usage-{run}.jsonl")
            results["record() total, file sink"].append(asyncio.run(full_path(records, path)))
            m = GatewayMetrics()
            results["metrics.observe"].append(cpu_us(lambda m=m: _each(m.observe, records), n))
            w = UsageWindows()
            results["windows.add"].append(cpu_us(lambda w=w: _each(w.add, records), n))
            bare = UsageRecorder(UsageConfig(), GatewayMetrics())
            results["no sinks record()"].append(
                cpu_us(lambda b=bare: _each(b.record, records), n)
            )
    print(f"{n} records x {args.runs} runs, CPU microseconds per record (median [min..max])")
    for name, values in results.items():
        med, lo, hi = statistics.median(values), min(values), max(values)
        print(f"  {name:28s} {med:6.2f}  [{lo:.2f}..{hi:.2f}]")


if __name__ == "__main__":
    main()
