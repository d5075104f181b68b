"""What the gate's in-process tests build: a healthy replica as the fleet holds it, a
clock that ticks a millisecond per read, a gate with one request of room per replica
before a real Router, and a one-message chat request in a class."""

from __future__ import annotations

import itertools
from typing import Any

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate
from gateway.replicas.fleet import Replica
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics


def replica(name: str) -> Replica:
    return Replica(settings=ReplicaSettings(name=name, url=f"http://{name}:8000"), healthy=True)


class Clock:
    def __init__(self) -> None:
        self.t = itertools.count()

    def __call__(self) -> float:
        return float(next(self.t)) * 0.001


def gate(**cfg: Any) -> tuple[Gate, Router]:
    routing = RoutingConfig()
    router = Router(routing)
    config = AdmissionConfig(enabled=True, replica_max_in_flight=1,
                             default_priority_cap="high", recheck_s=0.001, **cfg)
    return Gate(config, routing, router, GatewayMetrics(), Clock(), Clock()), router


def ask(text: str, cls: str = "normal", tenant: str | None = None) -> Ask:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return Ask(body, "chat", "m", None, None, tenant, cls.encode(), 0.0)


def gate_with(config: AdmissionConfig) -> tuple[Gate, Router]:
    """A gate on `config` as it is (no defaults added) before a real Router."""
    routing = RoutingConfig()
    router = Router(routing)
    return Gate(config, routing, router, GatewayMetrics(), Clock(), Clock()), router
