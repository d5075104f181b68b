"""A prefix-cache reset on one of two real replicas: what the gateway predicts next, in text
mode and in token mode.

    python -m tests.realvllm.serve --count 2 --port 8300 --kv-events &   # dev mode: reset works
    .venv/bin/python bench/bench_kvreset.py --backend http://127.0.0.1:8300 \\
        --backend http://127.0.0.1:8301 --model-dir build/realvllm/tiny-qwen2-<key>

For each mode a fresh `gateway serve` (token mode: `[tokens] models` names the model
directory) fronts the same replicas, both caches reset first. Four conversations run three
turns each, one request at a time; then the replica holding conversation 0 is reset
(`POST /reset_prefix_cache`) and conversation 0 sends three more turns. Printed per request
after the reset: the replica, predicted and delivered cached tokens (from the gateway's
usage records).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

WORDS = ["agent", "tool", "search", "file", "read", "write", "plan", "step", "result",
         "error", "retry", "cache", "token", "model", "reply", "user", "system", "prompt",
         "test", "build", "deploy", "check"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def reset(client: httpx.Client, url: str) -> None:
    deadline = time.monotonic() + 30
    while not client.post(url + "/reset_prefix_cache").json().get("success", True):
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: reset refused for 30 s")
        time.sleep(0.2)


def run_mode(mode: str, backends: list[str], model: str, model_dir: str, block: int,
             seed: int) -> list[dict[str, Any]]:
    port = free_port()
    usage = Path(tempfile.mkdtemp()) / "usage.jsonl"
    # the admission queue pinned off, whatever the default: the modes' routing alone
    env = {**os.environ, "GATEWAY_USAGE__LOG_PATH": str(usage),
           "GATEWAY_ADMISSION__ENABLED": "false"}
    if mode == "token":
        env |= {"GATEWAY_TOKENS__MODELS": f"{model}={model_dir}",
                "GATEWAY_TOKENS__BLOCK_SIZE": str(block)}
    argv = [str(Path(sys.executable).with_name("gateway")), "serve", "--port", str(port)]
    for b in backends:
        argv += ["--backend", b]
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    with httpx.Client(timeout=120) as client:
        for b in backends:
            reset(client, b)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get(url + "/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("gateway did not start")
                time.sleep(0.2)
            time.sleep(2.0)  # subscriptions and parity
            convs = [[{"role": "system", "content": f"Agent {i}. " + words(rng, 400)},
                      {"role": "user", "content": words(rng, 30)}] for i in range(4)]

            def turn(i: int) -> str:
                r = client.post(url + "/v1/chat/completions", json={
                    "model": model, "messages": convs[i], "max_tokens": 8})
                r.raise_for_status()
                convs[i] += [{"role": "assistant",
                              "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": words(rng, 30)}]
                return str(r.headers["x-gateway-replica"])

            where = ""
            for _ in range(3):
                for i in range(4):
                    got = turn(i)
                    where = got if i == 0 else where
            before = len(usage.read_text().splitlines()) if usage.exists() else 0
            reset(client, "http://" + where)
            for _ in range(3):
                turn(0)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    records = [json.loads(line) for line in usage.read_text().splitlines()]
    for rec in records[max(before, len(records) - 3):]:
        out.append({"mode": mode, "replica": rec["replica"], "reset_replica": where,
                    "predicted": rec["predicted_cached_tokens"],
                    "delivered": rec["cached_tokens"], "prompt": rec["prompt_tokens"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", required=True)
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| mode | request after reset | replica | predicted | delivered | prompt |")
    print("|---|---|---|---|---|---|")
    for mode in ("text", "token"):
        rows = run_mode(mode, args.backend, args.model, args.model_dir, args.block_size,
                        args.seed)
        for n, row in enumerate(rows, 1):
            same = "reset one" if row["replica"] == row["reset_replica"] else "other"
            print(f"| {mode} | {n} | {same} | {row['predicted']} | {row['delivered']} | "
                  f"{row['prompt']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
