"""Issue 36's bars on the agent preset in one command: the admission queue on against off,
both with default settings, at each `--loads` multiple, `--rounds` rounds a seed, with the
benchmark's own noise beside them.

    .venv/bin/python bench/bench_queue_bars.py [--loads 2,4] [--seeds 1,2,3] [--rounds 3]
        [--noise] [--keep DIR]

Each round is one `gateway-bench compare --preset agent-tools` run (fresh simulated
replicas per column, the columns one after another). Columns: `prefix@header` (queue off)
and `prefix+queue` (on); with `--noise`, also `prefix` and `prefix+queue@header`, the same
two configurations under other names: how far two identical columns run side by side
differ is the resolution of every other ratio here (on 2 noisy cores, up to 12% in p99
at 2x; bench/results/admission.md).

Prints one JSON line per run, then per load: each seed's medians over its rounds (cached
ratio, p99 time to first token, on/off), and the rounds of all seeds pooled (the median
on/off p99 ratio, how many rounds on's p99 was at most off's, and with `--noise` the
same ratio between the identical columns). Times are the simulator's (`timing: sim`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OFF, ON = "prefix@header", "prefix+queue"
OFF2, ON2 = "prefix", "prefix+queue@header"  # the same configurations, other names
Run = dict[str, dict[str, float]]  # column -> {"cached": ratio, "p99": ms}


def one_run(load: float, seed: int, columns: list[str], out: Path,
            max_wall_s: float) -> Run:
    """One compare run: each column's cached ratio and p99 TTFT (ms)."""
    argv = [sys.executable, "-m", "gateway.bench.entry", "compare", "--preset", "agent-tools",
            "--load", str(load), "--seed", str(seed), "--policies", ",".join(columns),
            "--no-progress", "--max-wall-s", str(max_wall_s), "--out", str(out)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=max_wall_s * 6)
    data = json.loads((out / "compare.json").read_text())
    got: Run = {}
    for column in columns:
        s = data["policies"][column]
        if s["errors"]:
            raise SystemExit(f"{column}: {s['errors']} requests failed (load {load}, "
                             f"seed {seed}); see {out}")
        got[column] = {"cached": s["cached_ratio"], "p99": s["ttft_ms"]["p99"]}
    return got


def med(runs: list[Run], column: str, key: str) -> float:
    return statistics.median(r[column][key] for r in runs)


def pooled(runs: list[Run], noise: bool) -> dict[str, float]:
    """The rounds of all seeds together: on/off p99 ratio (median, min, max), rounds where
    on's p99 was at most off's, cached on - off (median, points of ratio); with `noise`,
    the identical columns' p99 ratios (median, min, max) and on/off from the second pair."""
    ratios = [r[ON]["p99"] / r[OFF]["p99"] for r in runs]
    got = {"rounds": len(runs), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
           "ratio_max": max(ratios), "on_le_off": sum(x <= 1 for x in ratios),
           "cached_diff": statistics.median(r[ON]["cached"] - r[OFF]["cached"] for r in runs)}
    if noise:
        same = ([r[OFF2]["p99"] / r[OFF]["p99"] for r in runs]
                + [r[ON2]["p99"] / r[ON]["p99"] for r in runs])
        got |= {"noise": statistics.median(same), "noise_min": min(same),
                "noise_max": max(same),
                "ratio2": statistics.median(r[ON2]["p99"] / r[OFF2]["p99"] for r in runs)}
    return got


def report(load: float, by_seed: dict[int, list[Run]], noise: bool) -> None:
    print(f"\n## load {load:g}x\n")
    print("| seed | rounds | cached off | cached on | p99 off ms | p99 on ms | on/off |")
    print("|---|---|---|---|---|---|---|")
    for seed, runs in by_seed.items():
        off, on = med(runs, OFF, "p99"), med(runs, ON, "p99")
        print(f"| {seed} | {len(runs)} | {med(runs, OFF, 'cached'):.1%} | "
              f"{med(runs, ON, 'cached'):.1%} | {off:.0f} | {on:.0f} | {on / off:.2f} |")
    p = pooled([r for rs in by_seed.values() for r in rs], noise)
    print(f"\npooled, {p['rounds']:g} rounds: on/off p99 median {p['ratio']:.2f} (range "
          f"{p['ratio_min']:.2f}-{p['ratio_max']:.2f}); on's p99 <= off's in "
          f"{p['on_le_off']:g}; cached on - off median {p['cached_diff'] * 100:+.1f} points")
    if noise:
        print(f"identical columns (noise): p99 ratio median {p['noise']:.2f} (range "
              f"{p['noise_min']:.2f}-{p['noise_max']:.2f}); on/off from the second pair: "
              f"median {p['ratio2']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="2,4")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--noise", action="store_true",
                    help="also run each configuration again under another name")
    ap.add_argument("--max-wall-s", type=float, default=150.0)
    ap.add_argument("--keep", type=Path, help="keep each run's output here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    columns = [OFF, ON, OFF2, ON2] if args.noise else [OFF, ON]
    loads = [float(x) for x in args.loads.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        results: dict[float, dict[int, list[Run]]] = {}
        # rounds outermost: a slow spell of the machine falls on every seed, not one
        for rnd in range(args.rounds):
            for load in loads:
                for seed in seeds:
                    out = root / f"load{load:g}-seed{seed}-round{rnd}"
                    got = one_run(load, seed, columns, out, args.max_wall_s)
                    results.setdefault(load, {}).setdefault(seed, []).append(got)
                    print(json.dumps({"load": load, "seed": seed, "round": rnd, **got}),
                          flush=True)
        for load in loads:
            report(load, results[load], args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
