"""The Redis server's clock, read onto the scheduler's own monotonic clock."""

from __future__ import annotations

import time
from collections import deque

import redis

# How many of the latest clock reads the offset is chosen from.
CLOCK_SAMPLES = 16


class RedisClock:
    """Maps Redis server times (unix microseconds, as TIME gives them) onto time.monotonic().

    Each `sync` reads TIME once. The offset in use is that of the fastest of the latest
    CLOCK_SAMPLES reads: its error is at most half that read's round trip, so one read delayed
    by a busy machine does not move it. After a step of the server's clock, the old offset can
    last up to CLOCK_SAMPLES syncs: times that then map into the future count from now (the
    window counts from the read), times that map too far back release their request at once.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._samples: deque[tuple[float, float]] = deque(maxlen=CLOCK_SAMPLES)
        self._offset_s: float | None = None  # Redis unix seconds minus monotonic seconds

    def sync(self) -> None:
        """Reads the server's clock once."""
        before = time.monotonic()
        seconds, micros = self._client.time()
        after = time.monotonic()
        offset_s = seconds + micros / 1e6 - (before + after) / 2.0
        self._samples.append((after - before, offset_s))
        self._offset_s = min(self._samples)[1]

    @property
    def error_s(self) -> float:
        """At most how far the offset in use is off: half its read's round trip (inf before
        the first `sync`)."""
        return min(self._samples)[0] / 2.0 if self._samples else float("inf")

    def monotonic(self, unix_us: int, now_s: float) -> float:
        """Args: a Redis server time and the monotonic time now.

        Returns: that time on the monotonic clock, never later than `now_s`; `now_s` itself
        before the first `sync`.
        """
        if self._offset_s is None:
            return now_s
        return min(now_s, unix_us / 1e6 - self._offset_s)
