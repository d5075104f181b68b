"""Fair shares between classes and, within a class, between tenants, counted in prompt
tokens (start-time fair queueing over two levels; pure, no clock).

Each class and each (class, tenant) flow has a virtual time: the prompt tokens admitted
for it divided by its weight. The next request to admit comes from the waiting class
with the lowest virtual time, and within it from the waiting tenant with the lowest; ties
go to the higher class, then to the tenant named first. A flow that starts waiting again
after a pause is lifted to the lowest virtual time of the flows waiting beside it
(`activate`), so an idle tenant cannot bank credit and then flood.

`projected_tokens` answers the shedding rule's question: how many prompt tokens are
admitted, under these weights, before a new request of (class, tenant) is: its own
flow's backlog in full, every other flow's up to its weighted share of that time.

State is bounded: a flow's entry is dropped when it stops waiting and its virtual time
is at or below the lowest waiting one (it has no credit to keep); classes are three and
tenants are the configured tenants plus "none".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.admission.config import CLASSES, Priority

Flow = tuple[Priority, str]  # (class, tenant)


class FairShare:
    def __init__(self, class_weight: Callable[[Priority], float],
                 tenant_weight: Callable[[str], float]) -> None:
        self._class_weight = class_weight
        self._tenant_weight = tenant_weight
        self._class_vt: dict[Priority, float] = {}
        self._flow_vt: dict[Flow, float] = {}

    def activate(self, flow: Flow, waiting: Mapping[Flow, float]) -> None:
        """`flow` starts waiting; `waiting` maps the flows already waiting to their
        queued prompt tokens."""
        cls, _ = flow
        if not any(c == cls for c, _ in waiting):
            floor = min((self._class_vt.get(c, 0.0) for c, _ in waiting), default=0.0)
            self._class_vt[cls] = max(self._class_vt.get(cls, 0.0), floor)
        if flow not in waiting:
            same = [self._flow_vt.get(f, 0.0) for f in waiting if f[0] == cls]
            floor = min(same, default=0.0)
            self._flow_vt[flow] = max(self._flow_vt.get(flow, 0.0), floor)

    def order(self, waiting: Mapping[Flow, float],
              recent: Callable[[Flow], float] = lambda _: 0.0) -> list[Flow]:
        """The waiting flows, the one to serve first at the head. Equal virtual times
        (a flow that just started waiting is lifted to the others') go to the flow with
        the smaller `recent` part of its class's tokens, not to the first name."""
        def key(flow: Flow) -> tuple[float, int, float, float, str]:
            cls, tenant = flow
            return (self._class_vt.get(cls, 0.0), CLASSES.index(cls),
                    self._flow_vt.get(flow, 0.0), recent(flow), tenant)
        return sorted(waiting, key=key)

    def charge(self, flow: Flow, tokens: float) -> None:
        cls, tenant = flow
        self._class_vt[cls] = self._class_vt.get(cls, 0.0) + tokens / self._class_weight(cls)
        self._flow_vt[flow] = self._flow_vt.get(flow, 0.0) + tokens / self._tenant_weight(tenant)

    def forget_idle(self, waiting: Mapping[Flow, float]) -> None:
        """Drop the entries of flows no longer waiting that hold no credit."""
        floor = min((self._flow_vt.get(f, 0.0) for f in waiting), default=float("inf"))
        for flow in [f for f in self._flow_vt if f not in waiting]:
            if self._flow_vt[flow] <= floor:
                del self._flow_vt[flow]
        if not waiting:
            self._class_vt.clear()
            self._flow_vt.clear()

    def projected_tokens(self, flow: Flow, tokens: float,
                         waiting: Mapping[Flow, float]) -> float:
        """Prompt tokens admitted before a new request of `tokens` in `flow` is
        (itself included), given the tokens each flow has waiting."""
        cls, tenant = flow
        own = waiting.get(flow, 0.0) + tokens
        # within its class: every other tenant gets up to its weighted share of `own`
        w_own = self._tenant_weight(tenant)
        in_class = own + sum(min(q, own * self._tenant_weight(t) / w_own)
                             for (c, t), q in waiting.items() if c == cls and t != tenant)
        # between classes: the same rule, a class's whole backlog as one flow
        by_class: dict[Priority, float] = {}
        for (c, _), q in waiting.items():
            if c != cls:
                by_class[c] = by_class.get(c, 0.0) + q
        w_cls = self._class_weight(cls)
        return in_class + sum(min(q, in_class * self._class_weight(c) / w_cls)
                              for c, q in by_class.items())


class RecentTokens:
    """Prompt tokens admitted per (class, tenant) flow lately: each flow's sum decays by
    half every `half_life_s` (time is a parameter). What `shedding.over_share` compares:
    a tenant's part of its class's recent tokens against its weighted share. Bounded by
    the flows (3 classes x tenants); a flow whose sum decayed below one token is dropped."""

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self._sums: dict[Flow, tuple[float, float]] = {}  # flow -> (tokens, as of)

    def _at(self, flow: Flow, now: float) -> float:
        tokens, then = self._sums.get(flow, (0.0, now))
        decay: float = 0.5 ** (max(0.0, now - then) / self._half_life_s)
        return tokens * decay

    def add(self, flow: Flow, tokens: float, now: float) -> None:
        self._sums[flow] = (self._at(flow, now) + tokens, now)
        for f in [f for f in self._sums if self._at(f, now) < 1.0]:
            del self._sums[f]

    def part(self, flow: Flow, now: float) -> float:
        """`flow`'s part (0..1) of the tokens its class admitted lately (0 when none)."""
        cls = flow[0]
        total = sum(self._at(f, now) for f in self._sums if f[0] == cls)
        return self._at(flow, now) / total if total > 0 else 0.0
