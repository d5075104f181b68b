"""`gateway-bench`'s command line (cli.py runs it): the flags of `run`, `replay` and
`compare`, the workload flags the first and last share, and the preset they make.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from gateway import __version__
from gateway.bench.apis import APIS
from gateway.bench.pdfleet import parse_pd
from gateway.bench.presets import PRESETS, Preset, with_overrides
from gateway.bench.runner import SESSION_IDS

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


def workload_flags(p: argparse.ArgumentParser) -> None:
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


def preset_of(args: argparse.Namespace) -> Preset:
    """The preset the flags name, with the workload flags given over it."""
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


def command_line(description: str | None) -> argparse.ArgumentParser:
    """`gateway-bench`'s parser: its three commands and their flags (`description`: the
    command's help, cli.py's docstring)."""
    parser = argparse.ArgumentParser(prog="gateway-bench", description=description,
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
    workload_flags(run)

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
    workload_flags(cmp_)
    return parser


def _pd_counts(text: str) -> tuple[int, int]:
    try:
        return parse_pd(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
