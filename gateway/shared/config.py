"""`[redis]`: shared routing state between gateway instances (the `redis` extra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class RedisSettings:
    url: str | None = None  # e.g. redis://10.0.0.9:6379/0; None: this instance alone
    # keys: <prefix>:routing (one stream of facts), <prefix>:departed (departures)
    prefix: str = "gateway"
    timeout_s: float = 0.5  # per Redis command (never on a request's path: staleness only)
    # The stream's bound, in bytes of Redis memory: each XADD trims it (MAXLEN ~) to as
    # many facts as fit, from the bytes per fact this instance measures on what it writes
    # (bench/RESULTS.md: 256 MiB holds ~12 minutes of 32k-token agent traffic at 500
    # follow-ups a second, and replays in seconds). stream_maxlen caps the count too.
    stream_max_bytes: int = 256 << 20
    stream_maxlen: int = 1_000_000
    # Facts older than this are not applied (a (re)starting instance reads only the last
    # replay_s of the stream, XREAD from that time): a session quiet for 10 minutes weighs
    # e^-10 of a busy one (routing.session_active_s 60 s), and a busy replica has turned
    # its cache over many times. Also the age past which the stream is trimmed (MINID).
    replay_s: float = 600.0
    # A fact carries only the blocks its conversation added since the last fact about it;
    # a whole chain is sent again when the one the deltas hang from is older than this,
    # so an instance replaying replay_s finds a whole chain for every live conversation.
    rebase_s: float = 120.0
    chains_budget: int = 8_000_000  # blocks of chains kept to resolve deltas (8 B each)
    published_capacity: int = 65_536  # chain ends this instance may build deltas on
    # Start-up applies at most the newest catch_up_facts facts of the last replay_s
    # before it serves: a few seconds at 32k-token agent traffic (bench/RESULTS.md).
    catch_up_facts: int = 5_000
    # ... after learning (not applying) the chains of the facts before those, so that
    # their deltas resolve, for at most this long.
    catch_up_s: float = 5.0
    queue_size: int = 20_000  # facts waiting to be written; the oldest go when full
    batch_size: int = 256  # facts per pipelined write
    block_ms: int = 100  # XREAD BLOCK: how long a read waits for new facts
    retry_s: float = 1.0  # pause before reconnecting (doubles up to 10 s)

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://",
                                                             "unix://")):
            raise ValueError("redis.url must be redis://, rediss:// or unix://")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError("redis.prefix must be a non-empty word")
        if not 0 < self.rebase_s <= self.replay_s:
            raise ValueError("redis.rebase_s must be positive and at most redis.replay_s")
        for name in ("timeout_s", "retry_s", "catch_up_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"redis.{name} must be positive")
        for name in ("stream_maxlen", "stream_max_bytes", "queue_size", "batch_size",
                     "block_ms", "chains_budget", "published_capacity", "catch_up_facts"):
            if getattr(self, name) < 1:
                raise ValueError(f"redis.{name} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.url is not None
