"""The `gateway-bench` command: `run`, `replay` and `compare`.

- `run`: replay agent sessions (a preset, flags override its workload) against any
  OpenAI-compatible base URL; summary table, JSON, charts.
- `replay TRACE`: a Mooncake trace slice against a base URL, next to the trace's bound.
- `compare`: start the simulator and one gateway per policy, same workload, one table;
  with `--backend URL` (repeatable) the policies run against those replicas (real vLLM),
  their prefix caches reset between policies.

Before a workload runs, the server is probed (`gateway.bench.server`): prompts stay within
the model's `max_model_len`, tools are sent with `tool_choice: "none"` when the server
refuses "auto" (the notice names the vLLM flags to add), and failed requests are summed up
by reason at the end.

Exit status: 0 when the run produced results, 1 when every request failed or a process
could not start, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.bench import explain
from gateway.bench.analysis import analyse
from gateway.bench.compare import (
    CompareOptions,
    DirtyCacheError,
    compare,
    default_columns,
    pd_column,
    split_column,
)
from gateway.bench.failures import format_reasons
from gateway.bench.flags import POLICIES, command_line, preset_of
from gateway.bench.pdfleet import pd_default_column
from gateway.bench.presets import BLOCK_SIZE
from gateway.bench.replay import ReplayOptions, replay
from gateway.bench.runner import RunOptions, RunResult, run_workload
from gateway.bench.server import probe
from gateway.bench.session import ServerLimits, sample_body
from gateway.bench.table import summary_table, turn_table
from gateway.bench.trace import TraceError, parse_trace, select, trace_bound
from gateway.bench.workload import build_workload


def build_parser() -> argparse.ArgumentParser:
    """The command line (flags.py), with this module's docstring as its help."""
    return command_line(__doc__)


_UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, IndexError,
                TypeError)


def unreachable(url: str, exc: BaseException) -> str:
    """One line for a base URL that cannot be used: down, or not an OpenAI server."""
    if isinstance(exc, (aiohttp.ClientConnectionError, TimeoutError, OSError)):
        why = str(exc) or type(exc).__name__
        return f"cannot reach {url}: {why} (is the server running? the URL is its base, " \
               "e.g. http://127.0.0.1:8080)"
    return f"{url} does not answer like an OpenAI-compatible server ({type(exc).__name__}: " \
           f"{exc}); is this the right URL?"


async def _first_model(base_url: str) -> str:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(
        base_url.rstrip("/") + "/v1/models"
    ) as resp:
        data = orjson.loads(await resp.read())
    return str(data["data"][0]["id"])


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    return asyncio.run(_first_model(args.base_url))


def _write(out: Path, name: str, payload: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return path


def _failed(result: RunResult) -> bool:
    return not result.records or all(r.error is not None for r in result.records)


def cmd_run(args: argparse.Namespace) -> int:
    preset = preset_of(args)
    workload = build_workload(preset.workload)
    try:
        facts = asyncio.run(probe(args.base_url, args.model, [args.tokenize_url or args.base_url],
                                  sample=sample_body(workload),
                                  discover=args.tokenize_url is None))
    except _UNREACHABLE as e:
        print(f"gateway-bench run: {unreachable(args.base_url, e)}", file=sys.stderr)
        return 1
    for note in facts.notes:
        print(f"note: {note}")
    model = facts.model
    result = asyncio.run(
        run_workload(
            workload,
            RunOptions(
                base_url=args.base_url, model=model, concurrency=preset.concurrency,
                time_scale=args.time_scale, max_wall_s=args.max_wall_s,
                progress=not args.no_progress, api=args.api,
                session_ids=args.session_ids,
                limits=ServerLimits(max_model_len=facts.max_model_len,
                                    tool_choice=facts.tool_choice,
                                    chars_per_token=facts.chars_per_token),
            ),
        )
    )
    summary = analyse(result, tokenize_url=args.tokenize_url or facts.tokenize_url
                      or args.base_url, block_size=facts.block_size or BLOCK_SIZE)
    print(summary_table({"run": summary}))
    print(explain.PACING)
    if summary["timing"] != "sim":
        print("(latencies are wall-clock: the endpoint sent no simulator timing)")
    if "bound_error" in summary:
        print(f"(no bound: {summary['bound_error']}; pass --tokenize-url with a vLLM "
              "replica's URL: the bound needs its /tokenize)")
    if summary["error_reasons"]:
        print("failed requests:")
        for line in format_reasons(summary["error_reasons"]):
            print(line)
    print()
    print(turn_table(summary["turns"]))
    if _failed(result):
        print("no chart: every request failed")
    else:
        from gateway.bench.charts import turn_chart  # checked by main() before the run

        chart = turn_chart(summary["turns"], args.out / "turns.png", title=args.base_url)
        print(f"chart: {chart}")
    path = _write(args.out, "run.json", {
        "workload": asdict(preset.workload), "summary": summary,
        "records": [asdict(r) for r in result.records],
    })
    print(f"results: {path}")
    return 1 if _failed(result) else 0


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        with open(args.trace, "rb") as f:
            requests = select(parse_trace(f), minutes=args.minutes, limit=args.limit)
    except (OSError, TraceError) as e:
        print(f"gateway-bench replay: {e}", file=sys.stderr)
        return 2
    try:
        model = _model(args)
    except _UNREACHABLE as e:
        print(f"gateway-bench replay: {unreachable(args.base_url, e)}", file=sys.stderr)
        return 1
    result = asyncio.run(replay(requests, ReplayOptions(
        base_url=args.base_url, model=model, speedup=args.speedup,
        max_tokens_cap=args.max_tokens_cap, max_in_flight=args.max_in_flight,
        max_wall_s=args.max_wall_s, progress=not args.no_progress,
    )))
    summary = analyse(result)
    best, total = trace_bound(requests)
    summary["bound"] = {"ratio": best / total if total else None, "cached_tokens": best,
                        "prompt_tokens": total, "units": "trace tokens"}
    if summary["cached_ratio"] is not None and total and best:
        summary["bound_share"] = summary["cached_ratio"] / (best / total)
    summary.pop("turns", None)
    print(summary_table({"replay": summary}))
    if summary["timing"] != "sim":
        print("(latencies are wall-clock: the endpoint sent no simulator timing)")
    print(f"results: {_write(args.out, 'replay.json', {'summary': summary})}")
    return 1 if _failed(result) else 0


def cmd_compare(args: argparse.Namespace) -> int:
    preset = preset_of(args)
    for field_name in ("replicas", "kv_blocks", "speed", "max_num_seqs",
                       "max_num_batched_tokens", "scheduling_policy"):
        value = getattr(args, field_name)
        if value is not None:
            preset = replace(preset, **{field_name: value})
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    try:
        unknown = [p for p in policies
                   if split_column(p, args.session_ids)[0] not in POLICIES]
    except ValueError as e:
        print(f"gateway-bench compare: {e}", file=sys.stderr)
        return 2
    if args.gateways < 1:
        print("gateway-bench compare: --gateways must be >= 1", file=sys.stderr)
        return 2
    if unknown or not policies:
        print(f"gateway-bench compare: unknown policy {unknown}; choose from {POLICIES}",
              file=sys.stderr)
        return 2
    columns = default_columns(policies, args.session_ids)
    wants_pd = [c for c in columns if pd_column(c)]
    if (wants_pd or args.pd_reuse) and args.pd is None:
        print("gateway-bench compare: a +pd column and --pd-reuse need --pd P:D",
              file=sys.stderr)
        return 2
    if args.pd is not None and args.backend:
        print("gateway-bench compare: --pd runs simulated replicas; not with --backend",
              file=sys.stderr)
        return 2
    if args.pd is not None and not wants_pd:
        columns = (*columns, pd_default_column(columns))
    opts = CompareOptions(preset=preset, policies=columns, pd=args.pd, pd_reuse=args.pd_reuse,
                          out_dir=args.out, max_wall_s=args.max_wall_s,
                          progress=not args.no_progress,
                          backends=tuple(args.backend), time_scale=args.time_scale,
                          allow_dirty_cache=args.allow_dirty_cache,
                          api=args.api, session_ids=args.session_ids,
                          gateways=args.gateways, shared_state=not args.no_shared_state)
    try:
        result = compare(opts)
    except DirtyCacheError as e:
        print(f"gateway-bench compare: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, aiohttp.ClientError) as e:
        print(f"gateway-bench compare: {e}", file=sys.stderr)
        return 1
    if args.markdown:
        print()
        print(summary_table(result["policies"], markdown=True))
    return 0


# The commands that draw charts (matplotlib, the `bench` extra); replay draws none.
CHARTED = frozenset({"run", "compare"})


def main(argv: Sequence[str] | None = None) -> int:
    """--help and --version answer without the extra; a command that draws charts checks
    for it before it runs (raises `MissingExtra`)."""
    args = build_parser().parse_args(argv)
    if args.command in CHARTED:
        import gateway.bench.charts  # noqa: F401  (raises MissingExtra without matplotlib)
    handlers = {"run": cmd_run, "replay": cmd_replay, "compare": cmd_compare}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
