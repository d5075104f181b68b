"""The admission queue tried from outside, on loopback with real `gateway sim` replicas
(one process each, killed by their process id) and a gateway configured as users do
(`enabled = true` and nothing else): what clients waiting in the queue get when the whole
fleet goes away."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.servers import free_port, gateway
from tests.test_admission_faults import ENV, body, fill, replica, until, wait_queued


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
