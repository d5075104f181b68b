"""KV-event decoding, the code before (msgpack + hand checks) against msgspec structs,
side by side on the payloads recorded from real vLLM 0.32 (tagged maps) and the same
batches in the positional encoding of earlier versions (tests/data).

    mkdir -p /tmp/base && git archive main gateway | tar -x -C /tmp/base
    .venv/bin/python bench/bench_decode.py --baseline /tmp/base [--rounds 5] [--loops 2000]

Each round times `--loops` passes over every recorded payload of one file with each
decoder, interleaved (old, new); the report is the median over rounds, in microseconds per
payload, and the ratio. Before timing, both decoders' events are checked equal, field by
field, on every payload.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack

from gateway.events import decode as new

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
FILES = ("kv_events_vllm032.msgpack", "kv_events_positional.msgpack")


def load_old(root: Path) -> ModuleType:
    path = root / "gateway" / "events" / "decode.py"
    spec = importlib.util.spec_from_file_location("baseline_decode", path)
    if spec is None or spec.loader is None:
        sys.exit(f"no decoder at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def shape(batch: Any) -> list[tuple[str, tuple[Any, ...]]]:
    return [(type(e).__name__, dataclasses.astuple(e)) for e in batch.events]


def per_payload_us(decode: Callable[[int, bytes], Any], payloads: list[bytes],
                   loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        for p in payloads:
            decode(0, p)
    return (time.perf_counter() - start) / (loops * len(payloads)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True,
                    help="a tree holding the decoder before (git archive REV gateway)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loops", type=int, default=2000)
    args = ap.parse_args()
    old = load_old(args.baseline)
    print(f"{'payloads':<32} {'events':>6} {'tokens':>6} {'before us':>10} {'msgspec us':>10} "
          f"{'ratio':>6}")
    for name in FILES:
        frames = msgpack.unpackb((DATA / name).read_bytes())
        payloads = [f[2] for f in frames]
        events = tokens = 0
        for p in payloads:
            a, b = old.decode_payload(0, p), new.decode_payload(0, p)
            assert shape(a) == shape(b), f"{name}: decoders disagree"
            events += len(b.events)
            tokens += sum(len(getattr(e, "token_ids", ())) for e in b.events)
        before, after = [], []
        for _ in range(args.rounds):
            before.append(per_payload_us(old.decode_payload, payloads, args.loops))
            after.append(per_payload_us(new.decode_payload, payloads, args.loops))
        b_med, a_med = statistics.median(before), statistics.median(after)
        label = f"{name} ({len(payloads)})"
        print(f"{label:<32} {events:>6} {tokens:>6} {b_med:>10.1f} {a_med:>10.1f} "
              f"{a_med / b_med:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
