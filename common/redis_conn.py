"""Redis connections that fail fast, and the backoff of the loops that wait Redis out.

Clients are created without redis-py's own retries so that a call fails within
its socket timeout when Redis is down (the gateway turns that into UNAVAILABLE);
each long-running loop catches REDIS_DOWN_ERRORS itself, logs once, and tries
again after the next `Backoff` delay.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

# The errors that mean "Redis is unreachable right now": retry, or answer UNAVAILABLE.
REDIS_DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter.

    Delay i is uniform in [0, min(max_s, initial_s * 2**i)].
    """

    initial_s: float = 0.05
    max_s: float = 2.0

    def delays(self) -> Iterator[float]:
        """An endless sequence of delays in seconds."""
        ceiling = self.initial_s
        while True:
            yield random.uniform(0.0, ceiling)
            ceiling = min(self.max_s, ceiling * 2)


def connect(url: str, *, timeout_s: float = 1.0) -> aioredis.Redis:
    """An asyncio Redis client that raises a REDIS_DOWN_ERRORS error within about `timeout_s`.

    Args:
        url: redis://, rediss:// or unix:// URL.
        timeout_s: connect and socket timeout; blocking commands (XREAD BLOCK) must block less.

    Returns:
        A client with no automatic retries; connections are made lazily.
    """
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


def connect_sync(url: str, *, timeout_s: float = 1.0) -> redis.Redis:
    """A blocking Redis client; the same contract as `connect`."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
