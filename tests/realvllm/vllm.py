"""Real vLLM CPU replicas for the `realvllm` tier: where vLLM is, the model, the processes.

vLLM lives in its own virtualenv (installed by `tests/realvllm/install.sh`), never in the
project's: `GATEWAY_VLLM_PYTHON` names its interpreter, else the script's default location
(`$GATEWAY_VLLM_VENV` or `~/.cache/gateway-vllm/venv`) is tried. `vllm_unavailable()` says
why the tier cannot run (the skip reason) or None.

Each replica is `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
does not work with the CPU wheel) on its own 127.0.0.1 port, one OMP thread, 1 GiB of KV
cache, offline. It takes about a minute to answer `/health` on a quiet machine; the wait
is bounded by `VllmOptions.start_timeout_s`. Stopped by pid (SIGTERM, then SIGKILL), with
the processes it started (its own session: `tests.servers.stop_group`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.servers import ROOT, free_port, running, wait_http

_HERE = Path(__file__).resolve().parent
MODEL_NAME = "tiny-qwen2"


def vllm_python() -> Path:
    named = os.environ.get("GATEWAY_VLLM_PYTHON")
    if named:
        return Path(named)
    venv = os.environ.get("GATEWAY_VLLM_VENV") or str(Path.home() / ".cache/gateway-vllm/venv")
    return Path(venv) / "bin" / "python"


def vllm_unavailable() -> str | None:
    """Why real vLLM cannot run here (a skip reason), or None when it can."""
    python = vllm_python()
    if not python.exists():
        return (
            f"real vLLM not installed: {python} does not exist; run tests/realvllm/install.sh "
            "and set GATEWAY_VLLM_PYTHON to the python it prints"
        )
    probe = subprocess.run(
        [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        tail = probe.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return f"real vLLM at {python} does not import: {' '.join(tail)}"
    return None


def ensure_model(root: Path) -> Path:
    """The tiny Qwen2 folder under `root`, written once per version of its generator."""
    script = _HERE / "make_model.py"
    key = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    folder = root / f"tiny-qwen2-{key}"
    if not (folder / "model.safetensors").exists():
        tmp = root / f".tmp-{key}-{os.getpid()}"
        subprocess.run([str(vllm_python()), str(script), str(tmp)], check=True, timeout=300,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        tmp.rename(folder)
    return folder


@dataclass(frozen=True, kw_only=True)
class VllmOptions:
    model_path: Path
    served_name: str = MODEL_NAME
    block_size: int = 32  # on CPU a multiple of 32
    max_model_len: int = 4096
    max_num_seqs: int = 4
    kv_cache_gib: int = 1
    tool_parser: str | None = "hermes"  # None: started without --enable-auto-tool-choice
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache answers
    start_timeout_s: float = 240.0
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override: a small cache, for pressure

    def argv(self, port: int, events_port: int | None = None) -> list[str]:
        """With `events_port`, KV events are published there and replayed on the next port."""
        argv = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs), "--block-size", str(self.block_size),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.tool_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if events_port is not None:
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "replay_endpoint": f"tcp://*:{events_port + 1}", "topic": "kv"})]
        return argv

    def env(self) -> dict[str, str]:
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",  # two replicas on two cores
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env


@contextlib.contextmanager
def vllm_replicas(options: VllmOptions, count: int) -> Iterator[list[str]]:
    """`count` replicas, started side by side (their minute-long start-ups overlap), then
    waited for; yields their base URLs; every one stopped by pid on exit, with the engine
    processes it started (a server killed during its start-up left them running)."""
    logs = ROOT / "build" / "realvllm" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        ports = [free_port() for _ in range(count)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        procs = [
            stack.enter_context(running(options.argv(p), [], env=options.env(),
                                        log_path=logs / f"vllm-{p}.log", group=True))
            for p in ports
        ]  # fmt: skip
        for url, proc in zip(urls, procs, strict=True):
            wait_http(url + "/health", timeout=options.start_timeout_s, proc=proc)
        yield urls
