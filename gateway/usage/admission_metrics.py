"""The admission queue's families (gateway.admission) on the gateway's registry, present
with admission off too; listed with the others in metrics.py's docstring.

Every class and reason has its series from the start (fixed sets: the admission classes,
SHED_REASONS); tenants as they come (the configured tenants + "none", like the request
series).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.admission.config import CLASSES as ADMISSION_CLASSES
from gateway.admission.shedding import SHED_REASONS
from gateway.usage.record import NONE_LABEL


class AdmissionMetrics:
    def __init__(self, r: CollectorRegistry, wait_buckets: Sequence[float]) -> None:
        queued = Gauge("gateway_admission_queued", "Requests waiting in the gateway's "
                       "admission queue, per priority class.", ("class",), registry=r)
        wait = Histogram("gateway_admission_wait_seconds", "Time admitted requests waited "
                         "in the gateway's queue.", ("class",), registry=r,
                         buckets=wait_buckets)
        shed = Counter("gateway_admission_shed", "Requests the admission queue answered "
                       "429, by reason.", ("reason",), registry=r)
        abandoned = Counter("gateway_admission_abandoned", "Clients that disconnected while "
                            "queued in the gateway.", ("class",), registry=r)
        self._admitted_tokens = Counter(
            "gateway_admission_admitted_tokens", "Estimated prompt tokens admitted, per "
            "tenant.", ("tenant",), registry=r)
        self._queued_children: dict[str, Gauge] = {c: queued.labels(c) for c in ADMISSION_CLASSES}
        self._wait_children: dict[str, Histogram] = {c: wait.labels(c) for c in ADMISSION_CLASSES}
        self._abandoned_children: dict[str, Counter] = {
            c: abandoned.labels(c) for c in ADMISSION_CLASSES}
        self._shed_children: dict[str, Counter] = {m: shed.labels(m) for m in SHED_REASONS}
        self._admitted_children = {NONE_LABEL: self._admitted_tokens.labels(NONE_LABEL)}

    def queued(self, cls: str, waiting: int) -> None:
        self._queued_children[cls].set(waiting)

    def admitted(self, cls: str, tenant: str, tokens: int, waited_s: float) -> None:
        self._wait_children[cls].observe(waited_s)
        child = self._admitted_children.get(tenant)
        if child is None:
            child = self._admitted_children[tenant] = self._admitted_tokens.labels(tenant)
        if tokens > 0:
            child.inc(tokens)

    def shed(self, reason: str) -> None:
        self._shed_children[reason].inc()

    def abandoned(self, cls: str) -> None:
        self._abandoned_children[cls].inc()
