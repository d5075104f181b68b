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
requests done, errors, skipped), `soak.png` (the RSS curve) and a summary line: RSS after
the warm-up, at the end, and the slope over the second half in MiB per minute.
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

MODEL = "soak-model"


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
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Counters:
    done: int = 0
    errors: int = 0
    skipped: int = 0
    conversations: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


class Load:
    def __init__(self, base: str, args: argparse.Namespace) -> None:
        self.base = base
        self.args = args
        self.rng = random.Random(args.seed)
        self.c = Counters()
        self.prompts = [self._words(300) + f" Agent {i}." for i in range(40)]
        self.slots = [self._new() for _ in range(args.conversations)]
        self.busy: set[int] = set()

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _new(self) -> Conversation:
        self.c.conversations += 1
        n = self.c.conversations
        return Conversation(cid=f"soak-{n}", system=self.rng.choice(self.prompts),
                            named=n % 2 == 0, turns_left=self.rng.randint(2, 12))

    async def one(self, http: aiohttp.ClientSession, slot: int) -> None:
        conv = self.slots[slot]
        conv.messages.append({"role": "user", "content": self._words(self.rng.randint(20, 80))})
        stream = self.rng.random() < 0.5
        body = {"model": MODEL, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "system", "content": conv.system}, *conv.messages]}
        headers = {"x-session-id": conv.cid} if conv.named else {}
        try:
            async with http.post(f"{self.base}/v1/chat/completions", json=body,
                                 headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    self._error(f"http {r.status}")
                    return
            reply = "ok"
            if not stream:
                doc = orjson.loads(raw)
                reply = doc["choices"][0]["message"]["content"] or "ok"
            conv.messages.append({"role": "assistant", "content": reply})
            self.c.done += 1
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

    async def run(self, gateway_pid: int, sim_pid: int, out: Path) -> list[list[float]]:
        args = self.args
        rows: list[list[float]] = []
        timeout = aiohttp.ClientTimeout(total=60)
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
                    rows.append([round(now - t0, 1), round(rss_mib(gateway_pid), 1),
                                 round(rss_mib(sim_pid), 1), self.c.done, self.c.errors,
                                 self.c.skipped])
                    print(f"\r{rows[-1][0]:7.0f}s gateway {rows[-1][1]:7.1f} MiB  done "
                          f"{self.c.done}  errors {self.c.errors}  skipped {self.c.skipped}  "
                          f"conversations {self.c.conversations}", end="", flush=True)
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
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sim_port = free_ports(args.replicas)
    gw_port = free_ports(1)
    backends = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    sim = Managed(gateway_command("sim", "--replicas", str(args.replicas), "--port",
                                  str(sim_port), "--model", MODEL, "--speed", str(args.speed),
                                  "--output-len", "16"),
                  [f"{b}/health" for b in backends], args.out / "sim.log")
    serve_args = ["serve", "--port", str(gw_port)]
    if args.config is not None:
        serve_args += ["--config", str(args.config)]
    for b in backends:
        serve_args += ["--backend", b]
    gw = Managed(gateway_command(*serve_args), [f"http://127.0.0.1:{gw_port}/ready"],
                 args.out / "gateway.log", env={"GATEWAY_LOG_LEVEL": "warning"})
    with sim, gw:
        assert sim.proc is not None and gw.proc is not None
        load = Load(f"http://127.0.0.1:{gw_port}", args)
        rows = asyncio.run(load.run(gw.proc.pid, sim.proc.pid, args.out))
    with open(args.out / "soak.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["elapsed_s", "gateway_rss_mib", "sim_rss_mib", "done", "errors",
                    "skipped"])
        w.writerows(rows)
    chart(rows, args.out / "soak.png")
    summary = summarize(rows, args.warmup_s)
    summary["conversations"] = load.c.conversations
    print(summary)
    if load.c.error_kinds:
        print("errors by kind:", load.c.error_kinds)


if __name__ == "__main__":
    main()
