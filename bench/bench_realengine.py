"""Prefix affinity vs round-robin on a REAL engine: llama.cpp replicas (xllamacpp) behind
`gateway serve`, a multi-session chat workload, cached-token ratio as llama.cpp reports it.

For each repetition and each policy, fresh replicas are started (empty caches), the gateway
is configured by TOML (`[[replicas]] capacity_tokens` = slots x context per slot, since
llama.cpp reports no capacity), and the same seeded workload is played with streaming
(`include_usage`) so TTFT is measured at the client. Policies run side by side inside each
repetition; medians over repetitions are printed.

    .venv/bin/python bench/bench_realengine.py                 # 2 replicas, medium model
    .venv/bin/python bench/bench_realengine.py --concurrency 1 # sequential sessions
    .venv/bin/python bench/bench_realengine.py --replicas 3 --sessions 9 --concurrency 9
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.realengine.engine import EngineOptions, llama_replicas  # noqa: E402
from tests.realengine.fleet import fronted  # noqa: E402
from tests.realengine.model import MEDIUM, TINY, ensure_model  # noqa: E402
from tests.realengine.workload import SessionPlan, Summary, run_sessions  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "medium"], default="medium")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--cache-ram-mib", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--concurrency", type=int, default=6, help="requests of a round in flight together"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--policies", default="prefix,round_robin")
    return ap.parse_args(argv)


def _row(policy: str, runs: list[Summary]) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    ttft = [s.ttft_p50_ms() or 0.0 for s in runs]
    cold = [
        statistics.median([r.ttft_s or 0.0 for r in s.results if r.turn == 0]) * 1000 for s in runs
    ]
    warm = [
        statistics.median([r.ttft_s or 0.0 for r in s.results if r.turn > 0]) * 1000 for s in runs
    ]
    spread = [statistics.mean(len(v) for v in s.replicas_per_session().values()) for s in runs]
    return (
        f"| {policy} | {med([s.cached_ratio for s in runs]):.3f} "
        f"| {med([s.warm_ratio() for s in runs]):.3f} "
        f"| {med(ttft):.1f} | {med(cold):.1f} | {med(warm):.1f} | {med(spread):.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    spec = MEDIUM if args.model == "medium" else TINY
    options = EngineOptions(
        model_path=ensure_model(spec, ROOT / "build" / "realengine"),
        slots=args.slots, ctx_per_slot=args.ctx_per_slot, cache_ram_mib=args.cache_ram_mib,
    )  # fmt: skip
    plan = SessionPlan(
        sessions=args.sessions, turns=args.turns, prefix_words=args.prefix_words,
        max_tokens=args.max_tokens, seed=args.seed, concurrency=args.concurrency, stream=True,
    )  # fmt: skip
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs: dict[str, list[Summary]] = {p: [] for p in policies}
    t0 = time.perf_counter()
    for rep in range(args.repeat):
        for policy in policies:
            with (
                llama_replicas(options, args.replicas) as urls,
                fronted(urls, policy=policy, capacity_tokens=options.capacity_tokens) as gw,
            ):
                summary = asyncio.run(run_sessions(gw + "/v1", plan))
            runs[policy].append(summary)
            print(f"# rep {rep} {policy}: ratio {summary.cached_ratio:.3f}", file=sys.stderr)
    print(
        f"llama.cpp x{args.replicas} ({args.model} model, {args.slots} slots, "
        f"cache_ram_mib={args.cache_ram_mib}), {args.sessions} sessions x {args.turns} turns, "
        f"~{args.prefix_words}-word prefixes, concurrency {args.concurrency}, "
        f"median of {args.repeat} ({time.perf_counter() - t0:.0f} s)"
    )
    print()
    print("| policy | cached ratio | warm-turn ratio | TTFT p50 ms | cold TTFT p50 | "
          "warm TTFT p50 | replicas/session |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for policy in policies:
        print(_row(policy, runs[policy]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
