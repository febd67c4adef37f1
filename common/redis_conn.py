"""Redis connections that fail fast, and retry loops with exponential backoff.

Clients are created without redis-py's own retries so that a call fails within
its socket timeout when Redis is down (the gateway turns that into UNAVAILABLE);
long-running loops wrap their work in `retry_forever` to reconnect with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

T = TypeVar("T")
# The errors that mean "Redis is unreachable right now": retry, or answer UNAVAILABLE.
REDIS_DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError)
log = logging.getLogger(__name__)


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


async def retry_forever(
    operation: Callable[[], Awaitable[T]], what: str, backoff: Backoff = Backoff()
) -> T:
    """Run `operation` until it does not fail with a REDIS_DOWN_ERRORS error.

    Args:
        operation: a coroutine factory, called once per try.
        what: what it does, for the log line of each failure.
        backoff: delays between tries.

    Returns:
        The first successful result.
    """
    for delay_s in backoff.delays():
        try:
            return await operation()
        except REDIS_DOWN_ERRORS as error:
            log.warning("redis unreachable while %s (%s); retrying in %.2fs", what, error, delay_s)
            await asyncio.sleep(delay_s)
    raise AssertionError("Backoff.delays is endless")


def retry_forever_sync(operation: Callable[[], T], what: str, backoff: Backoff = Backoff()) -> T:
    """The blocking twin of `retry_forever`."""
    for delay_s in backoff.delays():
        try:
            return operation()
        except REDIS_DOWN_ERRORS as error:
            log.warning("redis unreachable while %s (%s); retrying in %.2fs", what, error, delay_s)
            time.sleep(delay_s)
    raise AssertionError("Backoff.delays is endless")
