"""A burst to a cold fleet: `--streams` (600) concurrent long streams at once, through
`gateway serve` with its defaults (the admission queue set on or off, nothing else), to two
simulated replicas of `--max-num-seqs 512` that the gateway has never seen busy.

    .venv/bin/python bench/bench_cold_burst.py [--admission on|off] [--rounds 3]

With the queue on, the gate holds each engine at a guess of what it runs until its
scrapes show more (gateway/admission/engine.py): what is not let in within its class's
wait limit (`normal`: 30 s) is answered 429. This measures what the burst pays for that:
per round, the answers' statuses and the time to first token (from sending the request
to the first streamed content byte, measured by the client over raw sockets: a client
library's own cost would be most of the machine), p50 / p90 / p99 / max, and the wall
time of the whole burst. Prints one JSON object per round, then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
from bench_admission_flood import quantile, two_replicas

MODEL = "Qwen/Qwen3-0.6B"
CONTENT = re.compile(rb'"content":"[^"]')  # a delta with text (the first one has none)


async def one_stream(port: int, i: int, tokens: int) -> tuple[int, float | None]:
    """(status, seconds to the first content byte; None: no content came)."""
    body = orjson.dumps({
        "model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"stream {i} " + "long prompt " * 20}]})
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first: float | None = None
    data = b""
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                     b"content-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        while chunk := await reader.read(65536):
            data += chunk
            if first is None and CONTENT.search(data):
                first = time.monotonic() - start
    finally:
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, first


async def burst(port: int, streams: int, tokens: int) -> dict[str, Any]:
    start = time.monotonic()
    done = await asyncio.gather(*(one_stream(port, i, tokens) for i in range(streams)))
    wall = time.monotonic() - start
    statuses: dict[str, int] = {}
    for s, _ in done:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    ttft = [t for s, t in done if s == 200 and t is not None]
    return {"statuses": statuses, "wall_s": round(wall, 2),
            **{f"ttft_{k}_s": None if (v := quantile(ttft, q)) is None else round(v, 3)
               for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))}}


def one_round(args: argparse.Namespace) -> dict[str, Any]:
    with two_replicas(["--max-num-seqs", "512", "--model", MODEL], args.gateway_src,
                      args.admission == "on", ("--no-access-log",)) as url:
        return asyncio.run(burst(int(url.rsplit(":", 1)[1]), args.streams, args.tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--admission", choices=["on", "off"], default="on")
    ap.add_argument("--streams", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=400, help="max_tokens of each stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gateway-src", type=Path,
                    help="run `gateway serve` from this source tree instead (another "
                         "commit's `gateway/`, from `git archive`), the simulator as is")
    args = ap.parse_args()
    rounds = []
    for _ in range(max(1, args.rounds)):
        fig = one_round(args)
        print(json.dumps(fig), flush=True)
        rounds.append(fig)
    med = {k: statistics.median(r[k] for r in rounds)
           for k in rounds[0] if k != "statuses" and all(r[k] is not None for r in rounds)}
    med["answered_200"] = statistics.median(r["statuses"].get("200", 0) for r in rounds)
    print(json.dumps({"admission": args.admission, "medians": med}))


if __name__ == "__main__":
    main()
