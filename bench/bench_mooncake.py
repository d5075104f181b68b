"""The Mooncake conversation trace replayed without session ids, per routing policy.

    .venv/bin/python bench/bench_mooncake.py [--minutes 3] [--replicas 4]
        [--kv-blocks 40000] [--speedup 4] [--policies prefix,round_robin,least_loaded]
        [--loads 1] [--env KEY=VALUE ...] [--out bench-out/mooncake]

    # queue off vs on at 0.5x, 1x, 2x and 4x of the trace's own rate
    .venv/bin/python bench/bench_mooncake.py --policies prefix,prefix+queue \
        --loads 0.5,1,2,4 --minutes 3

For each policy, from cold: `gateway sim` (N replicas of `--kv-blocks` 16-token blocks,
its clock `--speedup` times real time so the engine keeps pace with the compressed trace)
behind `gateway serve --policy P`; the trace's first `--minutes` replayed at `--speedup`
with no session id (the trace has none: it is what most applications send). Afterwards
every recorded prompt (and prompt + reply) is tokenized on a replica, and the cached tokens
the engine reported are set against

- the bound: one infinite cache shared by all replicas (the most any routing could get);
- the finite-cache reference: one LRU cache holding the fleet's combined capacity
  (replicas x kv-blocks), what the fleet could get if it behaved as one cache.

so `share of reference` says how much of what finite caches allow the router captured.
`--env` passes GATEWAY_* settings to the gateways (e.g. GATEWAY_ROUTING__FEEDBACK=false).

**Load** (`--loads`, multipliers of "1x"): the simulated engines keep the clock of
`--speedup` (their speed against real time), and the trace is replayed `load` times
faster than that clock: 1x is the trace's own arrival rate on the engines' clock, the
rate its recorded fleet served it at; 2x sends its requests twice as fast into the same
engines. (At `--speedup 4` and `--kv-blocks 40000` on 4 replicas, 1x is absorbed: TTFT
p50 stays near an unqueued prefill and the replay ends with the trace; bench/results/
admission.md, 2026-11-26, has the figures.) A policy named `P+queue` runs `P` with the
admission queue on (`[admission] enabled`), its waits scaled to the simulated clock
(`1 / --speedup`) so they mean the same engine time, every other setting its default;
`P` alone runs it with the queue off.
One JSON file per run in --out; a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.analysis import read_usage_log
from gateway.bench.bound import compute_bound, compute_lru_reference
from gateway.bench.compare import queued, scaled_signals, scaled_waits
from gateway.bench.prefill import engine_tokens
from gateway.bench.procs import Managed, free_ports, gateway_command
from gateway.bench.replay import ReplayOptions, replay
from gateway.bench.report import follow_ups_moved, shares, summarize
from gateway.bench.trace import TraceRequest, parse_trace, select

# ../shared/traces next to the checkout (a worktree sits one folder deeper)
_ROOT = Path(__file__).resolve().parents[1]
TRACE = next((d / "shared" / "traces" / "mooncake_conversation.jsonl"
              for d in (_ROOT.parent, _ROOT.parent.parent)
              if (d / "shared" / "traces").is_dir()),
             _ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl")
MODEL = "sim-model"
BLOCK = 16


def column_env(column: str, speedup: float) -> tuple[str, dict[str, str]]:
    """The routing policy a column names and the settings its gateway gets for the queue:
    `prefix+queue` is `prefix` with the queue on, its waits in the engines' time, and
    every other column pins it off, whatever the default; every column reads the
    engines' /metrics as often in their time as a user's gateway does."""
    policy = column.partition("+")[0]
    signals = scaled_signals(1.0 / speedup)
    if not queued(column):
        return policy, {**signals, "GATEWAY_ADMISSION__ENABLED": "false"}
    return policy, {**signals, "GATEWAY_ADMISSION__ENABLED": "true",
                    **scaled_waits(1.0 / speedup)}


def parse_loads(text: str) -> list[float]:
    """`--loads`: comma-separated positive multipliers of the trace's own rate."""
    loads = [float(x) for x in text.split(",") if x.strip()]
    if not loads or any(not x > 0 for x in loads):
        raise ValueError(f"--loads takes positive numbers, got {text!r}")
    return loads


def run_policy(args: argparse.Namespace, column: str, requests: list[TraceRequest],
               load: float = 1.0) -> dict[str, Any]:
    out: Path = args.out
    logs = out / "logs"
    port = free_ports(args.replicas)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(args.replicas)]
    tag = f"{column}-x{load:g}"
    usage_log = logs / f"usage-{tag}.jsonl"
    usage_log.parent.mkdir(parents=True, exist_ok=True)
    usage_log.unlink(missing_ok=True)
    policy, queue_env = column_env(column, args.speedup)
    env = {**queue_env, **dict(kv.split("=", 1) for kv in args.env)}
    sim = gateway_command(
        "sim", "--replicas", str(args.replicas), "--port", str(port), "--model", MODEL,
        "--kv-blocks", str(args.kv_blocks), "--block-size", str(BLOCK),
        "--max-model-len", "131072", "--speed", str(args.speedup), "--seed", "0",
        "--timing-comments",
    )
    with Managed(sim, [u + "/health" for u in urls], logs / f"sim-{tag}.log"):
        gw_port = free_ports(1)
        gw = f"http://127.0.0.1:{gw_port}"
        backends = [a for u in urls for a in ("--backend", u)]
        with Managed(
            gateway_command("serve", "--host", "127.0.0.1", "--port", str(gw_port),
                            "--policy", policy, *backends),
            [gw + "/ready"], logs / f"gateway-{tag}.log",
            env={"GATEWAY_USAGE__LOG_PATH": str(usage_log), **env},
        ):
            result = asyncio.run(replay(requests, ReplayOptions(
                base_url=gw, model=MODEL, speedup=args.speedup * load, max_tokens_cap=64,
                max_in_flight=args.max_in_flight, max_wall_s=args.max_wall_s,
                progress=False,
            )))
        order = sorted(
            (i for i, r in enumerate(result.records) if r.error is None and r.prompt_tokens),
            key=lambda i: result.records[i].send_s,
        )
        inputs = asyncio.run(engine_tokens(
            urls[0], [result.bodies[i] for i in order], [result.replies[i] for i in order]))
    summary = summarize(result.records, result.wall_s, args.replicas)
    bound = compute_bound(inputs, BLOCK)
    reference = compute_lru_reference(inputs, args.replicas * args.kv_blocks, BLOCK)
    usage = read_usage_log(usage_log)
    moved = [u.get("moved") for u in usage if u.get("moved")]
    cached = summary["cached_tokens"]
    row = {
        "policy": column,
        "load": load,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "prompt_tokens": summary["prompt_tokens"],
        "cached_tokens": cached,
        "cached_ratio": summary["cached_ratio"],
        "bound_ratio": bound.ratio,
        "reference_ratio": reference.ratio,
        "share_of_bound": cached / bound.cached_tokens if bound.cached_tokens else None,
        "share_of_reference": (cached / reference.cached_tokens
                               if reference.cached_tokens else None),
        "reference_of_bound": (reference.cached_tokens / bound.cached_tokens
                               if bound.cached_tokens else None),
        "ttft_ms": summary["ttft_ms"],
        "replica_requests": summary["replica_requests"],
        "replica_prompt_tokens": summary["replica_prompt_tokens"],
        "moves": {m: moved.count(m) for m in sorted(set(moved))},
        "routes": shares({r: float(sum(1 for u in usage if u.get("route") == r))
                          for r in {str(u.get("route")) for u in usage}})["per_replica"],
        "follow_ups_moved": follow_ups_moved(result.records),
        "wall_s": result.wall_s,
        "unfinished": result.unfinished_sessions,
    }
    (out / f"mooncake-{tag}.json").write_bytes(orjson.dumps(row, option=orjson.OPT_INDENT_2))
    return row


def fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| load | policy | cached ratio | bound | LRU reference | share of bound | "
             "share of reference | TTFT p50 / p99 ms | requests max/mean | moves |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        imb = (r["replica_requests"] or {}).get("max_over_mean")
        lines.append(
            f"| {r.get('load', 1.0):g}x | {r['policy']} | {fmt(r['cached_ratio'], True)} "
            f"| {fmt(r['bound_ratio'], True)} "
            f"| {fmt(r['reference_ratio'], True)} | {fmt(r['share_of_bound'], True)} "
            f"| {fmt(r['share_of_reference'], True)} "
            f"| {fmt(r['ttft_ms']['p50'])} / {fmt(r['ttft_ms']['p99'])} "
            f"| {'-' if imb is None else f'{imb:.2f}'} | {r['moves'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=40_000)
    p.add_argument("--speedup", type=float, default=4.0)
    p.add_argument("--policies", default="prefix,round_robin,least_loaded",
                   help="routing policies; P+queue: P with the admission queue on")
    p.add_argument("--loads", default="1",
                   help="multipliers of the trace's own rate on the engines' clock")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateways")
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="requests the replay client has open at once")
    p.add_argument("--max-wall-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/mooncake"))
    args = p.parse_args(argv)
    if any("=" not in kv or not kv.startswith("GATEWAY_") for kv in args.env):
        p.error("--env takes GATEWAY_KEY=VALUE")
    try:
        loads = parse_loads(args.loads)
    except ValueError as exc:
        p.error(str(exc))
    with open(args.trace, "rb") as f:
        requests = select(parse_trace(f), minutes=args.minutes)
    # side by side: every column at one load before the next load
    rows = [run_policy(args, policy.strip(), requests, load) for load in loads
            for policy in args.policies.split(",") if policy.strip()]
    print(table(rows))
    return 0 if all(r["errors"] < r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
