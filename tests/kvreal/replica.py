"""A minimal real-vLLM CPU launcher for the KV-event tests: builds the tiny model with the
vLLM venv's python, starts one replica publishing KV events (dev mode, so
`/reset_prefix_cache` works) and stops it by its pid. Bounded waits throughout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def build_model(python: str, out: Path) -> Path:
    if not (out / "model.safetensors").is_file():
        subprocess.run([python, str(HERE / "build_model.py"), str(out)], check=True,
                       timeout=300, capture_output=True)
    return out


def start(python: str, model: Path, workdir: Path, block_size: int = 32,
          kv_space_gib: int = 1) -> Replica:
    port, events, replay = free_port(), free_port(), free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv"}
    log = workdir / f"vllm-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", "4096", "--max-num-seqs", "4", "--block-size",
             str(block_size), "--enable-prompt-tokens-details",
             "--kv-events-config", json.dumps(config)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    replica = Replica(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(replica.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return replica
        except OSError:
            pass
        time.sleep(1)
    replica.stop()
    raise RuntimeError("vLLM did not become healthy in 300 s")
