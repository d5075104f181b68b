"""llama.cpp replicas (the `xllamacpp` wheel's embedded server) as separate processes.

Each replica is its own process on its own 127.0.0.1 port with one compute thread (on a
2-core machine more threads per replica made several replicas slower and erratic). The
child is this module run as `python -m tests.realengine.engine ...`: it builds
`xllamacpp.CommonParams`, starts `xllamacpp.Server` (which serves from background threads)
and sleeps until SIGTERM ends the process. `llama_replicas()` starts K of them, waits for
`/health`, and stops them (SIGTERM, then kill) on exit.

Knobs (`EngineOptions`): slots (`n_parallel`), context per slot (llama.cpp splits `n_ctx`
evenly across slots), `cache_ram_mib` (host-RAM prompt cache that keeps evicted slot
prefixes; 0 disables it so slot eviction is easy to provoke), model alias, threads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.servers import ROOT, free_port, running


def engine_unavailable() -> str | None:
    """Why llama.cpp cannot run here (a skip reason), or None when it can."""
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
        import xllamacpp  # noqa: F401
    except ImportError as e:
        return f"real-engine tests need xllamacpp, gguf, tokenizers (pip install -e .[test]): {e}"
    return None


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    model_path: Path
    alias: str = "tiny"
    slots: int = 2
    ctx_per_slot: int = 2048
    cache_ram_mib: int = 0
    threads: int = 1
    metrics: bool = True  # llama.cpp's own default is off (`--metrics`)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the replica's slots can hold at once (the host-RAM cache not counted)."""
        return self.slots * self.ctx_per_slot

    def argv(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "tests.realengine.engine",
            "--model", str(self.model_path), "--port", str(port), "--alias", self.alias,
            "--slots", str(self.slots), "--ctx-per-slot", str(self.ctx_per_slot),
            "--cache-ram-mib", str(self.cache_ram_mib), "--threads", str(self.threads),
            *([] if self.metrics else ["--no-metrics"]),
        ]  # fmt: skip


@contextlib.contextmanager
def llama_replicas(
    options: EngineOptions, count: int, log_dir: Path | None = None, timeout: float = 30.0
) -> Iterator[list[str]]:
    """Start `count` llama.cpp servers; yield their base URLs; stop them all on exit."""
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for i in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = log_dir / f"llama-{i}.log" if log_dir else None
            stack.enter_context(
                running(options.argv(port), [url + "/health"], timeout, env=env, log_path=log)
            )
            urls.append(url)
        yield urls


def _serve(argv: Sequence[str]) -> int:
    import xllamacpp

    ap = argparse.ArgumentParser(prog="python -m tests.realengine.engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--alias", default="tiny")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--cache-ram-mib", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-metrics", action="store_true")
    args = ap.parse_args(argv)

    p = xllamacpp.CommonParams()
    p.model.path = args.model
    p.port = args.port
    p.hostnames = ["127.0.0.1"]
    p.model_alias = {args.alias}
    p.n_parallel = args.slots
    p.n_ctx = args.slots * args.ctx_per_slot
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.n_threads_http = 8
    p.cache_prompt = True
    p.cache_ram_mib = args.cache_ram_mib
    p.endpoint_metrics = not args.no_metrics
    p.endpoint_slots = True
    p.verbosity = 1
    server = xllamacpp.Server(p)  # serves from its own threads until the process ends
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del server
    return 0


if __name__ == "__main__":
    # Block the stop signals so sigwait() receives them instead of the default handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.exit(_serve(sys.argv[1:]))
