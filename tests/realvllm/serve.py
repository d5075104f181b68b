"""Start real vLLM CPU replicas of the tier's tiny model by hand, for benchmarks:

    python -m tests.realvllm.serve --count 2 --port 8300 [--block-size 32]
        [--max-model-len 16384] [--no-tools] [--no-dev-mode] [--num-gpu-blocks N]
        [--kv-events]

serves on 127.0.0.1:8300, :8301, ... until Ctrl-C / SIGTERM, then stops them by pid. Same
processes and flags as the test fixtures (`tests/realvllm/vllm.py`); logs under
build/realvllm/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Sequence

from tests.realvllm.vllm import VllmOptions, ensure_model, vllm_unavailable
from tests.servers import ROOT, running, wait_http


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.realvllm.serve")
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--no-tools", action="store_true", help="without --enable-auto-tool-choice")
    ap.add_argument("--no-dev-mode", action="store_true", help="without VLLM_SERVER_DEV_MODE")
    ap.add_argument("--num-gpu-blocks", type=int, help="--num-gpu-blocks-override (KV pressure)")
    ap.add_argument("--kv-events", action="store_true",
                    help="publish KV events: replica i on port + 100 + 2i, replay on the next")
    args = ap.parse_args(argv)
    reason = vllm_unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    options = VllmOptions(model_path=ensure_model(ROOT / "build" / "realvllm"))
    options = dataclasses.replace(
        options, block_size=args.block_size, max_model_len=args.max_model_len,
        tool_parser=None if args.no_tools else options.tool_parser,
        dev_mode=not args.no_dev_mode, num_gpu_blocks=args.num_gpu_blocks,
    )  # fmt: skip
    logs = ROOT / "build" / "realvllm" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds: replicas are stopped
    with contextlib.ExitStack() as stack:
        ports = range(args.port, args.port + args.count)
        procs = [
            stack.enter_context(
                running(options.argv(p, args.port + 100 + 2 * i if args.kv_events else None),
                        [], env=options.env(), log_path=logs / f"vllm-{p}.log")
            )
            for i, p in enumerate(ports)
        ]
        for port, proc in zip(ports, procs, strict=True):
            wait_http(f"http://127.0.0.1:{port}/health", options.start_timeout_s, proc)
            print(f"ready: http://127.0.0.1:{port}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
