"""Which replicas close their connections after every answer (pure; used by proxy/client.py).

Some engines advertise keep-alive and close anyway once a response is written: llama.cpp's
server (cpp-httplib) after every streamed answer. The client checks each pooled connection's
socket before reuse and drops one whose peer has closed it, but the engine's close races the
next request: on a loaded machine the FIN may not be in the kernel yet when the check runs,
and the request then goes out on a dying connection, which nothing may re-send (it may have
been read). A replica whose pooled connections are found closed `after` times in a row
(seen by aiohttp while they idled, or by the check) is taken for such an engine: each of
its answers then closes its connection on the gateway's side, so the next request opens a
fresh one and never meets the race. Every `relearn`-th
answer of such a replica is pooled again, so a replica that starts keeping its connections
(a restart into another engine) is seen with the next check and forgotten.

Bound: at most `max_peers` origins remembered, the oldest forgotten first (the map is keyed
by replica origin, so the configured fleet is far below it)."""

from __future__ import annotations

from collections import OrderedDict

Peer = tuple[str, int]  # (host, port) as the client's connector keys its pool


class ClosingPeers:
    def __init__(self, after: int = 2, relearn: int = 256, max_peers: int = 4096) -> None:
        self._after = max(1, after)
        self._relearn = max(1, relearn)
        self._max = max(1, max_peers)
        self._closed: OrderedDict[Peer, int] = OrderedDict()  # pooled found closed in a row
        self._answers: dict[Peer, int] = {}  # answers closed since the last pooled one

    def checked(self, peer: Peer, still_open: bool) -> None:
        """A pooled connection to `peer` was looked at before reuse."""
        if still_open:
            self._closed.pop(peer, None)
            self._answers.pop(peer, None)
            return
        self._closed[peer] = self._closed.get(peer, 0) + 1
        self._closed.move_to_end(peer)
        while len(self._closed) > self._max:
            gone, _ = self._closed.popitem(last=False)
            self._answers.pop(gone, None)

    def forget(self, peer: Peer) -> None:
        """The replica at `peer` left the fleet."""
        self._closed.pop(peer, None)
        self._answers.pop(peer, None)

    def keep(self, peer: Peer) -> bool:
        """Whether an answer from `peer` should leave its connection in the pool."""
        if self._closed.get(peer, 0) < self._after:
            return True
        n = self._answers.get(peer, 0) + 1
        if n >= self._relearn:
            self._answers[peer] = 0
            return True  # pooled once more: the next check says whether it still closes
        self._answers[peer] = n
        return False
