"""Routing facts: what one gateway instance learned that the others should know, and their
wire form (pure).

Several instances behind a load balancer share what they route through Redis
(gateway/shared/): each publishes the facts below as it makes them and applies the others'
to its own router, so every decision still reads local memory only.

- `Sent`: a request's prompt blocks went to a replica (vLLM caches them as it schedules
  it); with the client's session id, or marked as an implicit conversation so the receiver
  groups it with the conversation its blocks extend.
- `Reply`: the blocks of a generated answer, cached by the replica too.
- `Dropped`: blocks recorded at send time that the replica never scheduled.
- `Trust`: the fraction of its nominal capacity the feedback trusts a replica's index with
  (a capacity correction).
- `Response`: the replica that stored a Responses API response.
- `Restarted`: a replica restarted (its cache is empty): facts about it from before no
  longer hold. With the engine's process start time when it shows one, so that instances
  tell one restart seen twice from two restarts by it, not by how close in time they came
  (routing/restarts.py).
- `Departed`: a replica left the fleet (gateway.replicas.departure): whatever comes back
  under its name is another server with an empty cache, so facts about it from before
  the departure no longer hold (gateway/shared/departures.py; not a router's business).

Every fact is applied at the time it happened (the envelope's `at`), not when it arrives:
a session last seen an hour ago weighs what an hour-old session weighs.

Wire form: a Redis stream entry, a flat map of short byte keys; hashes are packed as
little-endian uint64. Sized by what is new: a `Sent` or `Reply` whose chain extends one
its publisher sent before carries only the blocks after it, plus a reference (`base`: the
earlier chain's last hash and its length) the receiver resolves against the chains it
has seen (gateway/shared/chains.py); a `Dropped` carries only the blocks it drops.
`decode` validates everything: an entry written by another version, or by anyone with
access to the key, must never crash or corrupt a router, so anything malformed raises
`FactError`.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_BLOCKS = 1 << 17  # 8 MiB of prompt at 64 bytes a block: a sane bound on one fact
MAX_NAME = 256


class FactError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Sent:
    replica: str
    hashes: Sequence[int]
    session: str | None = None  # the client's session id
    implicit: bool = False  # no session id: an implicit conversation
    tenant: str | None = None  # the API key's tenant: sessions and conversations are its own


@dataclass(frozen=True, slots=True)
class Reply:
    replica: str
    hashes: Sequence[int]
    held: int  # leading blocks already recorded by the request


@dataclass(frozen=True, slots=True)
class Dropped:
    replica: str
    hashes: Sequence[int]
    keep: int


@dataclass(frozen=True, slots=True)
class Trust:
    replica: str
    fraction: float


@dataclass(frozen=True, slots=True)
class Response:
    response_id: str
    replica: str


@dataclass(frozen=True, slots=True)
class Restarted:
    replica: str
    started: float | None = None  # the engine's process start time (unix s), when shown


@dataclass(frozen=True, slots=True)
class Departed:
    replica: str


Fact = Sent | Reply | Dropped | Trust | Response | Restarted | Departed


def _pack(hashes: Sequence[int]) -> bytes:
    a = array("Q", hashes)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack(raw: bytes) -> list[int]:
    if len(raw) % 8 or len(raw) // 8 > MAX_BLOCKS:
        raise FactError("bad block hashes")
    a = array("Q")
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# A reference to a chain published before: (hash of its last block, its length in blocks).
Base = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Envelope:
    origin: str  # the instance that learned it
    at: float  # when it happened (unix seconds; propagation delay = now - at)
    fact: Fact  # with `base`: a Sent/Reply whose `hashes` are those after the base's
    base: Base | None = None


def encode(fact: Fact, origin: str, at: float, base: Base | None = None
           ) -> dict[bytes, bytes]:
    """The stream entry for `fact`, published by instance `origin` at `at`. With `base`
    (a Sent or Reply whose hashes extend that chain) only the hashes after it are sent."""
    out: dict[bytes, bytes] = {b"o": origin.encode(), b"a": repr(at).encode()}
    if isinstance(fact, (Sent, Reply)):
        hashes = fact.hashes
        if base is not None:
            tip, length = base
            if not 0 < length <= len(hashes) or hashes[length - 1] != tip:
                raise ValueError("base is not a prefix of the fact's chain")
            out |= {b"b": _pack((tip,)), b"l": str(length).encode()}
            hashes = hashes[length:]
        out |= {b"r": fact.replica.encode(), b"h": _pack(hashes)}
        if isinstance(fact, Reply):
            out |= {b"k": b"r", b"n": str(fact.held).encode()}
        else:
            out[b"k"] = b"s"
            if fact.session is not None:
                out[b"s"] = fact.session.encode("utf-8", "surrogatepass")
            if fact.implicit:
                out[b"c"] = b"1"
            if fact.tenant is not None:
                out[b"t"] = fact.tenant.encode("utf-8", "surrogatepass")
    elif isinstance(fact, Dropped):
        # drop_from forgets hashes[keep:] only: the rest is not sent.
        out |= {b"k": b"d", b"r": fact.replica.encode(),
                b"h": _pack(fact.hashes[max(0, fact.keep):]), b"n": b"0"}
    elif isinstance(fact, Trust):
        out |= {b"k": b"t", b"r": fact.replica.encode(), b"f": repr(fact.fraction).encode()}
    elif isinstance(fact, Restarted):
        out |= {b"k": b"x", b"r": fact.replica.encode()}
        if fact.started is not None:
            out[b"e"] = repr(fact.started).encode()
    elif isinstance(fact, Departed):
        out |= {b"k": b"g", b"r": fact.replica.encode()}
    else:
        out |= {b"k": b"p", b"r": fact.replica.encode(), b"i": fact.response_id.encode()}
    return out


def _text(fields: Mapping[bytes, bytes], key: bytes) -> str:
    raw = fields.get(key)
    if raw is None:
        raise FactError(f"missing field {key.decode()}")
    if len(raw) > 4 * MAX_NAME:
        raise FactError(f"field {key.decode()} too long")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FactError(f"field {key.decode()} is not UTF-8") from None


def _int(fields: Mapping[bytes, bytes], key: bytes) -> int:
    raw = fields.get(key, b"")
    if not raw.isdigit() or len(raw) > 9:
        raise FactError(f"field {key.decode()} is not a count")
    return int(raw)


def _time(fields: Mapping[bytes, bytes], key: bytes) -> float:
    """A finite number of seconds (NaN, infinities and words are malformed)."""
    raw = fields.get(key, b"")
    try:
        value = float(raw) if len(raw) <= 64 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise FactError(f"field {key.decode()} is not a time")
    return value


def decode(fields: Mapping[bytes, bytes]) -> Envelope:
    """The envelope of a stream entry; raises FactError for anything malformed."""
    origin = _text(fields, b"o")
    at = _time(fields, b"a")
    base: Base | None = None
    if b"b" in fields:
        if fields.get(b"k") not in (b"s", b"r"):
            raise FactError("a base on a fact that takes none")
        tip = _unpack(fields[b"b"])
        length = _int(fields, b"l")
        if len(tip) != 1 or length < 1:
            raise FactError("bad base")
        base = (tip[0], length)
    return Envelope(origin, at, _fact(fields, base[1] if base else 0), base)


def _fact(fields: Mapping[bytes, bytes], before: int) -> Fact:
    """`before`: blocks the base stands for (the hashes field holds those after it)."""
    kind = fields.get(b"k")
    if kind == b"p":
        return Response(_text(fields, b"i"), _text(fields, b"r"))
    replica = _text(fields, b"r")
    if kind == b"g":
        return Departed(replica)
    if kind == b"x":
        return Restarted(replica, _time(fields, b"e") if b"e" in fields else None)
    if kind == b"t":
        try:
            fraction = float(fields.get(b"f", b""))
        except ValueError:
            raise FactError("field f is not a number") from None
        if not 0.0 <= fraction <= 1.0:
            raise FactError("trust fraction out of [0, 1]")
        return Trust(replica, fraction)
    hashes = _unpack(fields.get(b"h", b""))
    if before + len(hashes) > MAX_BLOCKS:
        raise FactError("bad block hashes")
    if kind == b"s":
        session = _text(fields, b"s") if b"s" in fields else None
        tenant = _text(fields, b"t") if b"t" in fields else None
        return Sent(replica, hashes, session, fields.get(b"c") == b"1", tenant)
    if kind == b"r":
        return Reply(replica, hashes, min(_int(fields, b"n"), before + len(hashes)))
    if kind == b"d":
        return Dropped(replica, hashes, _int(fields, b"n"))
    raise FactError(f"unknown fact kind {kind!r:.20}")
