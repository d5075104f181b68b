"""Which replicas close their connections after every answer (gateway/proxy/closing.py), by
table: found closed `after` times in a row marks a replica, found open forgets it, a marked
replica's answers are pooled again once every `relearn`, and the map keeps `max_peers`."""

from __future__ import annotations

import pytest

from gateway.proxy.closing import ClosingPeers

A = ("127.0.0.1", 8001)
B = ("127.0.0.1", 8002)


@pytest.mark.parametrize(("checks", "keeps"), [
    ([], True),  # never seen: pooled, as keep-alive says
    ([False], True),  # one close may be an idle timeout or a restart
    ([False, False], False),  # twice in a row: it closes after answers
    ([False, True, False], True),  # an open one in between: not in a row
    ([False, False, True], True),  # found open again: forgotten
    ([False, False, False, False], False),
])
def test_a_replica_is_marked_by_closes_in_a_row(checks: list[bool], keeps: bool) -> None:
    peers = ClosingPeers(after=2)
    for still_open in checks:
        peers.checked(A, still_open)
    assert peers.keep(A) is keeps
    assert peers.keep(B) is True  # another replica is not concerned


def test_a_marked_replica_is_pooled_again_once_every_relearn_answers() -> None:
    peers = ClosingPeers(after=1, relearn=4)
    peers.checked(A, False)
    assert [peers.keep(A) for _ in range(9)] == [False, False, False, True] * 2 + [False]
    peers.checked(A, True)  # the pooled one was still open at the next request
    assert peers.keep(A) is True


def test_the_map_keeps_at_most_max_peers_oldest_forgotten_first() -> None:
    peers = ClosingPeers(after=1, max_peers=2)
    for port in (1, 2, 3):
        peers.checked(("h", port), False)
    assert peers.keep(("h", 1)) is True  # forgotten: the oldest of three
    assert peers.keep(("h", 2)) is False and peers.keep(("h", 3)) is False
    assert len(peers._closed) == 2 and len(peers._answers) <= 2
