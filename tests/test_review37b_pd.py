"""Second outside review of issue 37: P/D's decoder-KV reuse ([pd] reuse_decoder_kv) and a
decode replica whose address changes under its name while a request to it runs (a pod
rescheduled: the fix for flow.finish says such a request teaches nothing of the new
server; the params a decoder returns are a fact about its KV, the old server's)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gateway.pd.config import PdConfig
from gateway.proxy.flow import Turn
from gateway.proxy.pd_path import PdPath
from gateway.replicas.fleet import Fleet
from gateway.settings import ReplicaSettings
from tests.test_pd_pullback import PARAMS, assistant, chat, decide, setup, user


def pd_path(fleet: Fleet, router: Any) -> PdPath:
    """PdPath with what `answered` uses (fleet, router, pullback, clock); the request
    path's collaborators are not reached by it."""
    none = cast(Any, None)
    return PdPath(config=PdConfig(reuse_decoder_kv=True), fleet=fleet, router=router,
                  flow=none, upstream=none, monitor=none, counters=none, timeouts=none,
                  clock=time.time)


@pytest.mark.parametrize(("during", "handed_out"), [
    ("nothing", PARAMS),  # the same server answered: its params are reused next turn
    ("replaced", None),   # d1 is another server now: the old one's blocks are not there
])
def test_params_of_a_replaced_decoder_are_not_kept(during: str, handed_out: Any) -> None:
    """A decode request to d1 (the Replica the turn holds) answers with kv_transfer_params
    after d1's address changed (remove, add: a new incarnation). Those params name blocks
    on the old server; the next turn must not send them to P to pull from the new one.
    Found: gateway/proxy/pd_path.py:161-165 `answered` looks d1 up by name
    (`self.fleet.replicas.get(ex.replica)`), not `turn.replica` with `fleet.current`, and
    PullBack.remember (gateway/pd/pullback.py:70, `_refresh`) takes the name: it records
    the new server as the one the entry was made with, so `take` hands the old server's
    params out ("same")."""
    fleet, router, _ = setup()
    pd = pd_path(fleet, router)
    plan = decide(router, fleet, chat(user("hello")), "s")
    ex = SimpleNamespace(status=200, replica="d1",
                         outcome=SimpleNamespace(kv_params=PARAMS, reply_text="hi there",
                                                  reasoned=False, token_ids=None))
    turn = Turn(cast(Any, ex), cast(Any, None))
    turn.plan = plan
    turn.replica = fleet.replicas["d1"]  # sent to the server d1 was then
    if during == "replaced":
        fleet.remove("d1")
        fleet.add(ReplicaSettings(name="d1", url="http://d1:2", role="decode"))
        fleet.probe_result("d1", True, time.time())
    pd.answered(turn, cast(Any, SimpleNamespace(endpoint="chat", kind="chat")))
    nxt = decide(router, fleet, chat(user("hello"), assistant("hi there"), user("more")), "s")
    assert pd.pullback.take(nxt, time.time()) == handed_out
