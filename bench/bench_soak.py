"""Soak: the gateway in front of `gateway sim` at a steady rate for a long time, with
thousands of conversations (half with `x-session-id`, half without), while the gateway's
resident memory is sampled. A gateway whose bounded structures (block index, session and
conversation bindings, hygiene drift state, usage queues, stats windows, connection pool)
really are bounded shows a plateau; a leak shows a slope.

    .venv/bin/python bench/bench_soak.py --minutes 10 --rate 150 --out bench/results/soak

Load: open loop at `--rate` requests per second (at most `--max-outstanding` in flight; a
tick that finds that many is counted as skipped, not queued). `--conversations` slots each
hold one conversation of 2-12 turns over one of 40 agent system prompts; a finished
conversation is replaced by a new one, so the number of distinct conversations grows for
the whole run. Half the requests stream. Replies are fed back into the history.

Output: `soak.csv` (one row per sample: elapsed s, gateway and simulator RSS in MiB,
requests done, errors, skipped, and with `--overload` the admission queue's depth and its
shed count from `/stats`), `soak.png` (the RSS curve) and a summary: RSS after the
warm-up, at the end, and the slope over the second half in MiB per minute.

Overload (`--overload`): the engines of the `overload` preset (16 sequences, 2048-token
steps; the gateway's queue room set from them as `compare` does), conversations carrying
its two tenants (API keys) and three classes (high 20%, normal 50%, low 30%, header
`x-gateway-priority`), `--admission` turning the queue on. Run once with the queue off at
a rate the fleet cannot absorb to read what it absorbs (requests done per second), then
with the queue on at twice that:

    .venv/bin/python bench/bench_soak.py --overload --minutes 1 --rate 200 --speed 1
    .venv/bin/python bench/bench_soak.py --overload --admission --minutes 10 --rate R --speed 1 \
        --config bench/soak.toml --out bench/results/admission-soak

It adds a markdown table: RSS at the start, middle and end, the queue's depth at most,
shed counts by reason (the gateway's) and by class (the client's 429s), requests served.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.bench.procs import Managed, free_ports, gateway_command  # noqa: E402
from gateway.sim.generator import WORDS  # noqa: E402

STATS_AUTH = {"Authorization": "Bearer sk-bench-a"}

MODEL = "soak-model"
# The `overload` preset's tenants and classes (gateway/bench/presets.py).
TENANTS = ("a", "b")
CLASSES = (("high", 0.2), ("normal", 0.5), ("low", 0.3))
ENGINE_SEQS = 16
ENGINE_STEP_TOKENS = 2048
PREFILL_STEPS = 2  # the queue's prefill room per replica, in engine steps (as compare)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


@dataclass
class Conversation:
    cid: str
    system: str
    named: bool
    turns_left: int
    tenant: str = ""
    cls: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    skipped: int = 0
    conversations: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    done_by_class: dict[str, int] = field(default_factory=dict)
    shed_by_class: dict[str, int] = field(default_factory=dict)
    retry_after_missing: int = 0


class Load:
    def __init__(self, base: str, args: argparse.Namespace) -> None:
        self.base = base
        self.args = args
        self.rng = random.Random(args.seed)
        self.c = Counters()
        self.prompts = [self._words(300) + f" Agent {i}." for i in range(40)]
        self.slots = [self._new() for _ in range(args.conversations)]
        self.busy: set[int] = set()
        self.shed: dict[str, int] = {}  # the gateway's shed counts by reason (last sample)

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _new(self) -> Conversation:
        self.c.conversations += 1
        n = self.c.conversations
        conv = Conversation(cid=f"soak-{n}", system=self.rng.choice(self.prompts),
                            named=n % 2 == 0, turns_left=self.rng.randint(2, 12))
        if self.args.overload:
            conv.tenant = self.rng.choice(TENANTS)
            conv.cls = self.rng.choices([c for c, _ in CLASSES],
                                        [w for _, w in CLASSES])[0]
        return conv

    async def one(self, http: aiohttp.ClientSession, slot: int) -> None:
        conv = self.slots[slot]
        if conv.messages and conv.messages[-1]["role"] == "user":
            conv.messages.pop()  # the last turn was shed: ask it again
        conv.messages.append({"role": "user", "content": self._words(self.rng.randint(20, 80))})
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "system", "content": conv.system}, *conv.messages]}
        headers = {"x-session-id": conv.cid} if conv.named else {}
        if conv.tenant:
            headers["Authorization"] = f"Bearer sk-bench-{conv.tenant}"
            headers["x-gateway-priority"] = conv.cls
        try:
            async with http.post(f"{self.base}/v1/chat/completions", json=body,
                                 headers=headers) as r:
                raw = await r.read()
                if r.status == 429:
                    # shed by the queue: counted by class, not an error (the conversation
                    # goes on, as a client retrying later would)
                    self.c.shed_by_class[conv.cls] = self.c.shed_by_class.get(conv.cls, 0) + 1
                    if "Retry-After" not in r.headers:
                        self.c.retry_after_missing += 1
                    return
                if r.status != 200:
                    self._error(f"http {r.status}")
                    return
            reply = "ok"
            if not stream:
                doc = orjson.loads(raw)
                reply = doc["choices"][0]["message"]["content"] or "ok"
            conv.messages.append({"role": "assistant", "content": reply})
            self.c.done += 1
            self.c.done_by_class[conv.cls] = self.c.done_by_class.get(conv.cls, 0) + 1
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
            self._error(type(e).__name__)
        finally:
            conv.turns_left -= 1
            if conv.turns_left <= 0:
                self.slots[slot] = self._new()
            self.busy.discard(slot)

    def _error(self, kind: str) -> None:
        self.c.errors += 1
        self.c.error_kinds[kind] = self.c.error_kinds.get(kind, 0) + 1

    async def admission(self, http: aiohttp.ClientSession) -> tuple[int, dict[str, int]]:
        """The queue's depth (all classes) and shed counts by reason, from `/stats`."""
        try:
            async with http.get(f"{self.base}/stats", headers=STATS_AUTH,
                                timeout=aiohttp.ClientTimeout(total=5)) as r:
                doc = orjson.loads(await r.read())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return -1, {}
        a = doc.get("admission") or {}
        return sum((a.get("queued") or {}).values()), dict(a.get("shed") or {})

    async def run(self, gateway_pid: int, sim_pid: int, out: Path) -> list[list[float]]:
        args = self.args
        rows: list[list[float]] = []
        timeout = aiohttp.ClientTimeout(total=150 if args.overload else 60)
        conn = aiohttp.TCPConnector(limit=args.max_outstanding)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
            t0 = time.monotonic()
            end = t0 + args.minutes * 60.0
            next_sample = t0
            period = 1.0 / args.rate
            tick = t0
            while tick < end:
                now = time.monotonic()
                if now >= next_sample:
                    depth, shed = -1, dict[str, int]()
                    if args.overload:
                        depth, shed = await self.admission(http)
                        self.shed = shed or self.shed
                    rows.append([round(now - t0, 1), round(rss_mib(gateway_pid), 1),
                                 round(rss_mib(sim_pid), 1), self.c.done, self.c.errors,
                                 self.c.skipped, depth, sum(shed.values())])
                    print(f"{'' if args.overload else chr(13)}{rows[-1][0]:7.0f}s gateway "
                          f"{rows[-1][1]:7.1f} MiB  done {self.c.done}  errors "
                          f"{self.c.errors}  skipped {self.c.skipped}  conversations "
                          f"{self.c.conversations}  queued {depth}  shed {sum(shed.values())}",
                          end="\n" if args.overload else "", flush=True)
                    next_sample += args.sample_s
                free = [i for i in self.rng.sample(range(len(self.slots)), 8)
                        if i not in self.busy]
                if len(tasks) >= args.max_outstanding or not free:
                    self.c.skipped += 1
                else:
                    self.busy.add(free[0])
                    task = asyncio.create_task(self.one(http, free[0]))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                tick += period
                await asyncio.sleep(max(0.0, tick - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=60)
        print()
        return rows


def summarize(rows: list[list[float]], warmup_s: float) -> dict[str, float]:
    after = [r for r in rows if r[0] >= warmup_s] or rows
    half = [r for r in rows if r[0] >= rows[-1][0] / 2] or rows
    n = len(half)
    mx = sum(r[0] for r in half) / n
    my = sum(r[1] for r in half) / n
    var = sum((r[0] - mx) ** 2 for r in half) or 1.0
    slope_per_s = sum((r[0] - mx) * (r[1] - my) for r in half) / var
    return {"rss_after_warmup_mib": after[0][1], "rss_end_mib": rows[-1][1],
            "rss_max_mib": max(r[1] for r in rows),
            "slope_second_half_mib_per_min": round(slope_per_s * 60.0, 3),
            "requests": rows[-1][3], "errors": rows[-1][4], "skipped": rows[-1][5]}


def overload_table(rows: list[list[float]], load: Load) -> str:
    """The overload soak's figures as a markdown table."""
    mid = min(rows, key=lambda r: abs(r[0] - rows[-1][0] / 2))
    c = load.c
    served = ", ".join(f"{k} {c.done_by_class.get(k, 0):,}" for k, _ in CLASSES)
    shed_cls = ", ".join(f"{k} {c.shed_by_class.get(k, 0):,}" for k, _ in CLASSES)
    reasons = ", ".join(f"{k} {v:,}" for k, v in load.shed.items() if v) or "none"
    lines = [
        "| figure | value |", "|---|---|",
        f"| gateway RSS start ({rows[0][0]:.0f} s) / mid ({mid[0]:.0f} s) / end "
        f"({rows[-1][0]:.0f} s) | {rows[0][1]} / {mid[1]} / {rows[-1][1]} MiB |",
        f"| gateway RSS max | {max(r[1] for r in rows)} MiB |",
        f"| queue depth max (samples) | {max(int(r[6]) for r in rows):,} |",
        f"| requests served (by class, drain after the end included) | {c.done:,} ({served}) |",
        f"| served during the run | {int(rows[-1][3]):,} in {rows[-1][0]:.0f} s, "
        f"{rows[-1][3] / max(rows[-1][0], 1.0):.1f}/s |",
        f"| shed, 429 (client, by class) | {sum(c.shed_by_class.values()):,} ({shed_cls}); "
        f"without Retry-After {c.retry_after_missing} |",
        f"| shed (gateway, by reason) | {reasons} |",
        f"| other errors / skipped ticks | {c.errors:,} {c.error_kinds or ''} / {c.skipped:,} |",
    ]
    return "\n".join(lines)


def chart(rows: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r[0] / 60 for r in rows], [r[1] for r in rows], label="gateway RSS")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot([r[0] / 60 for r in rows], [r[3] for r in rows], color="grey", alpha=0.5,
             label="requests done")
    ax2.set_ylabel("requests")
    ax.set_title("gateway resident memory under a steady load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=150.0, help="requests per second")
    p.add_argument("--conversations", type=int, default=2000, help="active conversations")
    p.add_argument("--max-outstanding", type=int, default=256)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--speed", type=float, default=200.0, help="simulator speed-up")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--config", type=Path, default=None,
                   help="gateway TOML config (e.g. smaller caps, to reach every bound in the run)")
    p.add_argument("--overload", action="store_true",
                   help="the overload preset's small engines, tenants and classes")
    p.add_argument("--admission", action="store_true",
                   help="the gateway queue on (off without it, whatever --config says)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sim_port = free_ports(args.replicas)
    gw_port = free_ports(1)
    backends = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    engine_args: list[str] = []
    gw_env = {"GATEWAY_LOG_LEVEL": "warning"}
    if args.overload:
        engine_args = ["--max-num-seqs", str(ENGINE_SEQS),
                       "--max-num-batched-tokens", str(ENGINE_STEP_TOKENS)]
        gw_env.update({
            "GATEWAY_AUTH__KEYS": ",".join(f"sk-bench-{t}={t}" for t in TENANTS),
            "GATEWAY_ADMISSION__DEFAULT_PRIORITY_CAP": "high",
            "GATEWAY_ADMISSION__REPLICA_MAX_IN_FLIGHT": str(ENGINE_SEQS),
            "GATEWAY_ADMISSION__REPLICA_MAX_QUEUED_PREFILL_TOKENS": str(
                PREFILL_STEPS * ENGINE_STEP_TOKENS),
            "GATEWAY_ACCESS_LOG": "false",
        })
    # off unless asked for, whatever the default (the environment wins over --config)
    gw_env["GATEWAY_ADMISSION__ENABLED"] = "true" if args.admission else "false"
    sim = Managed(gateway_command("sim", "--replicas", str(args.replicas), "--port",
                                  str(sim_port), "--model", MODEL, "--speed", str(args.speed),
                                  "--output-len", "16", *engine_args),
                  [f"{b}/health" for b in backends], args.out / "sim.log")
    serve_args = ["serve", "--port", str(gw_port)]
    if args.config is not None:
        serve_args += ["--config", str(args.config)]
    for b in backends:
        serve_args += ["--backend", b]
    gw = Managed(gateway_command(*serve_args), [f"http://127.0.0.1:{gw_port}/ready"],
                 args.out / "gateway.log", env=gw_env)
    with sim, gw:
        assert sim.proc is not None and gw.proc is not None
        load = Load(f"http://127.0.0.1:{gw_port}", args)
        rows = asyncio.run(load.run(gw.proc.pid, sim.proc.pid, args.out))
    with open(args.out / "soak.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["elapsed_s", "gateway_rss_mib", "sim_rss_mib", "done", "errors",
                    "skipped", "queued", "shed"])
        w.writerows(rows)
    chart(rows, args.out / "soak.png")
    summary = summarize(rows, args.warmup_s)
    summary["conversations"] = load.c.conversations
    print(summary)
    if load.c.error_kinds:
        print("errors by kind:", load.c.error_kinds)
    if args.overload:
        print(overload_table(rows, load))


if __name__ == "__main__":
    main()
