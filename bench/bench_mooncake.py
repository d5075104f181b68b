"""The Mooncake conversation trace replayed without session ids, per routing policy.

    .venv/bin/python bench/bench_mooncake.py [--minutes 3] [--replicas 4]
        [--kv-blocks 40000] [--speedup 4] [--policies prefix,round_robin,least_loaded]
        [--env KEY=VALUE ...] [--out bench-out/mooncake]

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


def run_policy(args: argparse.Namespace, policy: str,
               requests: list[TraceRequest]) -> dict[str, Any]:
    out: Path = args.out
    logs = out / "logs"
    port = free_ports(args.replicas)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(args.replicas)]
    usage_log = logs / f"usage-{policy}.jsonl"
    usage_log.parent.mkdir(parents=True, exist_ok=True)
    usage_log.unlink(missing_ok=True)
    env = dict(kv.split("=", 1) for kv in args.env)
    sim = gateway_command(
        "sim", "--replicas", str(args.replicas), "--port", str(port), "--model", MODEL,
        "--kv-blocks", str(args.kv_blocks), "--block-size", str(BLOCK),
        "--max-model-len", "131072", "--speed", str(args.speedup), "--seed", "0",
        "--timing-comments",
    )
    with Managed(sim, [u + "/health" for u in urls], logs / f"sim-{policy}.log"):
        gw_port = free_ports(1)
        gw = f"http://127.0.0.1:{gw_port}"
        backends = [a for u in urls for a in ("--backend", u)]
        with Managed(
            gateway_command("serve", "--host", "127.0.0.1", "--port", str(gw_port),
                            "--policy", policy, *backends),
            [gw + "/ready"], logs / f"gateway-{policy}.log",
            env={"GATEWAY_USAGE__LOG_PATH": str(usage_log), **env},
        ):
            result = asyncio.run(replay(requests, ReplayOptions(
                base_url=gw, model=MODEL, speedup=args.speedup, max_tokens_cap=64,
                max_in_flight=64, max_wall_s=args.max_wall_s, progress=False,
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
        "policy": policy,
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
    (out / f"mooncake-{policy}.json").write_bytes(orjson.dumps(row, option=orjson.OPT_INDENT_2))
    return row


def fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | cached ratio | bound | LRU reference | share of bound | "
             "share of reference | TTFT p50 / p99 ms | requests max/mean | moves |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        imb = (r["replica_requests"] or {}).get("max_over_mean")
        lines.append(
            f"| {r['policy']} | {fmt(r['cached_ratio'], True)} | {fmt(r['bound_ratio'], True)} "
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
    p.add_argument("--policies", default="prefix,round_robin,least_loaded")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateways")
    p.add_argument("--max-wall-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench-out/mooncake"))
    args = p.parse_args(argv)
    if any("=" not in kv or not kv.startswith("GATEWAY_") for kv in args.env):
        p.error("--env takes GATEWAY_KEY=VALUE")
    with open(args.trace, "rb") as f:
        requests = select(parse_trace(f), minutes=args.minutes)
    rows = [run_policy(args, policy.strip(), requests)
            for policy in args.policies.split(",") if policy.strip()]
    print(table(rows))
    return 0 if all(r["errors"] < r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
