"""The admission queue tried from outside, on loopback with real `gateway sim` replicas
(one process each, killed by their process id) and a gateway configured as users do
(`enabled = true` and nothing else): what clients waiting in the queue get when the whole
fleet goes away."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.servers import free_port, gateway
from tests.test_admission_faults import (
    ENV,
    admission,
    body,
    fill,
    hold,
    queued,
    replica,
    replica_with,
    until,
    wait_queued,
)


def ask_error(url: str, i: int) -> tuple[int, str, float]:
    """(status, error code, when answered: time.monotonic())."""
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/chat/completions", content=body(f"waiter {i} says hi", 4),
                   headers={"content-type": "application/json"})
    code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
    return r.status_code, code, time.monotonic()


def test_waiters_are_told_at_once_when_no_replica_is_left() -> None:
    """Both replicas killed while 20 requests wait: each is answered 503
    `no_healthy_replica` (what a request arriving then is told) once the probes see them
    down, not held to its class's 30 s and told it was overloaded (429)."""
    port_a, port_b = free_port(), free_port()
    with replica(port_a) as (a, pid_a), replica(port_b) as (b, pid_b), \
            gateway([a, b], env=ENV) as url, ThreadPoolExecutor(20) as pool:
        holders = fill(url, 2)
        waiters = [pool.submit(ask_error, url, i) for i in range(20)]
        wait_queued(url, 20, waiters)
        os.kill(pid_a, signal.SIGKILL)
        os.kill(pid_b, signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: httpx.get(url + "/ready", timeout=10).json()["healthy"] == [])
        answers = [w.result(timeout=120) for w in waiters]
        for s in holders:
            s.close()
    assert [a[:2] for a in answers] == [(503, "no_healthy_replica")] * 20, answers
    # long before normal's 30 s max wait (probes every 0.2 s; a loaded machine's slack)
    assert max(a[2] for a in answers) - killed < 20.0


def seq_limit(url: str, name: str) -> int | None:
    limit: int | None = admission(url)["replicas"].get(name, {}).get("seq_limit")
    return limit


def test_a_replica_restarted_with_fewer_sequences_is_learned_again() -> None:
    """A replica seen running 8 at once while requests waited, killed and started again
    with --max-num-seqs 2 (the same address): the gate learns 2, not the old 8 for ever
    (with 8 kept, three more than it runs went to its engine, where no class can pass)."""
    port = free_port()
    name = f"127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        a, pid = stack.enter_context(replica_with(port, ["--max-num-seqs", "8"]))
        url = stack.enter_context(gateway([a], env=ENV))
        holders = fill_until(url, lambda: seq_limit(url, name) == 8)
        os.kill(pid, signal.SIGKILL)
        for s in holders:
            s.close()
        until(lambda: httpx.get(url + "/ready", timeout=10).json()["healthy"] == [])
        stack.enter_context(replica_with(port, ["--max-num-seqs", "2"]))
        holders = fill_until(url, lambda: seq_limit(url, name) == 2)
        for s in holders:
            s.close()


def fill_until(url: str, learned: Callable[[], bool]) -> list[socket.socket]:
    """Holders until one waits in the gateway and `learned()` (bounded: 40 holders)."""
    holders: list[socket.socket] = []
    for i in range(40):
        holders.append(hold(url, f"holder {i} " * 20))
        with contextlib.suppress(AssertionError):
            until(lambda: queued(url) > 0, timeout=1.0)
            break
    until(learned)
    return holders
