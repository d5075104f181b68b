"""A real vLLM prefill/decode pair for the `realvllm` tier: two CPU replicas with vLLM's
`NixlConnector` (`kv_both`, a CPU transfer buffer, the bidirectional scheduler that hands the
decoder's KV back to the next turn's prefill), started side by side and stopped by pid.

Both replicas run the same flags: which one prefills and which decodes is decided per request
by whoever sends the legs (the gateway, or a test by hand). NIXL's UCX backend talks TCP on
loopback; each replica has its own side-channel port (the handshake through which the
puller learns the holder's memory layout). Facts and the recipe: shared/real-vllm-pd.md.

`nixl_unavailable()` says why the pair cannot start (a skip reason) or None; `xfer_count()`
reads how many KV pulls a replica has completed (`vllm:nixl_xfer_time_seconds_count`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.realvllm.vllm import VllmOptions, vllm_python
from tests.servers import ROOT, free_port, running, wait_http

# Ask the engine to hand a pull to the puller rather than recompute under this many tokens
# (vLLM's default, stated so the tests' answer lengths can be sized against it).
RECOMPUTE_THRESHOLD = 64
XFER_COUNT = "vllm:nixl_xfer_time_seconds"

# The prefill leg's marker, as vLLM's reference proxy sends it: "prefill this and hold the
# KV for a remote decoder".
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def nixl_unavailable() -> str | None:
    """Why vLLM's interpreter cannot load NIXL (a skip reason), or None when it can."""
    probe = subprocess.run(
        [str(vllm_python()), "-c", "import nixl._api"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        tail = probe.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return (f"NIXL does not import in {vllm_python()} (run tests/realvllm/install.sh): "
                f"{' '.join(tail)}")  # fmt: skip
    return None


def kv_transfer_config() -> str:
    return json.dumps({
        "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True, "kv_recompute_threshold": RECOMPUTE_THRESHOLD},
    })  # fmt: skip


def pd_env(options: VllmOptions, side_channel_port: int) -> dict[str, str]:
    return {
        **options.env(),
        "UCX_TLS": "tcp,self,sm",  # no RDMA device here: TCP on loopback, shared memory
        "UCX_NET_DEVICES": "all",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
    }


def confined() -> list[str]:
    """The `taskset` prefix that keeps both engines of a pair on one CPU, the last this
    process may use, leaving the others to the tests and the gateway (none on a one-CPU
    machine, or without taskset).

    An idle pair does not sleep: while it holds KV for a remote reader each engine steps
    (its worker yielding in a loop) and NIXL's UCX progress thread polls its sockets, four
    threads making syscalls without pause. Spread over two cores they starved every other
    process: a bare `python3 -c pass` took up to 25 s and a gateway did not bind its port
    in 60 s (a CI run); a decode leg's connection timed out. Pinned to one CPU, the same
    start took 0.19 s each of five times, against 0.25-25 s unpinned (the same idle pair,
    moments apart)."""
    cpus = sorted(os.sched_getaffinity(0))
    taskset = shutil.which("taskset")
    if len(cpus) < 2 or taskset is None:
        return []
    return [taskset, "--cpu-list", str(cpus[-1])]


@dataclass(frozen=True)
class PdPair:
    """Base URLs (no /v1) of the two replicas: `prefill` is sent prefill legs, `decode` the
    decode legs; either answers alone as an aggregated replica (no kv_transfer_params)."""

    prefill: str
    decode: str


@contextlib.contextmanager
def pd_pair(options: VllmOptions) -> Iterator[PdPair]:
    """Starts both replicas at once (their minutes of start-up overlap), waits for both under
    `options.start_timeout_s`, yields them; each stopped by pid on exit, with the engine
    processes it started."""
    logs = ROOT / "build" / "realvllm" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        procs = []
        logs_of: list[Path] = []
        for role in ("prefill", "decode"):
            port, side = free_port(), free_port()
            argv = [*confined(), *options.argv(port), "--kv-transfer-config",
                    kv_transfer_config()]
            log = logs / f"vllm-pd-{role}-{port}.log"
            procs.append(stack.enter_context(running(argv, [], env=pd_env(options, side),
                                                     log_path=log, group=True)))  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
            logs_of.append(log)
        for url, proc in zip(urls, procs, strict=True):
            wait_http(url + "/health", timeout=options.start_timeout_s, proc=proc)
        for log in logs_of:  # vLLM found the library (else the connector has no transport)
            if "NIXL is available" not in log.read_text(errors="replace"):
                raise RuntimeError(f"{log}: vLLM did not log 'NIXL is available'")
        pair = PdPair(prefill=urls[0], decode=urls[1])
        handshake(pair, options.served_name)
        yield pair


# Tries per direction at the pair's first transfers (below).
HANDSHAKE_TRIES = 6


def _leg(base: str, body: dict[str, Any], rid: str) -> dict[str, Any] | None:
    r = httpx.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                   timeout=300)
    return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]


def handshake(pair: PdPair, model: str) -> None:
    """Both replicas' first NIXL handshakes, before any test counts transfers: a puller
    meets a holder through its side channel with a 5 s receive timeout hard-coded in vLLM
    0.32 (nixl/base_worker.py), which a holder still warming up on 2 loaded cores can miss
    (seen in a CI run: `handshake_failed`, the decode leg answered 500; the engine caches
    the handshake once it succeeds). D pulls a prompt from P, then P pulls that turn back
    from D, each retried until it succeeds, on a prompt of their own that no test shares."""
    base = {"model": model, "temperature": 0, "return_token_ids": True,
            "max_tokens": 2 * RECOMPUTE_THRESHOLD, "min_tokens": 2 * RECOMPUTE_THRESHOLD,
            "ignore_eos": True}  # fmt: skip
    for _ in range(HANDSHAKE_TRIES):
        rid = f"handshake-{uuid.uuid4().hex}"
        prompt = f"handshake {uuid.uuid4().hex}: " + " ".join(f"w{i}" for i in range(200))
        first = {**base, "prompt": prompt, "max_tokens": 1, "min_tokens": 0}
        pre = _leg(pair.prefill, {**first, "kv_transfer_params": PREFILL_PARAMS}, rid)
        answer = None if pre is None else _leg(
            pair.decode, {**base, "prompt": prompt,
                          "kv_transfer_params": pre["kv_transfer_params"]}, rid)  # fmt: skip
        if answer is not None and answer.get("kv_transfer_params"):
            # P pulls D's turn back: the next prompt extends the turn exactly
            choice = answer["choices"][0]
            turn = [*choice["prompt_token_ids"], *choice["token_ids"]]
            again = {**first, "prompt": [*turn, *turn[:8]],
                     "kv_transfer_params": answer["kv_transfer_params"]}
            if _leg(pair.prefill, again, f"handshake-{uuid.uuid4().hex}") is not None:
                return
        time.sleep(1)
    raise RuntimeError(f"the pair's NIXL handshakes failed {HANDSHAKE_TRIES} times")


def xfer_count(base: str) -> float:
    """KV pulls this replica has completed (as the puller), summed over its engines."""
    text = httpx.get(base + "/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == XFER_COUNT:
            total += sum(s.value for s in family.samples if s.name == XFER_COUNT + "_count")
    return total


def reset_prefix_cache(base: str) -> None:
    """Empties the replica's prefix cache (dev mode), so that the next request computes or
    pulls its prompt rather than finding it local."""
    r = httpx.post(base + "/reset_prefix_cache", timeout=60)
    r.raise_for_status()
    # It refuses (success false) while blocks are held: a running request, or KV kept for a
    # remote puller under its lease.
    assert r.json() == {"success": True}, f"{base}: reset refused: {r.text}"
