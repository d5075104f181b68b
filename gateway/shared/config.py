"""`[redis]`: shared routing state between gateway instances (the `redis` extra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class RedisSettings:
    url: str | None = None  # e.g. redis://10.0.0.9:6379/0; None: this instance alone
    prefix: str = "gateway"  # keys: <prefix>:routing (one stream of facts)
    timeout_s: float = 0.5  # per Redis command (never on a request's path: staleness only)
    stream_maxlen: int = 200_000  # facts kept for a (re)starting instance (XADD MAXLEN ~)
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
        for name in ("timeout_s", "retry_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"redis.{name} must be positive")
        for name in ("stream_maxlen", "queue_size", "batch_size", "block_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"redis.{name} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.url is not None
