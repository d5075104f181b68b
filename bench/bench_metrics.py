"""The Prometheus text both ways, the code before against prometheus_client, side by side:
the scraper parsing the `/metrics` text recorded from real vLLM 0.32 (667 lines,
tests/data/vllm032_metrics.txt), and the simulator rendering its own `/metrics`.

    mkdir -p /tmp/base && git archive main gateway | tar -x -C /tmp/base
    .venv/bin/python bench/bench_metrics.py --baseline /tmp/base [--rounds 5] [--loops 300]

Each round times `--loops` calls of each, interleaved (before, after); the report is the
median over rounds in microseconds per call. Before timing, both scrapers' snapshots are
checked equal on the recorded text (the field added since, the engine's start time, aside).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from gateway.replicas import scrape
from gateway.sim import metrics

TEXT = (Path(__file__).resolve().parent.parent / "tests" / "data"
        / "vllm032_metrics.txt").read_text()
GAUGES = metrics.Gauges(running=3, waiting=1, kv_usage=0.4, num_gpu_blocks=2048, block_size=16)


def load(root: Path, relative: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, root / relative)
    if spec is None or spec.loader is None:
        sys.exit(f"no module at {root / relative}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def per_call_us(call: Callable[[], object], loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        call()
    return (time.perf_counter() - start) / loops * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True,
                    help="a tree holding the code before (git archive REV gateway)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", type=int, default=300)
    args = ap.parse_args()
    old_scrape = load(args.baseline, "gateway/replicas/scrape.py", "baseline_scrape")
    old_metrics = load(args.baseline, "gateway/sim/metrics.py", "baseline_metrics")
    before_snap = old_scrape.parse_engine_metrics(TEXT, 1.0)
    after_snap = scrape.parse_engine_metrics(TEXT, 1.0)
    assert dataclasses.astuple(before_snap)[:-1] == dataclasses.astuple(after_snap)[:-1]
    old_engine, new_engine = old_metrics.EngineMetrics(16384), metrics.EngineMetrics(16384)
    cases = {
        "scrape: parse real vLLM /metrics": (
            lambda: old_scrape.parse_engine_metrics(TEXT, 1.0),
            lambda: scrape.parse_engine_metrics(TEXT, 1.0)),
        "sim: render /metrics": (
            lambda: old_engine.render("sim", GAUGES), lambda: new_engine.render("sim", GAUGES)),
    }
    print(f"{'':<36} {'before us':>10} {'after us':>10} {'ratio':>6}")
    for label, (before_call, after_call) in cases.items():
        before, after = [], []
        for _ in range(args.rounds):
            before.append(per_call_us(before_call, args.loops))
            after.append(per_call_us(after_call, args.loops))
        b, a = statistics.median(before), statistics.median(after)
        print(f"{label:<36} {b:>10.0f} {a:>10.0f} {a / b:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
