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
from urllib.parse import urlsplit

import aiohttp
import orjson

from gateway import __version__
from gateway.bench import explain
from gateway.bench.analysis import analyse
from gateway.bench.apis import APIS
from gateway.bench.compare import (
    CompareOptions,
    DirtyCacheError,
    compare,
    default_columns,
    pd_column,
    split_column,
)
from gateway.bench.failures import format_reasons
from gateway.bench.pdfleet import parse_pd, pd_default_column
from gateway.bench.presets import BLOCK_SIZE, PRESETS, Preset, with_overrides
from gateway.bench.replay import ReplayOptions, replay
from gateway.bench.runner import SESSION_IDS, RunOptions, RunResult, run_workload
from gateway.bench.server import probe
from gateway.bench.session import ServerLimits, sample_body
from gateway.bench.table import summary_table, turn_table
from gateway.bench.trace import TraceError, parse_trace, select, trace_bound
from gateway.bench.workload import build_workload

# Public, Apache-2.0 (gateway/bench/traces/README.md), installed with the package.
SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_1min.jsonl"

POLICIES = ("prefix", "round_robin", "least_loaded", "session", "random")


def base_url(text: str) -> str:
    """A server's base URL as the user gives it: trailing slashes and a final `/v1` (the
    form the openai client takes) are dropped; only http(s) URLs with a host pass."""
    url = text.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    try:
        parts.port  # noqa: B018 (checks the range)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None
    return url


PRESET_HELP = (
    "workload and fleet size: tiny (6 sessions x 3 turns on 2 replicas: a smoke run), "
    "default (48 x 8 on 4 replicas whose cache holds half the working set, ~20 s a policy), "
    "large (96 x 10, minutes a policy), xl (256 x 16 on 8 replicas, bigger machines), "
    "overload (two tenants, three classes, more than the fleet absorbs: compare prefix "
    "with prefix+queue), flood (one tenant at 10x another's rate), agent (forks, "
    "compactions, tool outputs up to ~3k tokens); "
    "default %(default)s"
)


def _workload_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default="default", help=PRESET_HELP)
    a("--sessions", type=int, help="agent sessions (default: the preset's)")
    a("--turns", type=int, help="turns per session (default: the preset's)")
    a("--think-time", type=float, dest="think_time_s",
      help="mean seconds between a reply and the next turn (workload seconds)")
    a("--tool-result-tokens", type=int, help="size of an ordinary tool result")
    a("--large-tool-result-tokens", type=int, help="size of an occasional large tool result")
    a("--fanout", type=int, help="parallel sibling requests when a turn fans out")
    a("--compaction-every", type=int,
      help="compact a session's history every N turns (0: never)")
    a("--arrival-interval", type=float, dest="arrival_interval_s",
      help="mean workload seconds between session starts (the offered load)")
    a("--only-tenant", action="append", dest="only_tenants", metavar="NAME",
      help="keep only this tenant's sessions, unchanged (repeatable; presets with tenants)")
    a("--hygiene-break", action="store_true", default=None,
      help="put a per-request timestamp in every system prompt (a cache breaker)")
    a("--tool-calls", action="store_true", default=None,
      help="every turn asks for a tool call (tool_choice required) and the next sends it "
      "back with a role: tool message carrying the tool's output, as an agent loop does")
    a("--seed", type=int, help="workload seed (default: the preset's); the same seed gives "
      "the same sessions")
    a("--load", type=float,
      help="offered load multiplier: sessions and arrival rate (agent-tools: 1 = one "
      "3-sub-agent program every 3 workload seconds; default: the preset's)")
    a("--out", type=Path, default=Path("bench-out"),
      help="folder for results, charts and logs (default: %(default)s)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--max-wall-s", type=float, default=600.0,
      help="bound on each run, wall seconds (default %(default)s)")
    a("--api", choices=APIS, default="chat",
      help="inference API the turns use: chat completions, Responses or Messages "
      "(default %(default)s)")
    a("--session-ids", choices=SESSION_IDS, default="header",
      help="how requests name their session (none: as most applications; default "
      "%(default)s)")


def _preset(args: argparse.Namespace) -> Preset:
    preset = with_overrides(
        PRESETS[args.preset],
        sessions=args.sessions,
        turns=args.turns,
        think_time_s=args.think_time_s,
        tool_result_tokens=args.tool_result_tokens,
        large_tool_result_tokens=args.large_tool_result_tokens,
        fanout=args.fanout,
        compaction_every=args.compaction_every,
        hygiene_break=args.hygiene_break,
        tool_calls=args.tool_calls,
        seed=args.seed,
        arrival_interval_s=args.arrival_interval_s,
        only_tenants=tuple(args.only_tenants) if args.only_tenants else None,
        load=getattr(args, "load", None),
    )
    if getattr(args, "concurrency", None):
        preset = replace(preset, concurrency=args.concurrency)
    return preset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    version = f"gateway-bench {__version__}"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="agent sessions against an OpenAI-compatible endpoint")
    run.add_argument("--version", action="version", version=version)
    run.add_argument("--base-url", required=True, type=base_url,
                     help="the endpoint, with or without /v1 (http://127.0.0.1:8080 or the "
                     "openai client's http://127.0.0.1:8080/v1)")
    run.add_argument("--model", help="default: the first model of /v1/models")
    run.add_argument("--concurrency", type=int, help="sessions active at once")
    run.add_argument("--time-scale", type=float, default=1.0,
                     help="wall seconds per workload second (e.g. 1/sim speed)")
    run.add_argument("--tokenize-url", type=base_url,
                     help="a vLLM replica whose /tokenize computes the cache bound (default: "
                     "a healthy replica the gateway names in its /stats, else the base URL)")
    _workload_flags(run)

    rep = sub.add_parser("replay", help="replay a Mooncake trace")
    rep.add_argument("--version", action="version", version=version)
    rep.add_argument("trace", type=Path, nargs="?", default=SHIPPED_TRACE,
                     help="Mooncake JSON-lines trace (default: the first minute of Mooncake's "
                     "public conversation trace, shipped in gateway/bench/traces/)")
    rep.add_argument("--base-url", required=True, type=base_url,
                     help="the endpoint, with or without /v1")
    rep.add_argument("--model", help="default: the first model of /v1/models")
    rep.add_argument("--speedup", type=float, default=1.0,
                     help="replay the trace's timestamps this much faster (default 1)")
    rep.add_argument("--limit", type=int, help="at most this many requests")
    rep.add_argument("--minutes", type=float, help="only the trace's first N minutes")
    rep.add_argument("--max-tokens-cap", type=int, default=64,
                     help="cap on each request's output tokens (default %(default)s)")
    rep.add_argument("--max-in-flight", type=int, default=64,
                     help="requests outstanding at once, at most (default %(default)s)")
    rep.add_argument("--out", type=Path, default=Path("bench-out"),
                     help="folder for results (default: %(default)s)")
    rep.add_argument("--no-progress", action="store_true", help="no progress bar")
    rep.add_argument("--max-wall-s", type=float, default=600.0,
                     help="bound on the run, wall seconds (default %(default)s)")

    cmp_ = sub.add_parser("compare", help="simulator + gateway per policy, side by side")
    cmp_.add_argument("--version", action="version", version=version)
    cmp_.add_argument("--replicas", type=int, help="simulated replicas (default: the preset's)")
    cmp_.add_argument("--policies", default="prefix,round_robin,least_loaded",
                      help="columns: a policy, or policy@HOW to name sessions another way "
                           "than --session-ids (prefix also runs the other way unless a "
                           "prefix@ column is given)")
    cmp_.add_argument("--concurrency", type=int,
                      help="sessions active at once (default: the preset's)")
    cmp_.add_argument("--kv-blocks", type=int, help="per replica (default: the preset's)")
    cmp_.add_argument("--speed", type=float, help="simulator speed (default: the preset's)")
    cmp_.add_argument("--max-num-seqs", type=int,
                      help="simulated engines' sequence limit (default: the preset's)")
    cmp_.add_argument("--max-num-batched-tokens", type=int,
                      help="simulated engines' tokens per step (default: the preset's)")
    cmp_.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                      help="simulated engines' policy; with priority a +queue column passes "
                      "the class as vLLM's `priority` (default: the preset's)")
    cmp_.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    cmp_.add_argument("--backend", action="append", default=[], metavar="URL", type=base_url,
                      help="a replica to use instead of the simulator (repeatable)")
    cmp_.add_argument("--time-scale", type=float,
                      help="wall seconds per workload second (default 1/speed; 1 with --backend)")
    cmp_.add_argument("--gateways", type=int, default=1, metavar="N",
                      help="gateway instances per column behind a round-robin client "
                      "(default 1); with N > 1 they share routing state through a "
                      "redis-server started for the run (needs redis-server)")
    cmp_.add_argument("--no-shared-state", action="store_true",
                      help="with --gateways N: N independent instances, no Redis")
    cmp_.add_argument("--pd", type=_pd_counts, metavar="P:D",
                      help="also run prefix on a prefill/decode fleet of P prefill and D "
                      "decode simulated replicas (a prefix+pd column), at the same load")
    cmp_.add_argument("--pd-reuse", action="store_true",
                      help="with --pd: the decoder's KV pulled back on the next turn "
                      "(bidirectional transfer; the gateway's [pd] reuse_decoder_kv)")
    cmp_.add_argument("--allow-dirty-cache", action="store_true",
                      help="with --backend: run even when caches cannot be reset between policies")
    _workload_flags(cmp_)
    return parser


_UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, IndexError,
                TypeError)


def _pd_counts(text: str) -> tuple[int, int]:
    try:
        return parse_pd(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    preset = _preset(args)
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
    preset = _preset(args)
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
