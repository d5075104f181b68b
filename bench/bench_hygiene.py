"""Hygiene hot path and `gateway lint` throughput.

    .venv/bin/python bench/bench_hygiene.py [--rounds N] [--lint-requests N] [--baseline REF]

With `--baseline REF` (a git revision), the `gateway/hygiene` package as of REF is loaded
next to the working tree's (as `hygiene_base`) and every scan case and the memory check run
on both, interleaved, so before/after figures come from one run on the same machine state.

1. `HygieneAnalyzer.scan` (parse + pattern scan + drift against the session's previous
   request + snapshot) for a 2 KiB and a 128 KiB chat prompt, every part of which lies
   before the last user message (so all of it is eligible for the pattern scan). Rounds
   are interleaved so machine noise hits every case alike; medians and p90 are quoted.
   Sizes: the text mixes in numbers (8% of words: versions, prices, step numbers), the
   worst case for a scanner keyed on digits; `prose` is the same without numbers.
   Cases per size:
   - `steady`: a session's next request; the conversation so far is unchanged and the
     last user message is new (the common case: scan results come from the hash cache).
   - `volatile`: as steady, but the system prompt carries a clock that changes on every
     request (what the gateway exists to catch: the system part is rescanned, drift finds
     the break and names it).
   - `cold`: a fresh analyzer: every part is scanned (the first request of a template).
2. Drift-state memory: 256 sessions of 24 KiB conversations held by one analyzer
   (tracemalloc, after the bodies are dropped), extrapolated to the default caps
   (max_sessions + max_templates entries).
3. Lint throughput: N logged requests (sessions of growing conversations of 2-12 KiB, one
   in five with a ticking timestamp), linted in process and by the `gateway lint` CLI.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.lint import lint_lines

NOW = 1717250602.0
_TEXT = (
    "the cache of a prompt holds each block while requests share the prefix so keep the "
    "system text stable and move volatile values such as the time version 3 step 2 of the "
    "plan to the end where they cost nothing answer with code when asked def run(x): return "
    "x * 2 see table 4 row 17 price 19.99 eur"
)
WORDS = _TEXT.split()
# the same vocabulary without numbers: ordinary instructions, where digits are rare
PROSE = [w for w in WORDS if not any(c.isdigit() for c in w)]


def text(rng: random.Random, n_chars: int, words: list[str] = WORDS) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def conversation(rng: random.Random, total: int, words: list[str] = WORDS) -> list[dict[str, Any]]:
    """System prompt, then alternating user/assistant turns, ~`total` chars in all."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": text(rng, min(8192, total // 4), words)}
    ]
    size = len(msgs[0]["content"])
    turn = 0
    while size < total:
        n = min(total - size, rng.randint(200, 4000) if turn % 2 else rng.randint(100, 1200))
        role = "assistant" if turn % 2 else "user"
        msgs.append({"role": role, "content": text(rng, max(n, 1), words)})
        size += len(msgs[-1]["content"])
        turn += 1
    if msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": "ok"})
    return msgs


def request(history: list[dict[str, Any]], k: int, clock: bool) -> dict[str, Any]:
    msgs = [dict(m) for m in history]
    if clock:
        t = time.strftime("%H:%M:%S", time.gmtime(NOW + k))
        msgs[0]["content"] = f"Current time: {t}. " + msgs[0]["content"]
    msgs.append({"role": "user", "content": f"question number {k}: what next?"})
    return {"model": "m", "messages": msgs}


Factory = Callable[[], Any]  # () -> a fresh analyzer with default config


def bench_scan(rounds: int, impls: dict[str, Factory]) -> dict[str, list[float]]:
    rng = random.Random(1)
    histories = {
        "2k": conversation(rng, 2048),
        "2k prose": conversation(rng, 2048, PROSE),
        "128k": conversation(rng, 128 * 1024),
        "128k prose": conversation(rng, 128 * 1024, PROSE),
    }
    times: dict[str, list[float]] = {}
    analyzers = {
        (impl, size, case): make()
        for impl, make in impls.items()
        for size in histories
        for case in ("steady", "volatile")
    }
    bodies = {
        (size, case, k): request(h, k, case == "volatile")
        for size, h in histories.items()
        for case in ("steady", "volatile", "cold")
        for k in range(rounds + 1)
    }
    for (_, size, case), a in analyzers.items():  # the session's first request
        a.scan(bodies[(size, case, 0)], "chat", "s", NOW)
    for k in range(1, rounds + 1):
        for size in histories:
            for case in ("steady", "volatile", "cold"):
                for impl, make in impls.items():
                    a = analyzers.get((impl, size, case)) or make()
                    body = bodies[(size, case, k)]
                    t0 = time.perf_counter()
                    findings = a.scan(body, "chat", "s", NOW + k)
                    dt = time.perf_counter() - t0
                    times.setdefault(f"{impl}|{case} {size}", []).append(dt)
                    if case == "volatile":
                        assert findings and findings[0].kind == "timestamp", findings
    return times


def bench_memory(make: Factory, sessions: int = 256) -> float:
    """Bytes one analyzer holds per session entry (24 KiB conversations, text unique to
    each session so nothing is shared between entries)."""
    rng = random.Random(3)
    tracemalloc.start()
    a = make()
    base = tracemalloc.get_traced_memory()[0]
    for s in range(sessions):
        hist = conversation(rng, 24 * 1024)
        a.scan(request(hist, s, False), "chat", f"s{s}", NOW)
        del hist
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return held / sessions


def load_baseline(ref: str) -> Factory:
    """The hygiene package at git revision `ref`, importable as `hygiene_base`."""
    root = Path(__file__).resolve().parent.parent
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", ref, "gateway/hygiene/"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix="hygiene_base_"))
    pkg = tmp / "hygiene_base"
    pkg.mkdir()
    for name in names:
        if name.endswith(".py"):
            src = subprocess.run(
                ["git", "show", f"{ref}:{name}"],
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            (pkg / Path(name).name).write_text(src.replace("gateway.hygiene", "hygiene_base"))
    sys.path.insert(0, str(tmp))
    analyzer = __import__("hygiene_base.analyzer", fromlist=["HygieneAnalyzer"])
    config = __import__("hygiene_base.config", fromlist=["HygieneConfig"])
    return lambda: analyzer.HygieneAnalyzer(config.HygieneConfig())


def _us(ts: list[float]) -> tuple[float, float]:
    ts = sorted(ts)
    return statistics.median(ts) * 1e6, ts[int(0.9 * len(ts))] * 1e6


def lint_log(n: int) -> list[str]:
    rng = random.Random(2)
    lines: list[str] = []
    sessions: dict[int, list[dict[str, Any]]] = {}
    clocks = {}
    while len(lines) < n:
        s = rng.randrange(max(1, n // 20))
        hist = sessions.get(s)
        if hist is None or len(hist) > 14:
            hist = conversation(rng, rng.randint(2048, 8192))
            clocks[s] = s % 5 == 0
        body = request(hist, len(lines), clocks[s])
        lines.append(json.dumps({"body": body, "session": f"s{s}", "ts": NOW + len(lines)}))
        hist = [
            *body["messages"],
            {"role": "assistant", "content": text(rng, rng.randint(200, 1500))},
        ]
        if clocks[s]:
            hist[0] = dict(hist[0], content=hist[0]["content"].split(". ", 1)[1])
        sessions[s] = hist
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--lint-requests", type=int, default=10_000)
    ap.add_argument("--baseline", help="git revision to compare against, side by side")
    args = ap.parse_args()
    impls: dict[str, Factory] = {}
    if args.baseline:
        impls["before"] = load_baseline(args.baseline)
    impls["after" if args.baseline else "now"] = lambda: HygieneAnalyzer(HygieneConfig())
    times = bench_scan(args.rounds, impls)
    cases = list(dict.fromkeys(name.split("|", 1)[1] for name in times))
    print("| case | " + " | ".join(f"{i} median | {i} p90" for i in impls) + " |")
    print("|---|" + "---|---|" * len(impls))
    for case in cases:
        cells = [f"{m:.0f} us | {p:.0f} us" for m, p in (_us(times[f"{i}|{case}"]) for i in impls)]
        print(f"| scan {case} | " + " | ".join(cells) + " |")
    caps = HygieneConfig().max_sessions + HygieneConfig().max_templates
    for impl, make in impls.items():
        per = bench_memory(make)
        print(
            f"\nmemory {impl}: {per / 1024:.1f} KiB per 24 KiB session entry, "
            f"{per * caps / 1e6:.0f} MB at {caps} entries"
        )
    lines = lint_log(args.lint_requests)
    size = sum(len(x) for x in lines)
    t0 = time.perf_counter()
    found = list(lint_lines(lines, HygieneAnalyzer(HygieneConfig()), NOW))
    dt = time.perf_counter() - t0
    warnings = sum(1 for f in found if f.severity == "warning")
    print(
        f"\nlint in process: {len(lines)} requests ({size / 1e6:.1f} MB) in {dt:.2f} s "
        f"({len(lines) / dt:.0f} req/s), {len(found)} findings, {warnings} warnings"
    )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "log.jsonl"
        path.write_text("\n".join(lines) + "\n")
        exe = Path(sys.executable).parent / "gateway"
        t0 = time.perf_counter()
        out = subprocess.run([str(exe), "lint", str(path)], capture_output=True, check=True)
        dt = time.perf_counter() - t0
    n_out = len(out.stdout.splitlines())
    print(f"gateway lint CLI: {len(lines)} requests in {dt:.2f} s, {n_out} lines out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
